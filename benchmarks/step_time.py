"""Optimizer step time at W=2 (gloo): sharded vs duplicated vs single-process.

An NS-dominated stack of 24 matrices (512×512, 512×2048, 2048×512), in two
layouts: replicated (DDP: every rank holds every matrix) and a flat partition
(ZeRO-1/2 / FSDP1: each rank one contiguous half of all matrices end to end).
Each rank runs one thread; medians of the slowest rank over the timed steps.
Also prints what the planner's cost model (the one ``ds-muon plan`` uses) predicts
for the same plans, with its two rates measured here: NS FLOP/s on one thread and
gloo all_to_all bytes/s between the two ranks.
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
from ds_muon.engine.plan import costs
from ds_muon.engine.exchange.layout import ParamBinding, slots_in_range
from ds_muon.rules.newton_schulz import ns_flops
from ds_muon.engine.plan.cost_model import CostModel

SHAPES = [(512, 512), (512, 2048), (2048, 512)] * 8


class _HandAdapter:
    """The flat layout this benchmark lays out by hand, as a ds_muon stack adapter."""

    applies_in_step = False
    data_parallel_group = None

    def __init__(self, describe):
        self.describe = describe

    def bind(self, param, name, context):
        return self.describe(param)

    def grad_final_at_hook(self, param, context):
        return False


def _worker(rank, world, layout, mode, steps, warmup, ns_dtype):
    torch.manual_seed(0)
    mats = [torch.randn(s) * 0.02 for s in SHAPES]
    if layout == "replicated" or mode == "single":
        params = [nn.Parameter(m) for m in mats]
        describe = None
    else:
        offsets, pos = [], 0
        for i, m in enumerate(mats):
            offsets.append((f"m{i}", tuple(m.shape), pos))
            pos += m.numel()
        lo, hi = pos * rank // world, pos * (rank + 1) // world
        flat = nn.Parameter(torch.cat([m.reshape(-1) for m in mats])[lo:hi].clone())
        flat._ds_muon_flat = True
        params = [flat]
        describe = lambda p: ParamBinding(p, lambda t: t.reshape(-1), slots_in_range(offsets, lo, hi))  # noqa: E731
    group = None
    if mode in ("single", "torch"):  # one process does everything: a group of just this rank
        group = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    if mode == "torch":  # torch.optim.Muon in one process (its NS is bf16 only)
        opt = torch.optim.Muon(params, lr=0.02, weight_decay=0.0)
    else:
        opt = ds_muon.Muon(params, lr=0.02, ns_dtype=ns_dtype, mode="sharded" if mode == "single" else mode,
                           process_group=group, adapter=describe and _HandAdapter(
                               lambda p: ParamBinding(p, lambda t: t.reshape(-1), describe(p).matrices, group=group)))
    times = []
    for s in range(warmup + steps):
        for p in params:
            p.grad = torch.randn_like(p)
        dist.barrier()
        t0 = time.perf_counter()
        if mode not in ("single", "torch") or rank == 0:
            opt.step()
        elapsed = time.perf_counter() - t0
        t = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if s >= warmup:
            times.append(t.item())
    sent = sum(e.bytes_sent for e in opt.exchanges()) if isinstance(opt, ds_muon.Muon) else 0
    return statistics.median(times), sent


def _calibrate(rank, world, ns_dtype):
    """NS FLOP/s on one thread, and all_to_all bytes/s per rank (sent + received over time)."""
    G = torch.randn(4, 512, 2048)
    t_ns = statistics.median(_timed(lambda: ds_muon.newton_schulz(G, dtype=ns_dtype)) for _ in range(3))
    n = 8 * 2**20 // 2  # 8 MiB of bf16 each way
    send, recv = torch.zeros(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    times = []
    for _ in range(4):
        dist.barrier()
        times.append(_timed(lambda: dist.all_to_all_single(recv, send)))
    moved = 2 * (n // 2) * 2  # half of the buffer goes to the other rank, and as much comes back
    return 4 * ns_flops(512, 2048, 5) / t_ns, moved / statistics.median(times[1:])


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def modelled_ms(layout, mode, ns_dtype, cm):
    shapes = SHAPES
    elem = torch.empty((), dtype=ns_dtype).element_size()
    tasks = costs.tasks_for(shapes, 2, layout, 5, elem)
    if mode == "single":
        return sum(t.flops for t in tasks) / cm.flops_per_s * 1e3
    cost = costs.duplicated_cost(tasks, 2, cm) if mode == "duplicated" else costs.sharded_cost(tasks, 2, "locality", cm)
    return max(cost.seconds) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    header("Optimizer step time, 2 gloo ranks, 24 matrices among 512x512 / 512x2048 / 2048x512")
    rows, model_rows = [], []
    for ns_dtype in (torch.bfloat16, torch.float32):
        flops, bw = dist_harness.run(_calibrate, 2, ns_dtype, timeout=600)[0]
        cm = CostModel(flops, bw)
        for layout in ("replicated", "partitioned"):
            res = {}
            modes = ("single", "duplicated", "sharded") + (("torch",) if ns_dtype == torch.bfloat16 else ())
            for mode in modes:
                if mode == "torch" and layout == "partitioned":
                    continue  # a single process has no partition: same as the replicated row
                out = dist_harness.run(_worker, 2, layout, mode, args.steps, args.warmup, ns_dtype, timeout=900)
                res[mode] = out[0][0], sum(o[1] for o in out)
            dt = str(ns_dtype).replace("torch.", "")
            t_torch = res["torch"][0] * 1e3 if "torch" in res else "-"
            rows.append([dt, layout, t_torch, res["single"][0] * 1e3, res["duplicated"][0] * 1e3, res["sharded"][0] * 1e3,
                         res["sharded"][0] / res["duplicated"][0], res["sharded"][0] / res["single"][0],
                         f"{res['sharded'][1] / 2**20:.1f}"])
            for mode in ("single", "duplicated", "sharded"):
                pred = modelled_ms(layout if mode != "single" else "replicated", mode, ns_dtype, cm)
                model_rows.append([dt, layout, mode, f"{flops / 1e9:.0f}", f"{bw / 2**30:.2f}", pred,
                                   res[mode][0] * 1e3, res[mode][0] * 1e3 / pred])
    table(["ns dtype", "layout", "torch.optim.Muon ms", "single-process ms", "duplicated ms", "sharded ms", "sharded/duplicated",
           "sharded/single", "sharded MiB sent/step"], rows)
    print("single-process: rank 0 alone runs the whole optimizer (all NS) on one thread while rank 1 waits.\n")
    print("The cost model against the measurement (rates measured in this run; the model counts NS and")
    print("bytes only, not momentum, packing or the agreement all_reduce):\n")
    table(["ns dtype", "layout", "mode", "NS GFLOP/s", "all_to_all GiB/s", "modelled ms", "measured ms",
           "measured/modelled"], model_rows)


if __name__ == "__main__":
    main()
