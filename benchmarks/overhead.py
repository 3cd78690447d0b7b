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

import torch

from common import fsdp2_gpt, header, table, timed_iterations

import dist_harness
import ds_muon


def _worker(rank, world, optimizer, iters, warmup, ns_dtype, d, layers):
    model = fsdp2_gpt(world, d, layers)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    else:
        overlap = optimizer == "ds_muon overlap"
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=3e-3), ns_dtype=ns_dtype,
                           mode="duplicated" if optimizer == "ds_muon duplicated" else "sharded",
                           overlap=overlap, waves=4, model=model if overlap else None)
    total, step, _ = timed_iterations(model, opt, rank, iters, warmup)
    return total, step


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
