"""Optimizer overhead on the demo model: FSDP2 at W=2, ds_muon vs AdamW, the duplicated
baseline, and overlap=True (4 waves, gathers sent from backward, updates applied in the
next forward; benchmarks/overlap.py breaks down what that hides).

Times forward + backward + step and step() alone per iteration (medians of the
slowest rank), for the GPT of examples/gpt.py with the demo's sizes, and prints
Muon's overhead relative to AdamW.  With overlap, step() returns before the last
scatters land; their wait moves into the next forward, so compare iteration times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from common import header, table

import dist_harness
import ds_muon
from gpt import GPT, batch, split, stdlib_bytes


def _worker(rank, world, optimizer, iters, warmup, ns_dtype, d, layers):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(d=d, layers=layers, seq=128)
    mesh = init_device_mesh("cpu", (world,))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    else:
        overlap = optimizer == "ds_muon overlap"
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=3e-3), ns_dtype=ns_dtype,
                           mode="duplicated" if optimizer == "ds_muon duplicated" else "sharded",
                           overlap=overlap, waves=4, model=model if overlap else None)
    data, _ = split(stdlib_bytes(1_000_000))
    g = torch.Generator().manual_seed(rank)
    total, steps = [], []
    for i in range(warmup + iters):
        x, y = batch(data, 16, 128, g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        t = torch.tensor([t2 - t0, t2 - t1], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= warmup:
            total.append(t[0].item())
            steps.append(t[1].item())
    return statistics.median(total), statistics.median(steps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    header(f"Optimizer overhead, GPT d={args.d} x {args.layers} layers, FSDP2, 2 gloo ranks, 16 x 128 tokens per rank")
    res = {}
    for name, dt in (("adamw", None), ("ds_muon", torch.bfloat16), ("ds_muon", torch.float32),
                     ("ds_muon duplicated", torch.bfloat16), ("ds_muon overlap", torch.bfloat16)):
        key = name if dt is None else f"{name} ({str(dt).replace('torch.', '')} NS)"
        res[key] = dist_harness.run(_worker, 2, name, args.iters, args.warmup, dt, args.d, args.layers,
                                    timeout=900)[0]
    base_total, base_step = res["adamw"]
    rows = [[k, tot * 1e3, st * 1e3, tot / base_total, (st - base_step) * 1e3] for k, (tot, st) in res.items()]
    table(["optimizer", "iteration ms", "step() ms", "iteration / AdamW", "step overhead over AdamW ms"], rows)


if __name__ == "__main__":
    main()
