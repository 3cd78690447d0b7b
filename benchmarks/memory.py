"""Optimizer memory, held between steps and at the peak of a step: ds_muon against torch.optim.Muon + AdamW.

Both optimizers get the same tensors (ds_muon.muon_param_groups' choice: hidden 2-D weights
take Muon, everything else AdamW) and step the same model; the fourth step is measured.

* **held**: bytes of the tensor storages reachable from the optimizer objects (state, param
  groups, caches, hooks) other than the parameters' and gradients' own, each storage counted
  once (``tests/memory_probe.held_bytes``: a walk of the object graph; no timing, no sampling).
* **peak**: held before ``step()`` plus the highest net allocation while ``step()`` runs, read
  from the CPU allocator's own events (``torch.profiler.profile(profile_memory=True)``; every
  allocation and free, in order: ``tests/memory_probe.peak_bytes``).

One process, then W=2 gloo ranks (the largest rank's figures): DDP (both optimizers; every rank
holds the whole state) and FSDP2 (ds_muon; torch.optim.Muon would orthogonalize each rank's
shard instead of the matrix, so it has no row), where the bound is the rank's state plus the
bytes (in the parameters' dtype) of the matrices one wave brings home.

    PYTHONPATH=. python benchmarks/memory.py
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from common import header, table

import dist_harness
from memory_probe import held_bytes, optimizers, peak_bytes

MiB = 2**20


class Square(nn.Module):
    """``n`` Linear(d, d) layers with biases: the issue's case (4 x 1024²)."""

    def __init__(self, n: int, d: int):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(d, d) for _ in range(n)])
        self.d = d

    def forward(self, x):
        return self.layers(x).square().mean()

    def batch(self, g):
        return torch.randn(8, self.d, generator=g)


class TinyGPT(nn.Module):
    """The demo's GPT (examples/gpt.py), d=256 x 4 layers."""

    def __init__(self):
        super().__init__()
        from gpt import GPT

        self.gpt = GPT(d=256, layers=4, seq=64)

    def forward(self, idx):
        return self.gpt(idx, idx)

    def batch(self, g):
        return torch.randint(0, 256, (4, 64), generator=g)


MODELS = {"4x1024^2": lambda: Square(4, 1024), "gpt d=256x4": TinyGPT}


def _wave_home_bytes(opts) -> int:
    """The most bytes (parameters' dtype) of matrices one wave brings to this rank."""
    out = 0
    for opt in opts:
        for ex in getattr(opt, "exchanges", lambda: [])():
            itemsize = ex.layout.local[ex.active[0]][0].param.dtype.itemsize if ex.active else 4
            out = max(out, sum(ex.layout.matrices[i].numel for i in ex.slot) * itemsize)
    return out


def _state_bytes(opts, params) -> int:
    """The state proper: momentum and AdamW moments (local shards), each storage once."""
    seen, total = set(), 0
    for opt in opts:
        for st in opt.state.values():
            for t in st.values():
                if torch.is_tensor(t):
                    t = getattr(t, "_local_tensor", t)
                    s = t.untyped_storage()
                    if s.data_ptr() not in seen:
                        seen.add(s.data_ptr())
                        total += s.nbytes()
    return total


def measure(model_name: str, kind: str, stack: str, steps: int = 4) -> dict:
    torch.manual_seed(0)
    model = MODELS[model_name]()
    if stack == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif stack == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for m in (model.gpt.blocks if hasattr(model, "gpt") else model.layers):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opts = optimizers(kind, model.module if stack == "ddp" else model)
    inner = model.module if stack == "ddp" else model
    g = torch.Generator().manual_seed(0)

    def step():
        for o in opts:
            o.step()

    params = list(model.parameters())
    peak = 0
    for t in range(steps):
        for o in opts:
            o.zero_grad(set_to_none=True)
        model(inner.batch(g)).backward()
        if t < steps - 1:
            step()
        else:
            before = held_bytes(opts, params)
            peak, _ = peak_bytes(step)
            peak += before
    return {"held": held_bytes(opts, params), "peak": peak, "state": _state_bytes(opts, params),
            "wave": _wave_home_bytes(opts)}


def _worker(rank, world, jobs):
    out = []
    for model_name, kind, stack in jobs:
        out.append(measure(model_name, kind, stack))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    names = args.models.split(",")
    header("Optimizer memory: held between steps and peak during step(), ds_muon vs torch.optim.Muon + AdamW "
           "(MiB; 4th step)")
    rows = []
    with dist_harness.one_thread():
        for name in names:
            ref = measure(name, "torch", "single")
            ds = measure(name, "ds_muon", "single")
            rows.append([name, "one process", ref["state"] / MiB, ref["held"] / MiB, ds["held"] / MiB,
                         ds["held"] / ref["held"], ref["peak"] / MiB, ds["peak"] / MiB, ds["peak"] / ref["peak"], ""])
    jobs = [(name, kind, stack) for name in names for kind, stack in
            (("torch", "ddp"), ("ds_muon", "ddp"), ("ds_muon", "fsdp2"))]
    per_rank = dist_harness.run(_worker, 2, jobs, timeout=1200, env={"DS_ACCELERATOR": "cpu"})
    res = {job: {k: max(r[j][k] for r in per_rank) for k in per_rank[0][j]} for j, job in enumerate(jobs)}
    for name in names:
        ref, ddp, fsdp = res[(name, "torch", "ddp")], res[(name, "ds_muon", "ddp")], res[(name, "ds_muon", "fsdp2")]
        rows.append([name, "W=2 DDP", ref["state"] / MiB, ref["held"] / MiB, ddp["held"] / MiB,
                     ddp["held"] / ref["held"], ref["peak"] / MiB, ddp["peak"] / MiB, ddp["peak"] / ref["peak"], ""])
        bound = fsdp["state"] + fsdp["wave"]
        rows.append([name, "W=2 FSDP2", fsdp["state"] / MiB, "", fsdp["held"] / MiB, "", "", fsdp["peak"] / MiB, "",
                     f"{bound / MiB:.4g} (peak/bound {fsdp['peak'] / bound:.2f})"])
    print()
    table(["model", "stack", "state", "torch held", "ds_muon held", "held ratio", "torch peak", "ds_muon peak",
           "peak ratio", "FSDP2 bound: state + one wave at home"], rows)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
