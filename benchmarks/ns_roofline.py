"""Newton–Schulz against the machine's matmul rate and against torch.optim.Muon's NS, interleaved.

One thread (as one rank runs its home stacks; ``--threads`` for more).  Each round times, back to
back (the order reversed every other round): one 2048² GEMM (the reference rate), then per stack
of the bank ds_muon's NS as the optimizer's step runs it on a home stack (``ds``:
:class:`~ds_muon.engine.memory.budget.ChunkedNS` with the memory budget of the bank's fp32 momenta, the
kernel forms and chunking :mod:`ds_muon.rules.ns_kernels` chooses on this machine, results written
into the stack's own memory; the stack is refilled from fp32 outside the timing, as the gather
fills it), ``newton_schulz()`` on the whole stack with a contiguous result, the same with every
product pinned batched (the old code: ``bmm``/``baddbmm``), and torch.optim.Muon's own NS
matrix by matrix (``torch.optim._muon._zeropower_via_newtonschulz``, fp32 input as ours; it computes in bf16
only, so its fp32 column runs the same loop in fp32; tall results are its transposed views, no copy).  The machine's matmul rate swings
2-3× from minute to minute, so every figure is the median over rounds of *that round's*
ratio, never a ratio of figures taken apart.  Rates are FLOPs over process CPU time on a
CPU (wall beside it) and over synchronized wall time on a GPU.

``--device cuda`` reports the NS rate as a fraction of the GPU's dense bf16 peak
(``--peak-tflops``, default the H200's 989) and adds Gram NS (``ns_method="gram"``, which
iterates in fp16 when asked for bf16).  ``--calibrate`` first runs
:func:`ds_muon.rules.ns_kernels.calibrate` and prints what it measured per class.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import header, table

from ds_muon.engine.memory.budget import ChunkedNS, budget_bytes
from ds_muon.engine.plan.compile import ns_settings
from ds_muon.rules import ns_kernels
from ds_muon.rules.newton_schulz import KELLER, newton_schulz, ns_flops

BANK = [(8, 512, 512), (4, 1536, 512), (4, 512, 1536), (4, 384, 1024)]
STEPS = 5
DEVICE = "cpu"
COMPILED = None  # --compile: ds_muon's NS under torch.compile (compiled_newton_schulz)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn):
    """(device-or-CPU seconds, wall seconds) of one call (``fn``: a callable, or (untimed setup, callable))."""
    if isinstance(fn, tuple):
        fn[0]()
        fn = fn[1]
    _sync()
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    _sync()
    wall = time.perf_counter() - w0
    return (wall if DEVICE == "cuda" else time.process_time() - c0), wall


def torch_muon_ns(G: torch.Tensor, dtype: torch.dtype):
    """torch.optim.Muon's NS on each matrix of the stack; in fp32 its loop, cast to fp32 instead of bf16."""
    if dtype == torch.bfloat16:
        from torch.optim._muon import _zeropower_via_newtonschulz

        return [_zeropower_via_newtonschulz(g, KELLER, STEPS, 1e-7) for g in G]
    a, b, c = KELLER
    out = []
    for g in G:
        x = g.to(dtype)
        if g.size(0) > g.size(1):
            x = x.T
        x = x.div_(x.norm().clamp(min=1e-7))
        for _ in range(STEPS):
            A = x @ x.T
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            x = torch.addmm(x, B, x, beta=a)
        out.append(x.T if g.size(0) > g.size(1) else x)
    return out


def bare_products(G, dtype):
    """One NS step's three products as plain ``bmm`` (no fused scaled add, no copies) on the stack in
    the wide orientation: the rate no exact form of the iteration can beat."""
    m, n = min(G.shape[-2:]), max(G.shape[-2:])
    X = torch.randn(G.size(0), m, n, device=G.device).to(dtype) / (m * n) ** 0.5
    A = torch.bmm(X, X.mT)
    B, Y = torch.empty_like(A), torch.empty_like(X)

    def run():
        torch.bmm(X, X.mT, out=A)
        torch.bmm(A, A, out=B)
        torch.bmm(B, X, out=Y)
    return run


def engine(G, dtype):
    """What the optimizer's step runs on a home stack (ds_muon.engine.plan.compile / budget): ChunkedNS on
    the stack, its results in the stack's own memory; (refill the stack from G, run NS)."""
    ns = ns_settings(dict(ns_steps=STEPS, ns_coefficients="keller", ns_dtype=dtype, eps=1e-7, ns_method="standard"))
    run = ChunkedNS(ns, budget_bytes([r * c * 4 for b, r, c in BANK for _ in range(b)]))
    stack = torch.empty_like(G)
    return (lambda: stack.copy_(G)), (lambda: run.run(stack))


