"""Meshes at W=4 (gloo): HSDP 2x2 and DDP, before vs now, in one run.

HSDP (``fully_shard`` on a ``(replicate=2, shard=2)`` mesh): before, each replica group
orthogonalized every matrix itself (one home per replica group, no bytes between groups;
reproduced here with ``planner="auto"`` and a cost model where bytes between the two
"nodes" are ruinous); now, by default, each matrix has one home in the whole world and
its result fans out to every replica (``planner="locality"``); ``planner="auto"`` with the
rates measured in this run (``ranks_per_node=2``) chooses per matrix.  DDP (replicated
tensors): one home per matrix vs ``planner="auto"`` (extra homes / duplication).

All configurations run in the same four processes, one after the other.  Per configuration:
median over the timed steps of the slowest rank's wall time and process CPU time per
``opt.step()``, NS GFLOPs per step of the busiest rank and of all ranks together, and bytes
moved by the exchanges (sent + received, busiest rank), from ``Muon.summary()``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from common import header, table, timed_steps

import dist_harness
import ds_muon
from ds_muon.rules.newton_schulz import ns_flops
from ds_muon.engine.plan.cost_model import CostModel

SHAPES = [(256, 256), (256, 512), (512, 256)] * 4
PER_GROUP = CostModel(flops_per_s=1e15, bytes_per_s=1e6, ranks_per_node=2, intra_bytes_per_s=1e12)


def _calibrate(world):
    """NS FLOP/s of one rank while all ranks run NS, and all_to_all bytes/s per rank (sent + received)."""
    G = torch.randn(4, 256, 512)
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        ds_muon.newton_schulz(G, dtype=torch.float32)
        times.append(time.perf_counter() - t0)
    flops = 4 * ns_flops(256, 512, 5) / statistics.median(times)
    n = 4 * 2**20 // 4  # 4 MiB of fp32
    send, recv = torch.zeros(n), torch.empty(n)
    times = []
    for _ in range(4):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send)
        times.append(time.perf_counter() - t0)
    moved = 2 * n * 4 * (world - 1) / world
    rates = torch.tensor([flops, moved / statistics.median(times[1:])], dtype=torch.float64)
    dist.all_reduce(rates, op=dist.ReduceOp.MIN)  # the same rates on every rank: the same plan
    return rates[0].item(), rates[1].item()


def _model(kind):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(c, r, bias=False) for r, c in SHAPES])
    if kind == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    return model


def _grads(model, step):
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=g)
        if hasattr(p, "device_mesh"):  # DTensor: this rank's shard of the same full gradient
            from torch.distributed.tensor import distribute_tensor

            full = distribute_tensor(full, p.device_mesh, p.placements)
        p.grad = full


def _measure(kind, planner, cm, steps, warmup):
    model = _model(kind)
    opt = ds_muon.Muon(model.parameters(), lr=0.02, ns_dtype=torch.float32, planner=planner, cost_model=cm)
    wall, cpu = timed_steps(opt, lambda s: _grads(model, s), steps, warmup)
    s = opt.summary()
    ns = [r.ns_flops for r in s.ranks]
    homes = [len(m.homes) for m in s.matrices]
    return dict(wall=wall, cpu=cpu, ns_max=max(ns), ns_all=sum(ns),
                moved=max(r.bytes_moved for r in s.ranks), homes=sum(homes) / len(homes))


def _worker(rank, world, steps, warmup):
    flops, bw = _calibrate(world)
    measured = CostModel(flops_per_s=flops, bytes_per_s=bw, ranks_per_node=2, intra_bytes_per_s=bw)
    configs = [
        ("HSDP 2x2", "one home per replica group (before)", "auto", PER_GROUP),
        ("HSDP 2x2", "one home in the world (now, default)", "locality", None),
        ("HSDP 2x2", "planner='auto', measured rates", "auto", measured),
        ("DDP W=4", "one home per matrix (default)", "locality", None),
        ("DDP W=4", "planner='auto', measured rates", "auto", measured),
    ]
    rows = [(mesh, label, _measure("hsdp" if mesh.startswith("HSDP") else "ddp", planner, cm, steps, warmup))
            for mesh, label, planner, cm in configs]
    return (flops, bw), rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    header(f"Meshes at W=4 gloo: HSDP 2x2 and DDP, {len(SHAPES)} matrices (256x256, 256x512, 512x256), fp32 NS")
    (flops, bw), rows = dist_harness.run(_worker, 4, args.steps, args.warmup, timeout=1800)[0]
    print(f"measured: NS {flops / 1e9:.1f} GFLOP/s per rank, all_to_all {bw / 2**20:.0f} MiB/s per rank\n")
    base = {}
    out = []
    for mesh, label, r in rows:
        base.setdefault(mesh, r)
        out.append([mesh, label, f"{r['homes']:.2f}", f"{r['ns_max'] / 1e9:.2f}", f"{r['ns_all'] / 1e9:.2f}",
                    f"{r['moved'] / 2**20:.2f}", r["wall"] * 1e3, r["cpu"] * 1e3, r["wall"] / base[mesh]["wall"]])
    table(["mesh", "plan", "homes/matrix", "NS GFLOP/step (busiest rank)", "NS GFLOP/step (all ranks)",
           "MiB moved (busiest rank)", "step ms (wall)", "step ms (CPU)", "wall / first row"], out)


if __name__ == "__main__":
    main()
