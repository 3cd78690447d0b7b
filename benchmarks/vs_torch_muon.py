"""ds_muon against torch.optim.Muon on one process, each at its defaults, by phase (issue 50).

One thread, the same matrices and gradients, rounds interleaved (ds_muon, torch, ds_muon, ...), medians of
process CPU time with wall time beside it.  Only matrices: both optimizers get the same 2-D weights (torch's
Muon takes nothing else), so the step compared is the Muon step.  Models:

* the demo GPT (``examples/gpt.GPT``: d=128, 4 layers, its 16 hidden matrices);
* the wide bank (4×256×1024, 4×1024×256, 4×256²);
* a Llama-shaped bank: the q/k/v/o and gate/up/down matrices of 7B layers at 1/8 of the width
  (d=512, ff=1376: 7B's 4096 and 11008 divided by 8, its aspect ratios kept), 2 layers — 7B's own
  4096×11008 matrices take tens of seconds of NS each on a 2-core CPU.

Beside them, a floor: torch's NS FLOPs at the machine's bf16 GEMM rate (one 2048² GEMM timed in every
round). ds_muon's bf16 NS ran at 0.92-0.96 of that rate on the AMD EPYC, bare products at 0.99-1.03 (``ns_roofline.py``). Where the floor
is most of torch's step, no optimizer running the same products can be much faster than torch's.

Then a profile of ds_muon's step by phase (``torch.profiler`` record_function ranges of the runtime's
stages, where present, and the NS products), and the same for torch's.

An AVX2-only EPYC, simulated on an AVX-512 one: ``DS_MUON_CPU_FLAGS="AuthenticAMD:avx2 fma"`` makes ds_muon's
auto decide as there (fp32), and the kernel libraries' own ISA limits make every GEMM run the code such a
machine runs (``ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2``: on the AMD
EPYC bf16 ``mm`` then ran at 2.3 GFLOP/s, fp32 at 74; issue 41 measured 1.5-1.7 and 55 on a real AVX2
EPYC). The header says which of these are set. The flags alone change only ds_muon's choice, not the speed.

    python benchmarks/vs_torch_muon.py [--repeats 7] [--only gpt,wide,llama]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from common import GEMM_SIZE, gemm_timer, header, table
from gpt import GPT

import ds_muon
from ds_muon.rules import ns_auto
from ds_muon.rules.newton_schulz import ns_flops


ISA_LIMITS = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")  # the kernel libraries' own


class Bank(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.mats = nn.ParameterList(nn.Parameter(torch.randn(o, i) / i ** 0.5) for o, i in shapes)


def wide_bank():
    return Bank([(256, 1024)] * 4 + [(1024, 256)] * 4 + [(256, 256)] * 4)


def llama_bank(layers=2, d=512, ff=1376):
    return Bank([(d, d)] * 4 * layers + [(ff, d)] * 2 * layers + [(d, ff)] * layers)


def gpt_matrices():
    model = GPT()
    groups = ds_muon.muon_param_groups(model)
    return [p for g in groups if g["use_muon"] for p in g["params"]]


def _grads(mats, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) * torch.logspace(0, -2, p.shape[-1]) for p in mats]


def _timed(opt, mats, grads):
    for p, g in zip(mats, grads):
        p.grad = g.clone()
    c0, w0 = time.process_time(), time.perf_counter()
    opt.step()
    return time.process_time() - c0, time.perf_counter() - w0


def torch_ns_flops(mats) -> float:
    """FLOPs of torch.optim.Muon's NS products on ``mats`` (5 standard steps, whatever the machine)."""
    return sum(ns_flops(p.shape[0], p.shape[1], 5) for p in mats)


