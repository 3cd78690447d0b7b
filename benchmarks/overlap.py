"""How much of the exchange overlap=True hides: FSDP2 at W=2, four settings side by side.

* ``overlap=False``: gathers, NS and scatters all inside ``step()``;
* ``overlap=True, dispatch_in_backward=False``: waves pipelined in ``step()``;
* ``overlap=True``: as above, and each wave's gather issued from backward as soon as
  FSDP has reduce-scattered its gradients (every update landed when ``step()`` returns);
* ``overlap=True, apply_in_forward=True`` (opt-in): as above, and the last scatters
  waited on in the next forward.

For each, the median over iterations (slowest rank) of the iteration time
(forward + backward + step), of ``step()`` alone, and of the time a rank spends
blocked in the exchange (``gather_finish`` + ``scatter_finish``: waiting for the
all_to_all plus unpacking).  Without overlap the collectives are waited on right
after being issued, so that blocked time is the exchange's cost; "hidden" is how much
of it the other settings no longer wait for.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import fsdp2_gpt, header, table, timed_iterations

import dist_harness
import ds_muon

SETTINGS = {
    "overlap=False": dict(overlap=False),
    "overlap=True, step-side only": dict(overlap=True, dispatch_in_backward=False),
    "overlap=True": dict(overlap=True),
    "overlap=True, apply_in_forward": dict(overlap=True, apply_in_forward=True),
}


def _timed_exchange(blocked: list) -> None:
    """Count the seconds spent in the exchange's waits (and unpacking) in ``blocked[0]``."""
    from ds_muon.engine.exchange.all_to_all import Exchange

    def timed(fn):
        def wrapper(self, pending):
            t0 = time.perf_counter()
            out = fn(self, pending)
            blocked[0] += time.perf_counter() - t0
            return out
        return wrapper

    Exchange.gather_finish = timed(Exchange.gather_finish)
    Exchange.scatter_finish = timed(Exchange.scatter_finish)


def _worker(rank, world, setting, iters, warmup, d, layers, waves):
    blocked = [0.0]
    _timed_exchange(blocked)
    model = fsdp2_gpt(world, d, layers)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=3e-3), ns_dtype=torch.bfloat16, waves=waves,
                       model=model, **SETTINGS[setting])
    medians = timed_iterations(model, opt, rank, iters, warmup, counter=blocked)
    return medians + [opt.runtime.dispatch.dispatched if opt.runtime.dispatch is not None else 0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--waves", type=int, default=4)
    args = ap.parse_args()
    header(f"Overlap, GPT d={args.d} x {args.layers} layers, FSDP2, 2 gloo ranks, {args.waves} waves, "
           "16 x 128 tokens per rank, bf16 NS")
    res = {name: dist_harness.run(_worker, 2, name, args.iters, args.warmup, args.d, args.layers, args.waves,
                                  timeout=900)[0] for name in SETTINGS}
    base_iter, _, base_blocked, _ = res["overlap=False"]
    rows = []
    for name, (it, st, blocked, dispatched) in res.items():
        rows.append([name, it * 1e3, st * 1e3, blocked * 1e3, (base_blocked - blocked) * 1e3,
                     100 * (base_blocked - blocked) / base_blocked, it / base_iter, dispatched])
    table(["setting", "iteration ms", "step() ms", "blocked in exchange ms", "hidden ms", "hidden %",
           "iteration / overlap=False", "waves sent from backward"], rows)


if __name__ == "__main__":
    main()
