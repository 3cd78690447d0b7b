"""Newton–Schulz against the machine's matmul rate: how close the iteration gets to one GEMM.

One thread (as one rank runs its home stacks).  Per dtype, the reference rate is one
2048² GEMM (the same work as a large product, no batching) and, per shape, the three
products of one NS step timed alone on the same stack (``X·Xᵀ``, ``A·A``, ``B·X``; the
best an iteration built from them can do).  NS runs the shape's stack as ds_muon runs a
home stack (5 Keller steps, eager and, where torch.compile works, compiled).  Every
rate is FLOPs over process CPU time (the machine is shared: wall time is printed
beside it), medians of interleaved repeats.  A profile of the eager NS on each stack
says where the rest goes: GEMMs, copies (the ``baddbmm`` input copy and the
orientation/cast copies), the normalisation.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import header, table

from ds_muon.newton_schulz import compiled_newton_schulz, newton_schulz, ns_flops

BANK = [(8, 512, 512), (4, 1536, 512), (4, 512, 1536), (4, 384, 1024)]
STEPS = 5


DEVICE = "cpu"


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cpu_and_wall(fns, repeats):
    """Median (process CPU s, wall s) of each fn, the fns interleaved per repeat.  On a GPU
    the first is the device time (wall, synchronized): the host only queues the work."""
    cpu = [[] for _ in fns]
    wall = [[] for _ in fns]
    for fn in fns:
        fn()  # warm-up (and compile)
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            _sync()
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            _sync()
            cpu[k].append(time.process_time() - c0)
            wall[k].append(time.perf_counter() - w0)
    if DEVICE == "cuda":
        cpu = wall
    return [(statistics.median(c), statistics.median(w)) for c, w in zip(cpu, wall)]


def step_products(batch, m, n, dtype):
    """One NS step's three products, on the shapes and with the forms the iteration uses."""
    X = torch.randn(batch, m, n, device=DEVICE).to(dtype) / (m * n) ** 0.5
    A = torch.bmm(X, X.mT)
    B = torch.empty_like(A)
    Y = torch.empty_like(X)

    def run():
        torch.bmm(X, X.mT, out=A)
        torch.baddbmm(A, A, A, beta=-4.775, alpha=2.0315, out=B)
        torch.baddbmm(X, B, X, beta=3.4445, out=Y)
    return run


def profile_rows(G, dtype):
    """Self CPU ms per op group of one eager NS on ``G`` (a profile of 3 runs)."""
    from torch.profiler import profile

    groups = {"aten::bmm": "GEMM", "aten::baddbmm": "GEMM", "aten::copy_": "copies",
              "aten::linalg_vector_norm": "norm", "aten::div": "norm", "aten::div_": "norm", "aten::clamp_": "norm"}
    with profile() as prof:
        for _ in range(3):
            newton_schulz(G, STEPS, "keller", dtype).contiguous()
        _sync()
    out = {"GEMM": 0.0, "copies": 0.0, "norm": 0.0, "other": 0.0}
    for ev in prof.key_averages():
        out[groups.get(ev.key, "other")] += ev.self_cpu_time_total / 1e3 / 3
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(1)
    header(f"Newton–Schulz vs GEMM rate, {STEPS} Keller steps, one thread, rates over process CPU time"
           + (" (GPU: over device time)" if DEVICE == "cuda" else ""))
    compiled = None if args.no_compile else compiled_newton_schulz()
    rows, prof = [], []
    totals = {}
    for dtype in (torch.bfloat16, torch.float32):
        a, b = (torch.randn(2048, 2048, device=DEVICE).to(dtype) for _ in range(2))
        [(gemm_cpu, _)] = cpu_and_wall([lambda: torch.mm(a, b)], args.repeats)
        gemm_rate = 2 * 2048**3 / gemm_cpu
        name = str(dtype).replace("torch.", "")
        for batch, r, c in BANK:
            G = torch.randn(batch, r, c, generator=torch.Generator().manual_seed(0)).to(DEVICE)
            flops = batch * ns_flops(r, c, STEPS)
            m, n = min(r, c), max(r, c)
            fns = [step_products(batch, m, n, dtype), lambda: newton_schulz(G, STEPS, "keller", dtype).contiguous()]
            if compiled is not None:
                fns.append(lambda: compiled(G, STEPS, "keller", dtype).contiguous())
            res = cpu_and_wall(fns, args.repeats)
            step_flops = batch * (4.0 * m * m * n + 2.0 * m**3)
            prod_rate = step_flops / res[0][0]
            ns_cpu, ns_wall = res[1]
            ns_rate = flops / ns_cpu
            row = [name, f"{batch}x{r}x{c}", gemm_rate / 1e12, prod_rate / 1e12, ns_rate / 1e12,
                   f"{ns_rate / gemm_rate:.2f}", f"{ns_rate / prod_rate:.2f}", ns_cpu * 1e3, ns_wall * 1e3]
            t = totals.setdefault(name, [0.0, 0.0, 0.0, gemm_rate])
            t[0] += flops
            t[1] += ns_cpu
            if compiled is not None:
                row += [flops / res[2][0] / 1e12, f"{res[2][0] / ns_cpu:.2f}"]
                t[2] += res[2][0]
            rows.append(row)
            if DEVICE != "cpu":
                continue  # the profile's self times are host times: meaningful on the CPU only
            p = profile_rows(G, dtype)
            total = sum(p.values())
            prof.append([name, f"{batch}x{r}x{c}", total] + [f"{p[k] / total:.1%}" for k in ("GEMM", "copies", "norm",
                                                                                                "other")])
    for name, (flops, ns_cpu, comp_cpu, gemm_rate) in totals.items():
        row = [name, "bank", gemm_rate / 1e12, "", flops / ns_cpu / 1e12, f"{flops / ns_cpu / gemm_rate:.2f}", "",
               ns_cpu * 1e3, ""]
        if compiled is not None:
            row += [flops / comp_cpu / 1e12, f"{comp_cpu / ns_cpu:.2f}"]
        rows.append(row)
    headers = ["dtype", "stack", "GEMM 2048² TF/s", "step products TF/s", "NS TF/s", "NS/GEMM", "NS/products",
               "NS CPU ms", "NS wall ms"]
    if compiled is not None:
        headers += ["compiled NS TF/s", "compiled/eager CPU"]
    table(headers, rows)
    if not prof:
        return
    print("Where eager NS spends its CPU time (torch.profiler self time, per NS call):\n")
    table(["dtype", "stack", "ms", "GEMM", "copies", "norm", "other"], prof)


if __name__ == "__main__":
    main()
