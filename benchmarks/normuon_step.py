"""NorMuon's cost in one process: ``Muon.step()`` with ``variant="normuon"`` against plain Muon.

The same matrices (a transformer block's shapes at width ``--d``, ``--layers`` blocks) and gradients;
both optimizers step in the same process, alternating per repeat (A, B, A, B, ...), and the table
gives each one's median step in wall time and process CPU time, and the median of the per-pair
ratios (the machine is shared: compare only figures of one run).  NorMuon adds, per matrix at its
home, a float32 pass over the NS result (mean squares per row, two Frobenius norms, a divide and a
scale) and, at W > 1, one all_reduce of ``rows`` floats per matrix; this measures the first only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from common import header, table

import ds_muon


def _block_shapes(d: int):
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]  # qkv, out, up, down


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--ns-dtype", default="bfloat16")
    args = ap.parse_args()
    header(f"NorMuon step vs Muon step, one process, d={args.d}, {args.layers} blocks, NS {args.ns_dtype}")
    torch.manual_seed(0)
    shapes = _block_shapes(args.d) * args.layers
    runs = {}
    for variant in ("muon", "normuon"):
        params = [nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
        opt = ds_muon.Muon([{"params": params}], variant=variant, ns_dtype=args.ns_dtype, log_summary=False)
        runs[variant] = (params, opt)
    grads = [torch.randn(s) for s in shapes]

    def step(variant):
        params, opt = runs[variant]
        for p, g in zip(params, grads):
            p.grad = g
        w0, c0 = time.perf_counter(), time.process_time()
        opt.step()
        return time.perf_counter() - w0, time.process_time() - c0

    for variant in runs:  # warm-up: state, layouts, compiled exchanges
        step(variant)
    samples = {v: [] for v in runs}
    for _ in range(args.repeats):
        for variant in runs:
            samples[variant].append(step(variant))
    wall_ratio = statistics.median(b[0] / a[0] for a, b in zip(samples["muon"], samples["normuon"]))
    cpu_ratio = statistics.median(b[1] / a[1] for a, b in zip(samples["muon"], samples["normuon"]))
    rows = [[v, statistics.median(s[0] for s in samples[v]) * 1e3, statistics.median(s[1] for s in samples[v]) * 1e3]
            for v in runs]
    table(["variant", "step wall ms (median)", "step CPU ms (median)"], rows)
    print(f"normuon / muon, median of {args.repeats} interleaved pairs: wall {wall_ratio:.3f}x, CPU {cpu_ratio:.3f}x")


if __name__ == "__main__":
    main()
