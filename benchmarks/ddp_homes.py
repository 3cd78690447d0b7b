"""DDP at W=2 (gloo): one home per matrix vs ``planner="auto"`` (extra homes / duplication) vs ``mode="duplicated"``.

Replicated matrices (every rank holds every matrix), two shape sets: many small
matrices (NS cheap, the result's fan-out dominates) and step_time.py's NS-heavy
stack.  The cost model handed to ``Muon(cost_model=...)`` uses the NS FLOP/s and
all_to_all bytes/s measured in this run, so ``auto`` decides with this machine's
rates.  Medians over the timed steps of the slowest rank: wall time and this
process's CPU time per step, side by side in one run.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

from common import header, table, timed_steps

import dist_harness
import ds_muon
from ds_muon.engine.plan.cost_model import CostModel
from step_time import SHAPES as NS_HEAVY, _calibrate

SETS = {"small (64 x 128x128)": [(128, 128)] * 64, "NS-heavy (step_time.py)": NS_HEAVY}


def _worker(rank, world, shapes, planner, mode, cm, steps, warmup):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    opt = ds_muon.Muon(params, lr=0.02, ns_dtype=torch.float32, mode=mode, planner=planner, cost_model=cm)
    def set_grads(s):
        g = torch.Generator().manual_seed(s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)

    wall, cpu = timed_steps(opt, set_grads, steps, warmup)
    homes = [len(ex.homes[i]) for ex in opt.exchanges() for i in ex.active]
    sent = sum(e.bytes_sent for e in opt.exchanges())
    return wall, cpu, sum(homes) / max(len(homes), 1), sent


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    header("DDP step at W=2 gloo: one home vs planner='auto' vs duplicated, fp32 NS")
    flops, bw = dist_harness.run(_calibrate, 2, torch.float32, timeout=600)[0]
    cm = CostModel(flops, bw)
    print(f"measured: NS {flops / 1e9:.1f} GFLOP/s per rank, all_to_all {bw / 2**30:.2f} GiB/s per rank\n")
    rows = []
    for name, shapes in SETS.items():
        res = {}
        for label, planner, mode in (("locality", "locality", "sharded"), ("auto", "auto", "sharded"),
                                     ("duplicated", "locality", "duplicated")):
            res[label] = dist_harness.run(_worker, 2, shapes, planner, mode, cm, args.steps, args.warmup,
                                          timeout=900)[0]
        for label, (wall, cpu, homes, sent) in res.items():
            rows.append([name, label, f"{homes:.2f}", f"{sent / 2**20:.2f}", wall * 1e3, cpu * 1e3,
                         wall / res["locality"][0]])
    table(["matrices", "plan", "homes per matrix", "MiB sent/step (rank 0)", "step ms (wall)", "step ms (CPU)",
           "wall / locality"], rows)


if __name__ == "__main__":
    main()
