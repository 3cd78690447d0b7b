"""ns_dtype="auto" / ns_method="auto" on this machine: is the default the fastest exact step, and how do
the three Muons compare at their own defaults?

One process, one thread (what each rank of ``make demo`` runs), everything interleaved in one run:

(a) per NS dtype × method, on the demo's GPT (examples/gpt.GPT, d=128, 4 layers) and on a wide bank
    (4×256×1024, 4×1024×256, 4×256²): the NS rate (the standard iteration's FLOPs per second, so the
    methods compare on the same work) against this machine's fp32 GEMM rate, the error of the NS result
    against the float64 polar factor (U Vᵀ of the SVD), and the whole ``Muon.step()`` time; then the
    default (auto, auto) step against the fastest of the choices (must be within 1.1×);
(b) ds_muon, torch.optim.Muon and DeepSpeed's Muon (``SingleDeviceMuon``), each at its defaults, on the
    same gradients: step time and the error of each matrix's update direction against its gradient's
    float64 polar factor (the update rescaled by the least-squares factor, so the libraries' different
    lr scalings do not count).

Also prints what auto picks on each table row (the CPU flag sets and CUDA capabilities of
ds_muon.rules.ns_auto, the readers mocked): this machine's speed cannot show another CPU's.
Times: median over ``--repeats``; process CPU time beside wall time (the box may be shared).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

from common import header, table
from gpt import GPT

import ds_muon
from ds_muon.rules import ns_auto
from ds_muon.rules.newton_schulz import newton_schulz, ns_flops

CHOICES = [(dt, m) for dt in ("bfloat16", "float16", "float32") for m in ("standard", "gram")] + [("auto", "auto")]


class Bank(nn.Module):
    """Wide and tall matrices, where Gram saves FLOPs, and square ones, where it does not (linear maps
    [out, in]: 4 of 256x1024, 4 of 1024x256, 4 of 256x256)."""

    def __init__(self):
        super().__init__()
        self.mats = nn.ModuleList(nn.Linear(i, o, bias=False) for o, i in
                                  [(256, 1024)] * 4 + [(1024, 256)] * 4 + [(256, 256)] * 4)

    def forward(self, x):  # (never called: the gradients are drawn)
        return x


def _matrices(model):
    return [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n
            and "pos" not in n]


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    return {p: torch.randn(p.shape, generator=g) * torch.logspace(0, -2, p.shape[-1]) for p in model.parameters()}


def _set(model, grads):
    for p in model.parameters():
        p.grad = grads[p].clone()


def _polar(G):
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


def _direction_error(update, P):
    """‖αΔ − P‖/‖P‖ with the α that minimises it: the error of the update's direction."""
    d = update.double()
    alpha = (d * P).sum() / (d * d).sum().clamp_min(1e-300)
    return float((alpha * d - P).norm() / P.norm())


def _gemm_rate(repeats):
    A = torch.randn(16, 128, 128)
    torch.baddbmm(A, A, A)
    t = []
    for _ in range(repeats * 3):
        t0 = time.process_time()
        torch.baddbmm(A, A, A, beta=0.5)
        t.append(time.process_time() - t0)
    return 2 * 16 * 128 ** 3 / statistics.median(t)


def _time(fn, repeats):
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def part_a(name, model, repeats, fp32_rate):
    mats = _matrices(model)
    grads = _grads(model, 0)
    polars = [_polar(grads[p]) for p in mats]
    work = sum(ns_flops(p.shape[0], p.shape[1], 5, "standard") for p in mats)
    opts = {}
    for dt, m in CHOICES:
        opts[(dt, m)] = ds_muon.Muon(ds_muon.muon_param_groups(model), ns_dtype=dt, ns_method=m, log_summary=False)
    ns_t = {c: [] for c in CHOICES}
    step_t = {c: [] for c in CHOICES}
    for k in range(repeats + 1):  # interleaved; the first round warms up
        for c in CHOICES:
            dt = ns_auto.resolve_dtype(c[0], "cpu")
            c0 = time.process_time()
            for p in mats:
                newton_schulz(grads[p], 5, "keller", dt, method=c[1])
            c1 = time.process_time()
            _set(model, grads)
            c2, w2 = time.process_time(), time.perf_counter()
            opts[c].step()
            c3, w3 = time.process_time(), time.perf_counter()
            if k:
                ns_t[c].append(c1 - c0)
                step_t[c].append((c3 - c2, w3 - w2))
    rows, steps = [], {}
    for c in CHOICES:
        dt = ns_auto.resolve_dtype(c[0], "cpu")
        errs = [_direction_error(newton_schulz(grads[p], 5, "keller", dt, method=c[1]), P) for p, P in zip(mats, polars)]
        ns_s = statistics.median(ns_t[c])
        cpu = statistics.median(s for s, _ in step_t[c])
        wall = statistics.median(w for _, w in step_t[c])
        steps[c] = cpu
        rows.append((f"{c[0]}/{c[1]}", f"{work / ns_s / 1e9:.1f}", f"{work / ns_s / fp32_rate:.2f}",
                     f"{statistics.median(errs):.4f}", f"{max(errs):.4f}", f"{cpu * 1e3:.1f}", f"{wall * 1e3:.1f}"))
    print(f"\n## (a) {name}: {len(mats)} Muon matrices, {work / 1e9:.3f} GFLOP of standard NS per step")
    table(["ns_dtype/method", "NS GFLOP/s", "x fp32 GEMM", "err vs polar (median)", "(max)",
           "step ms (CPU)", "step ms (wall)"], rows)
    best = min((c for c in CHOICES if c != ("auto", "auto")), key=lambda c: steps[c])
    ratio = steps[("auto", "auto")] / steps[best]
    print(f"default (auto/auto -> {ns_auto.choice('cpu').dtype}) step / fastest choice ({best[0]}/{best[1]}): "
          f"{ratio:.2f}x (CPU time) {'OK' if ratio <= 1.1 else 'ABOVE 1.1x'}")
    return ratio