def ours(G, dtype, method="standard", pinned=None):
    def run():
        if pinned is not None:  # the old code: every product batched, whole stacks
            ns_kernels.pin(form=pinned)
            ns_kernels.pin_chunk_bytes(0)
        try:
            newton_schulz(G, STEPS, "keller", dtype, method=method).contiguous()
        finally:
            if pinned is not None:
                ns_kernels.pin()
                ns_kernels.pin_chunk_bytes(None)
    return run


def roofline(dtype, rounds, with_gram):
    """Rows per stack and for the bank, each a median of per-round ratios."""
    name = str(dtype).replace("torch.", "")
    a, b = (torch.randn(2048, 2048, device=DEVICE).to(dtype) for _ in range(2))
    gemm = lambda: torch.mm(a, b)  # noqa: E731
    stacks = [torch.randn(s, generator=torch.Generator().manual_seed(0)).to(DEVICE) for s in BANK]
    flops = [s[0] * ns_flops(s[1], s[2], STEPS) for s in BANK]
    bare_flops = [f / STEPS for f in flops]  # one step's products
    cols = {"ds": lambda G: engine(G, dtype), "whole": lambda G: ours(G, dtype),
            "batched": lambda G: ours(G, dtype, pinned="batched"),
            "torch": lambda G: (lambda: torch_muon_ns(G, dtype)), "bare": lambda G: bare_products(G, dtype)}
    if with_gram:
        cols["gram"] = lambda G: ours(G, dtype, method="gram")
    if COMPILED is not None:
        cols["compiled"] = lambda G: (lambda: COMPILED(G, STEPS, "keller", dtype).contiguous())
    fns = {k: [mk(G) for G in stacks] for k, mk in cols.items()}
    gemm()
    for per in fns.values():
        for f in per:
            timed(f)  # warm-up
    # per round: the GEMM's seconds, and per column the (cpu, wall) seconds of each stack
    rec = []
    for r in range(rounds):
        g_cpu, _ = timed(gemm)
        row = {"gemm": g_cpu}
        for k, per in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
            row[k] = [timed(f) for f in per]
        rec.append(row)
    gemm_flops = 2.0 * 2048**3

    def med(values):
        return statistics.median(values)

    rows = []
    for j in list(range(len(BANK))) + [None]:
        pick = (lambda r, k: r[k][j]) if j is not None else (
            lambda r, k: tuple(sum(x) for x in zip(*r[k])))  # noqa: E731
        fl = flops[j] if j is not None else sum(flops)
        gemm_rate = [gemm_flops / r["gemm"] for r in rec]
        ds_rate = [fl / pick(r, "ds")[0] for r in rec]
        bare_rate = [(bare_flops[j] if j is not None else sum(bare_flops)) / pick(r, "bare")[0] for r in rec]
        row = [name, "x".join(map(str, BANK[j])) if j is not None else "bank",
               med(gemm_rate) / 1e12, med(ds_rate) / 1e12,
               f"{med([d / g for d, g in zip(ds_rate, gemm_rate)]):.2f}",
               f"{med([b / g for b, g in zip(bare_rate, gemm_rate)]):.2f}",
               f"{med([pick(r, 'whole')[0] / pick(r, 'ds')[0] for r in rec]):.2f}",
               f"{med([pick(r, 'batched')[0] / pick(r, 'ds')[0] for r in rec]):.2f}",
               f"{med([pick(r, 'torch')[0] / pick(r, 'ds')[0] for r in rec]):.2f}",
               med([pick(r, "ds")[0] for r in rec]) * 1e3, med([pick(r, "ds")[1] for r in rec]) * 1e3,
               med([pick(r, "torch")[0] for r in rec]) * 1e3, med([pick(r, "torch")[1] for r in rec]) * 1e3]
        if COMPILED is not None:
            row += [f"{med([pick(r, 'compiled')[0] / pick(r, 'ds')[0] for r in rec]):.2f}"]
        if with_gram:
            g_rate = [fl / pick(r, "gram")[0] for r in rec]  # standard FLOPs: the rate of the same result
            row += [f"{med([x / g for x, g in zip(g_rate, gemm_rate)]):.2f}"]
        rows.append(row)
    return rows