def compare(name, mats, repeats, floor=True):
    """One row: both optimizers' step times and, with ``floor``, torch's NS products at the GEMM rate."""
    grads = _grads(mats)
    ours = ds_muon.Muon([{"params": mats, "use_muon": True}], lr=0.02, log_summary=False)
    theirs = torch.optim.Muon(mats, lr=0.02)
    gemm, gemm_flops = gemm_timer(torch.bfloat16) if floor else (None, 1.0)  # torch.optim.Muon's NS dtype
    flops = torch_ns_flops(mats)
    times = {"ds_muon": [], "torch.optim.Muon": [], "floor": []}
    for k in range(repeats + 2):  # interleaved; two warm-up rounds
        for label, opt in (("ds_muon", ours), ("torch.optim.Muon", theirs)):
            t = _timed(opt, mats, grads)
            if k >= 2:
                times[label].append(t)
        g = gemm() if floor else float("nan")
        if k >= 2:  # torch's NS products at this round's GEMM rate
            times["floor"].append((flops * g / gemm_flops,) * 2)
    cpu = {k: statistics.median(c for c, _ in v) for k, v in times.items()}
    wall = {k: statistics.median(w for _, w in v) for k, v in times.items()}
    per_round = lambda a, b: statistics.median(x[0] / y[0] for x, y in zip(times[a], times[b]))  # noqa: E731
    return (name, len(mats), f"{cpu['ds_muon'] * 1e3:.1f}", f"{wall['ds_muon'] * 1e3:.1f}",
            f"{cpu['torch.optim.Muon'] * 1e3:.1f}", f"{wall['torch.optim.Muon'] * 1e3:.1f}",
            f"{per_round('ds_muon', 'torch.optim.Muon'):.2f}", f"{cpu['floor'] * 1e3:.1f}" if floor else "-",
            f"{per_round('floor', 'torch.optim.Muon'):.2f}" if floor else "-"), ours, grads


def profile(opt, mats, grads, rounds=5):
    """Self CPU time per op (and per record_function range) over ``rounds`` steps."""
    from torch.profiler import ProfilerActivity, profile as prof

    for p, g in zip(mats, grads):
        p.grad = g.clone()
    with prof(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(rounds):
            opt.step()
    rows = []
    events = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    for e in events[:14]:
        rows.append((e.key[:48], e.count // rounds, f"{e.self_cpu_time_total / rounds / 1e3:.2f}",
                     f"{e.self_cpu_time_total / total:.2f}"))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", default="gpt,wide,llama")
    ap.add_argument("--profile", action="store_true", help="print each optimizer's ops by self CPU time")
    args = ap.parse_args()
    torch.set_num_threads(1)
    header("ds_muon vs torch.optim.Muon, one process, one thread, each at its defaults")
    flags = os.environ.get(ns_auto.FLAGS_ENV)
    print(f"ns_dtype auto -> {ns_auto.resolve_dtype('auto', 'cpu')}"
          + (f" (CPU flags simulated: {ns_auto.FLAGS_ENV}={flags!r})" if flags else ""))
    limits = {k: os.environ[k] for k in ISA_LIMITS if k in os.environ}
    print(f"kernel ISA: ATen {torch.backends.cpu.get_cpu_capability()}"
          + (f", limited by {' '.join(f'{k}={v}' for k, v in limits.items())}" if limits else ", not limited"))
    builders = {"demo GPT": gpt_matrices, "wide bank": lambda: list(wide_bank().parameters()),
                "Llama-shaped bank": lambda: list(llama_bank().parameters())}
    keys = {"gpt": "demo GPT", "wide": "wide bank", "llama": "Llama-shaped bank"}
    rows, profiled = [], []
    for key in args.only.split(","):
        name = keys[key]
        torch.manual_seed(0)
        mats = builders[name]()
        row, ours, grads = compare(name, mats, args.repeats, floor=not limits)
        rows.append(row)
        if args.profile:
            theirs = torch.optim.Muon(mats, lr=0.02)
            profiled.append((name, profile(ours, mats, grads), profile(theirs, mats, grads)))
    table(["model", "matrices", "ds_muon CPU ms", "(wall)", "torch.optim.Muon CPU ms", "(wall)",
           "ds_muon / torch (CPU)", "NS products at GEMM rate, ms", "floor / torch"], rows)
    print(f"ds_muon / torch and floor / torch: medians of per-round ratios. NS products at GEMM rate: torch.optim.Muon's "
          f"NS FLOPs (5 bf16 standard steps) over one {GEMM_SIZE}² bf16 GEMM's rate, timed in each round. The bank's "
          "stacks' bare products ran at 0.99-1.03 of that rate (ns_roofline.py, bf16, AMD EPYC), so 'floor / torch' "
          "is about the least ds_muon / torch any optimizer could reach with the same products, with the rest of its "
          "step free. Not priced under ISA limits ('-'): there the 2048² bf16 GEMM takes another code path than the "
          "products.")
    for name, a, b in profiled:
        print(f"\n## {name}: ds_muon, ops by self CPU time per step")
        table(["op", "calls/step", "ms/step", "share"], a)
        print(f"\n## {name}: torch.optim.Muon")
        table(["op", "calls/step", "ms/step", "share"], b)


if __name__ == "__main__":
    main()