def part_b(name, model, repeats):
    mats = _matrices(model)
    grads = _grads(model, 1)
    polars = {p: _polar(grads[p]) for p in mats}
    # split_fused=False: every library orthogonalizes the same matrices (ds_muon's default splits a fused
    # qkv into q, k and v, whose polar factors are not the fused matrix's)
    libs = {"ds_muon (auto)": lambda: ds_muon.Muon(ds_muon.muon_param_groups(model, split_fused=False),
                                                   log_summary=False),
            "torch.optim.Muon": lambda: torch.optim.Muon(mats)}
    try:
        from deepspeed.runtime.zero.muon.original_muon import SingleDeviceMuon, ns_compute_dtype
        libs[f"DeepSpeed Muon (gram, {str(ns_compute_dtype('gram')).replace('torch.', '')})"] = \
            lambda: SingleDeviceMuon(mats)
        import torch._dynamo
        torch._dynamo.config.suppress_errors = True
    except ImportError:
        print("(deepspeed not installed: its Muon is left out)")
    opts = {k: f() for k, f in libs.items()}
    times = {k: [] for k in libs}
    errs = {}
    for k in range(repeats + 2):  # interleaved; two rounds warm up (DeepSpeed compiles)
        for lib, opt in opts.items():
            before = {p: p.detach().clone() for p in mats}
            if lib not in errs:  # zero weights: the update is the NS result alone, whatever the decay default
                with torch.no_grad():  # (torch.optim.Muon decays by 0.1 by default, the others by 0)
                    for p in mats:
                        p.zero_()
            _set(model, grads)
            c0, w0 = time.process_time(), time.perf_counter()
            opt.step()
            c1, w1 = time.process_time(), time.perf_counter()
            if k >= 2:
                times[lib].append((c1 - c0, w1 - w0))
            if lib not in errs:  # the first step (momentum from zero): the update is the gradient's NS
                errs[lib] = [_direction_error(p.detach().clone(), polars[p]) for p in mats]
            with torch.no_grad():
                for p in mats:
                    p.copy_(before[p])
    rows = [(lib, f"{statistics.median(c for c, _ in times[lib]) * 1e3:.1f}",
             f"{statistics.median(w for _, w in times[lib]) * 1e3:.1f}", f"{statistics.median(errs[lib]):.4f}",
             f"{max(errs[lib]):.4f}") for lib in libs]
    print(f"\n## (b) {name}: each library at its defaults (error: the first step, momentum from zero)")
    table(["optimizer", "step ms (CPU)", "step ms (wall)", "update err vs polar (median)", "(max)"], rows)


def auto_table():
    rows = []
    real_cpu, real_cuda = ns_auto.read_cpuinfo, ns_auto.cuda_capability
    cases = [("this machine", None, None),
             ("Intel Xeon, AMX", ("GenuineIntel", {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}), None),
             ("AMD EPYC, avx512_bf16", ("AuthenticAMD", {"avx2", "avx512f", "avx512_bf16"}), None),
             ("AMD EPYC, AVX2 only", ("AuthenticAMD", {"avx2", "fma"}), None),
             ("CUDA sm90", None, (9, 0)), ("CUDA sm80", None, (8, 0)), ("CUDA sm75", None, (7, 5))]
    try:
        for label, cpu, cuda in cases:
            ns_auto.reset()
            if cpu is not None:
                ns_auto.read_cpuinfo = lambda cpu=cpu: (cpu[0], frozenset(cpu[1]))
            ns_auto.cuda_capability = (lambda cuda=cuda: cuda) if cuda else real_cuda
            c = ns_auto.choice("cuda" if cuda else "cpu")
            rows.append((label, c.device, c.dtype, ", ".join(sorted(c.gram)) or "-"))
            ns_auto.read_cpuinfo = real_cpu
    finally:
        ns_auto.read_cpuinfo, ns_auto.cuda_capability = real_cpu, real_cuda
        ns_auto.reset()
    print("\n## what auto picks (table rows; the readers mocked)")
    table(["device", "entry", "ns_dtype auto", "Gram (where it saves FLOPs) in"], rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore")  # muon_param_groups' notes on the bank, inductor's deprecations
    header("ns_dtype/ns_method auto: the default against every choice, and three Muons at their defaults")
    fp32_rate = _gemm_rate(args.repeats)
    print(f"this machine's fp32 GEMM (baddbmm 16x128x128, one thread): {fp32_rate / 1e9:.1f} GFLOP/s; "
          f"auto: {ns_auto.choice('cpu').describe()}")
    auto_table()
    for name, make in (("demo GPT (d=128, 4 layers)", GPT), ("wide bank", Bank)):
        torch.manual_seed(0)
        part_a(name, make(), args.repeats, fp32_rate)
        torch.manual_seed(0)
        part_b(name, make(), args.repeats)  # a fresh model: muon_param_groups records on the parameters


if __name__ == "__main__":
    main()