def print_calibration(dtypes):
    print("Calibration (ds_muon.rules.ns_kernels.measure: each product's forms interleaved, median ms;"
          " '=' the batched form's bits)\n")
    print(f"load average before: {open('/proc/loadavg').read().split(' ', 3)[:3]}")
    rows = []
    for dtype in dtypes:
        for product in ns_kernels.PRODUCTS:
            for transposed in ((False,) if product == "poly" else (False, True)):
                for bucket, shape in ns_kernels.CALIBRATION_STACKS.items():
                    res = ns_kernels.measure(product, dtype, DEVICE, transposed, bucket)
                    rows.append([str(dtype).replace("torch.", ""), product, "transposed" if transposed else "contiguous",
                                 f"{bucket} {'x'.join(map(str, shape))}"]
                                + [f"{res[f][0] * 1e3:.3f}{'=' if res[f][1] else '≠'}" for f in ns_kernels.FORMS])
    table(["dtype", "product", "input", "class (stack)"] + list(ns_kernels.FORMS), rows)
    chunks = ns_kernels.measure_chunks(dtypes[0], DEVICE)
    print(f"Chunk budgets on {'x'.join(map(str, ns_kernels.CHUNK_STACK))} "
          f"({str(dtypes[0]).replace('torch.', '')}), median ms ('=' whole stacks' bits):",
          ", ".join(f"{b // 2**20} MiB: {t * 1e3:.2f}{'=' if same else '≠'}" for b, (t, same) in chunks.items()), "\n")
    chosen = ns_kernels.calibrate(DEVICE, dtypes)
    print("calibrated choices (not batched):",
          [(k[1:], f) for k, f in sorted(chosen.items()) if f != "batched"] or "none",
          f"chunk budget {ns_kernels.chunk_bytes(DEVICE)}", "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--calibrate", action="store_true", help="measure the forms first and use what is fastest")
    ap.add_argument("--compile", action="store_true", help="add compiled NS (compile=True) as compiled/eager time")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: one rank's share of a CPU)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for --device cuda (H200: 989)")
    args = ap.parse_args()
    global DEVICE, COMPILED
    DEVICE = args.device
    if args.compile:
        from ds_muon.rules.newton_schulz import compiled_newton_schulz

        COMPILED = compiled_newton_schulz()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ns_roofline.py --device cuda: no CUDA device here")
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    header(f"Newton–Schulz vs GEMM 2048² vs torch.optim.Muon's NS, {STEPS} Keller steps, {args.rounds} interleaved "
           "rounds, medians of per-round ratios"+ (" (GPU: device time)" if DEVICE == "cuda" else
                                                     f", {args.threads} thread(s), process CPU time"))
    print(f"ds_muon.rules.ns_kernels: family {ns_kernels.family(DEVICE)}, table {ns_kernels.fingerprint()}\n")
    if args.calibrate:
        print_calibration(dtypes)
    print(f"load average before: {open('/proc/loadavg').read().split(' ', 3)[:3]}")
    rows = []
    for dtype in dtypes:
        rows += roofline(dtype, args.rounds, with_gram=DEVICE == "cuda" and dtype == torch.bfloat16)
    print(f"load average after: {open('/proc/loadavg').read().split(' ', 3)[:3]}\n")
    headers = ["dtype", "stack", "GEMM TF/s", "NS TF/s", "NS/GEMM", "bare bmm/GEMM", "whole/engine", "batched/chosen",
               "torch/ds_muon",
               "ds CPU ms", "ds wall ms", "torch CPU ms", "torch wall ms"]
    if DEVICE == "cuda":
        headers[9], headers[11] = "ds device ms", "torch device ms"
        headers.insert(5, f"NS/peak {args.peak_tflops:g}")
        headers += ["compiled/eager"] if COMPILED is not None else []
        headers.append("Gram(fp16)/GEMM")
        for r in rows:
            r.insert(5, f"{r[3] / args.peak_tflops:.3f}")
            r.extend([""] * (len(headers) - len(r)))
    elif COMPILED is not None:
        headers.append("compiled/eager")
    table(headers, rows)
    print("NS/GEMM: NS FLOP rate over the 2048² GEMM's; bare bmm/GEMM: one step's three products as plain bmm "
          "(no scaled adds, no copies: the ceiling of any exact form) over the GEMM's; whole/engine: newton_schulz() on the "
          "whole stack (contiguous result) over the step's path; batched/chosen: the old all-batched NS time over the chosen "
          "forms'; torch/ds_muon: torch.optim.Muon's NS time over ds_muon's (above 1: ds_muon faster).")


if __name__ == "__main__":
    main()
