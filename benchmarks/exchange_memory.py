"""Process RSS while the set of tensors with a gradient changes every step (issue 15).

W ranks (gloo, CPU), ``--matrices`` replicated matrices of ``--size``², a random
``--active`` fraction with a gradient each step (the same on every rank, as MoE
experts without tokens or frozen parts would be).  Prints rank 0's RSS at two steps
and what the optimizer holds in compiled exchanges.  Compiled exchanges used to be
cached per set of active matrices forever, so RSS grew every step.

    PYTHONPATH=. python benchmarks/exchange_memory.py [--steps 40] [--world 2]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(rank, world, n, size, active, steps, first):
    import ds_muon

    mats = [nn.Parameter(torch.full((size, size), 0.01)) for _ in range(n)]
    opt = ds_muon.Muon(mats, lr=0.02, ns_dtype=torch.float32)
    pick = torch.Generator().manual_seed(0)  # the same on every rank: replicas get equal gradients
    rss = {}
    for t in range(steps):
        on = torch.rand(n, generator=pick) < active
        for p, a in zip(mats, on):
            p.grad = torch.randn(size, size, generator=pick) if a else None
        opt.step()
        if t + 1 in (first, steps):
            rss[t + 1] = _rss_mib()
    held = sum(ex.buffer_bytes() for ex in opt.exchanges())
    return rss, len(opt.exchanges()), held


def main() -> None:
    import dist_harness

    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--matrices", type=int, default=48)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--active", type=float, default=0.6)
    ap.add_argument("--first", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    rss, count, held = dist_harness.run(_worker, a.world, a.matrices, a.size, a.active, a.steps, a.first,
                                        timeout=1800)[0]
    print(f"W={a.world}, {a.matrices} matrices of {a.size}x{a.size}, {a.active:.0%} active per step")
    print(f"rank 0 RSS: step {a.first} {rss[a.first]:.0f} MiB, step {a.steps} {rss[a.steps]:.0f} MiB, "
          f"growth {rss[a.steps] - rss[a.first]:+.0f} MiB")
    print(f"compiled exchanges kept: {count}, their buffers while a step uses them: {held / 2**20:.1f} MiB "
          "(given back between steps: ds_muon/engine/memory/lending.py)")


if __name__ == "__main__":
    main()
