"""Host time of ``Muon.step()`` per matrix: many tiny matrices, so NS and communication cost
next to nothing and what remains is Python and small kernels per tensor.

For each stack (one process; DDP-style replicas, FSDP2, HSDP (2 replicas x 1 shard) and
DeepSpeed ZeRO-2 at W=2 gloo ranks) a model of N independent ``Linear(8, 8)`` weights is trained with ds_muon for a few
steps at two sizes; ``step()`` alone is timed (medians, the slowest rank), in wall time and
in process CPU time (the machine may be shared: wall time swings, CPU time much less).
The last columns are the cost of one more matrix: (time at N_large - time at N_small) / ΔN.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import time
from typing import List

import torch
import torch.distributed as dist
from torch import nn

from common import header, table

import dist_harness
import ds_muon
import ds_muon.deepspeed

STACKS = ("single", "ddp", "fsdp2", "hsdp", "zero2")
DIM = 8


class ManyMatrices(nn.Module):
    """``n`` independent ``DIM x DIM`` weights; the loss touches each once."""

    def __init__(self, n: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(n))

    def forward(self, x):
        return sum(layer(x) for layer in self.layers).square().mean()


def _timed(step, record: List[tuple]):
    """``step`` wrapped to record (wall, CPU) seconds of each call."""

    @functools.wraps(step)
    def timed(*args, **kwargs):
        w0, c0 = time.perf_counter(), time.process_time()
        out = step(*args, **kwargs)
        record.append((time.perf_counter() - w0, time.process_time() - c0))
        return out

    return timed


def _build(stack: str, n: int):
    """``(train_step(x), muon)`` for ``n`` matrices under ``stack``."""
    model = ManyMatrices(n)
    if stack == "zero2":
        cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
               "optimizer": {"type": "DsMuon", "params": {"lr": 0.02}}, "zero_optimization": {"stage": 2},
               "steps_per_print": 10**9, "wall_clock_breakdown": False}
        engine, _, _, _ = ds_muon.deepspeed.initialize(model=model, config=cfg)

        def train_step(x):
            engine.backward(engine(x))
            engine.step()

        return train_step, engine.basic_optimizer
    if stack == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    elif stack == "hsdp":  # every shard copied on every rank: the copies' gradients are checked
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(), 1),
                                                 mesh_dim_names=("replicate", "shard")))
    elif stack == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    opt = ds_muon.Muon(model.parameters(), lr=0.02)

    def train_step(x):
        model(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return train_step, opt


def _measure(stack: str, n: int, iters: int, warmup: int, freeze_gc: bool = False) -> tuple:
    train_step, muon = _build(stack, n)
    if freeze_gc:  # the model's objects out of the collector's way: what is left is the step's own work
        gc.collect()
        gc.freeze()
    record: List[tuple] = []
    muon.step = _timed(muon.step, record)
    g = torch.Generator().manual_seed(0)
    for _ in range(warmup + iters):
        train_step(torch.randn(4, DIM, generator=g))
    walls, cpus = zip(*record[warmup:])
    if freeze_gc:
        gc.unfreeze()
    return statistics.median(walls), statistics.median(cpus)


def _worker(rank, world, stack, sizes, iters, warmup, freeze_gc):
    out = {}
    for n in sizes:
        t = torch.tensor(_measure(stack, n, iters, warmup, freeze_gc), dtype=torch.float64)
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[n] = tuple(t.tolist())
    return out


def run_stack(stack: str, sizes, iters: int, warmup: int, freeze_gc: bool = False) -> dict:
    if stack == "single":
        with dist_harness.one_thread():
            return {n: _measure(stack, n, iters, warmup, freeze_gc) for n in sizes}
    env = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1"}
    return dist_harness.run(_worker, 2, stack, sizes, iters, warmup, freeze_gc, timeout=1800, env=env)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stacks", default=",".join(STACKS), help=f"comma-separated, from {STACKS}")
    ap.add_argument("--sizes", default="20,2000", help="two matrix counts: small,large")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--freeze-gc", action="store_true",
                    help="gc.freeze() after building the model: Python's collector then no longer rescans the "
                         "model's objects during the step (part of the cost per matrix without it)")
    args = ap.parse_args()
    small, large = (int(s) for s in args.sizes.split(","))
    header(f"Host time of Muon.step() per matrix: {small} vs {large} matrices of {DIM}x{DIM}, W=2 gloo ranks "
           f"(single: one process); medians of {args.iters} steps, slowest rank"
           + (", gc frozen" if args.freeze_gc else ""))
    rows = []
    for stack in args.stacks.split(","):
        if stack not in STACKS:
            raise SystemExit(f"unknown stack {stack!r}; use one of {STACKS}")
        res = run_stack(stack, (small, large), args.iters, args.warmup, args.freeze_gc)
        (ws, cs), (wl, cl) = res[small], res[large]
        per = 1e6 / (large - small)
        rows.append([stack, ws * 1e3, wl * 1e3, cs * 1e3, cl * 1e3, (wl - ws) * per, (cl - cs) * per])
        print(f"{stack}: done", flush=True)
    print()
    table(["stack", f"wall ms ({small})", f"wall ms ({large})", f"CPU ms ({small})", f"CPU ms ({large})",
           "wall µs / matrix", "CPU µs / matrix"], rows)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
