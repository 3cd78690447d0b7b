"""Optimizer overhead on the demo model: FSDP2 at W=2, ds_muon vs AdamW, the duplicated
baseline, and overlap=True (4 waves, gathers sent from backward, updates applied in the
next forward; benchmarks/overlap.py breaks down what that hides).

Every variant lives in the same two processes, each its own model copy (same seed) under
its own ``fully_shard``, and they take turns iteration by iteration (the order reversed every
other round), so the machine's swings hit all alike.  Times forward + backward + step and
step() alone per iteration (the slowest rank; wall, and process CPU time for the whole
iteration), for the GPT of examples/gpt.py with the demo's sizes, and prints Muon's overhead
relative to AdamW as medians of per-round differences and ratios.  With overlap, step()
returns before the last scatters land; their wait moves into the next forward, so compare
iteration times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from common import fsdp2_gpt, header, table

import dist_harness
import ds_muon

VARIANTS = (("adamw", None), ("ds_muon", "auto"), ("ds_muon", torch.bfloat16), ("ds_muon", torch.float32),
            ("ds_muon duplicated", torch.bfloat16), ("ds_muon overlap", torch.bfloat16))


def _label(name, dt):
    return name if dt is None else f"{name} ({str(dt).replace('torch.', '')} NS)"


def _build(name, dt, world, d, layers):
    model = fsdp2_gpt(world, d, layers)
    if name == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3)
    overlap = name == "ds_muon overlap"
    return model, ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=3e-3), ns_dtype=dt, log_summary=False,
                               mode="duplicated" if name == "ds_muon duplicated" else "sharded",
                               overlap=overlap, waves=4, model=model if overlap else None)


def _worker(rank, world, variants, rounds, warmup, d, layers, threads):
    from gpt import batch, split, stdlib_bytes

    if threads:
        torch.set_num_threads(threads)
    built = [(_label(n, dt), *_build(n, dt, world, d, layers)) for n, dt in variants]
    data, _ = split(stdlib_bytes(1_000_000))
    g = torch.Generator().manual_seed(rank)
    rows = {label: [] for label, _, _ in built}
    for rnd in range(warmup + rounds):
        x, y = batch(data, 16, 128, g)
        for label, model, opt in (built if rnd % 2 == 0 else built[::-1]):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            t = torch.tensor([t2 - t0, t2 - t1, time.process_time() - c0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rnd >= warmup:
                rows[label].append(t.tolist())
    return rows, os.getloadavg()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=15, help="interleaved rounds (one iteration of each variant)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: torch's default)")
    ap.add_argument("--variants", default="all", help="'all' or 'short' (AdamW and ds_muon at its default, ns_dtype auto)")
    args = ap.parse_args()
    variants = VARIANTS if args.variants == "all" else VARIANTS[:2]
    header(f"Optimizer overhead, GPT d={args.d} x {args.layers} layers, FSDP2, 2 gloo ranks, 16 x 128 tokens per "
           f"rank, {args.iters} interleaved rounds after {args.warmup} warm-up")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows, load = dist_harness.run(_worker, 2, variants, args.iters, args.warmup, args.d, args.layers, args.threads,
                                  timeout=1800)[0]
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in load)}\n")
    base = rows["adamw"]
    med = statistics.median
    out = []
    for label, r in rows.items():
        out.append([label, med(x[0] for x in r) * 1e3, med(x[1] for x in r) * 1e3, med(x[2] for x in r) * 1e3,
                    f"{med(x[0] / b[0] for x, b in zip(r, base)):.3f}", f"{med(x[2] / b[2] for x, b in zip(r, base)):.3f}",
                    med(x[1] - b[1] for x, b in zip(r, base)) * 1e3])
    table(["optimizer", "iteration ms", "step() ms", "iteration CPU ms", "iteration / AdamW (wall)",
           "iteration / AdamW (CPU)", "step overhead over AdamW ms"], out)
    print("medians over rounds; ratios and differences are medians of per-round values (the slowest rank's)")


if __name__ == "__main__":
    main()
