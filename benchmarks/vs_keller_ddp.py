"""ds_muon vs Keller Jordan's distributed Muon vs AdamW under DDP: same model, W=2 gloo, interleaved.

The DDP row of the peer bench (the ZeRO-2 row is ``vs_deepspeed_muon.py``).  Model:
``vs_deepspeed_muon.BankNet``, whose Muon matrices are the NS bank of
``ns_roofline.py`` (8×512², 4×1536×512, 4×512×1536, 4×384×1024), so Newton–Schulz
dominates the step.  One thread per rank.  Three variants live in the same two
processes, each its own model copy (same seed) under its own
``DistributedDataParallel``, and take turns round by round (A, B, C, A, B, C, …),
so the machine's swings hit all three alike:

* ``adamw``: ``torch.optim.AdamW`` on every parameter, the baseline;
* ``ds_muon``: ``ds_muon.Muon(muon_param_groups(model))``, NS in bf16, eager;
* ``keller``: :class:`KellerDDPMuon` below, a stand-in for ``muon.Muon`` of
  KellerJordan/Muon (the package is not installed here), on the same Muon matrices,
  with ``torch.optim.AdamW`` on the rest (embedding, head).

Timed: ``loss.backward()`` (DDP's gradient all-reduce) + ``step()`` together, per
round the slowest rank, in wall time and in process CPU time (what the rank itself
spent, gloo's threads included: on a shared box wall time swings with the
neighbours' load, CPU time much less).  Forward is not timed.  Reported: medians
over rounds, and medians of per-round ratios of the Muon overheads over AdamW.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common import GEMM_SIZE, gemm_timer, header, table

import dist_harness
import ds_muon
from ds_muon.rules.newton_schulz import ns_flops
from vs_deepspeed_muon import BankNet

WORLD = 2
KELLER = (3.4445, -4.7750, 2.0315)


def keller_orthogonalize(G: torch.Tensor, steps: int = 5, dtype=torch.bfloat16) -> torch.Tensor:
    """Keller's quintic NS (bf16 as published; ``dtype`` only for the fp32 check): Frobenius-
    normalise (eps 1e-7), work on the wide orientation, X ← aX + (bA + cA²)X with A = XXᵀ."""
    a, b, c = KELLER
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.mT if tall else X


class KellerDDPMuon(torch.optim.Optimizer):
    """Stand-in for ``muon.Muon`` (KellerJordan/Muon), the DDP version: the params, sorted
    by size largest first, are taken W at a time; rank r updates the r-th of each block
    (Nesterov momentum 0.95 by lerp, bf16 NS, scale sqrt(max(1, rows/cols)), decoupled
    weight decay) and ``dist.all_gather`` hands every rank the block's updated params
    (the list padded with empties to a multiple of W).  Written from the published
    algorithm, not copied."""

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0):
        params = sorted(params, key=lambda p: p.size(), reverse=True)
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        world, rank = dist.get_world_size(), dist.get_rank()
        for g in self.param_groups:
            params = g["params"]
            padded = params + [torch.empty_like(params[-1]) for _ in range(-len(params) % world)]
            for base in range(0, len(params), world):
                if base + rank < len(params):
                    p = params[base + rank]
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    st = self.state[p]
                    if not st:
                        st["momentum_buffer"] = torch.zeros_like(p)
                    update = keller_update(p.grad, st["momentum_buffer"], g["momentum"])
                    p.mul_(1 - g["lr"] * g["weight_decay"]).add_(update.reshape(p.shape), alpha=-g["lr"])
                dist.all_gather(padded[base:base + world], padded[base + rank])


def keller_update(grad, momentum_buffer, beta):
    """Momentum by lerp, Nesterov by a second lerp (in place on the gradient, as Keller's does)."""
    momentum_buffer.lerp_(grad, 1 - beta)
    u = grad.lerp_(momentum_buffer, beta)
    return keller_orthogonalize(u.view(len(u), -1)) * max(1, grad.size(-2) / grad.size(-1)) ** 0.5


def check_same_update(shape=(512, 1536), seed=0):
    """One matrix, one step from zero momentum (lr 1), on every rank: the stand-in's update
    against ds_muon's, both bf16 NS with Keller's coefficients, and the same maths in fp32.

    Five bf16 NS iterations amplify every rounding (slope 3.4 at zero), so two exact forms of
    the same iteration cannot agree to one bf16 spacing at the output; the tolerance is the
    stand-in's own bf16 rounding error: ds_muon's bf16 update must be at least as close to
    the exact update (the stand-in's maths in float64) as the stand-in's bf16 update is.
    Returns relative Frobenius differences: (ds_muon bf16 vs exact, stand-in bf16 vs exact
    = the tolerance, ds_muon vs stand-in in bf16, ds_muon's fp32 NS vs the stand-in's maths in fp32)."""
    from ds_muon.rules.newton_schulz import newton_schulz  # the function ds_muon.Muon's bf16 path runs

    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(shape, generator=g) * 0.02
    grad = torch.randn(shape, generator=g)
    deltas = []
    for make in (lambda p: KellerDDPMuon([p], lr=1.0),
                 lambda p: ds_muon.Muon([p], lr=1.0, ns_dtype=torch.bfloat16, log_summary=False)):
        p = torch.nn.Parameter(w0.clone())
        opt = make(p)
        p.grad = grad.clone()
        opt.step()
        deltas.append((w0 - p.detach()).double())
    keller, ours = deltas
    rel = lambda x, y: ((x.double() - y.double()).norm() / y.double().norm()).item()  # noqa: E731
    u = grad * 0.05 * (1 + 0.95)  # Nesterov input from zero momentum: lerp(grad, 0.05·grad, 0.95)
    scale = max(1, shape[0] / shape[1]) ** 0.5
    exact = keller_orthogonalize(u.double(), dtype=torch.float64) * scale
    fp32 = rel(newton_schulz(u, dtype=torch.float32), keller_orthogonalize(u, dtype=torch.float32))
    return rel(ours, exact), rel(keller, exact), rel(ours, keller), fp32


def _variants(model_seed):
    """(name, ddp model, optimizers) for each variant, every model from the same seed."""
    out = []
    idx = torch.zeros(1, 9, dtype=torch.long)
    example = (idx[:, :-1], idx[:, 1:])  # one forward for muon_param_groups to read the model from
    for name in ("adamw", "ds_muon", "keller"):
        torch.manual_seed(model_seed)
        model = BankNet()
        ddp = DDP(model)
        if name == "adamw":
            opts = [torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)]
        elif name == "ds_muon":
            opts = [ds_muon.Muon(ds_muon.muon_param_groups(model, lr=0.02, adam_lr=3e-4, weight_decay=0.0,
                                                           example_inputs=example),
                                 ns_dtype=torch.bfloat16, log_summary=False)]
        else:  # the same tensors on Muon as ds_muon's grouping picks
            groups = ds_muon.muon_param_groups(model, lr=0.02, adam_lr=3e-4, weight_decay=0.0, example_inputs=example)
            hidden = [p for grp in groups if grp.get("use_muon") for p in grp["params"]]
            rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
            opts = [KellerDDPMuon(hidden, lr=0.02, momentum=0.95),
                    torch.optim.AdamW(rest, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)]
        out.append((name, ddp, opts, len(hidden) if name == "keller" else None))
    return out


def _worker(rank, world, args):
    checks = [check_same_update(shape, seed) for seed, shape in enumerate(((512, 1536), (1536, 512), (512, 512)))]
    variants = _variants(0)
    g = torch.Generator().manual_seed(rank)
    rows = {name: [] for name, *_ in variants}  # per round: (wall, cpu) of the slowest rank
    gemm, gemm_flops = gemm_timer(torch.bfloat16)
    gemm_seconds = []  # per round, this rank's: the NS floor is priced at it
    for rnd in range(args.warmup + args.rounds):
        idx = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
        order = variants if rnd % 2 == 0 else variants[::-1]  # alternate who goes first
        for name, ddp, opts, _ in order:
            for o in opts:
                o.zero_grad(set_to_none=True)
            loss = ddp(idx[:, :-1], idx[:, 1:])
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss.backward()
            for o in opts:
                o.step()
            t = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rnd >= args.warmup:
                rows[name].append(t.tolist())
        if rnd >= args.warmup:
            gemm_seconds.append(gemm())
    muon = variants[1][2][0]
    sent = sum(ex.bytes_sent for ex in muon.exchanges())
    keller = variants[2][2][0].param_groups[0]["params"]  # all_gather: each rank sends its own to W-1 peers
    keller_sent = sum(p.numel() * p.element_size() * (world - 1) for p in keller[rank::world])
    flops = {"ds_muon": sum(ns_flops(ex.layout.matrices[i].rows, ex.layout.matrices[i].cols, 5)
                            for ex in muon.exchanges() for i in ex.active if rank in ex.homes[i]),
             "keller": sum(ns_flops(p.shape[0], p.shape[1], 5) for p in keller[rank::world])}
    n_muon = variants[2][3]
    floor = [flops["keller"] * g / gemm_flops for g in gemm_seconds]  # this rank's NS share at its GEMM rate
    return rows, {"ds_muon": sent, "keller": keller_sent}, n_muon, os.getloadavg(), checks, flops, floor


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    torch.set_num_threads(1)
    header(f"backward()+step() at W={WORLD}, DDP gloo, fp32 training: ds_muon vs Keller's distributed Muon vs AdamW")
    print("model: BankNet (Muon matrices 8x512², 4x1536x512, 4x512x1536, 4x384x1024), "
          f"seq={args.seq}, micro-batch {args.batch} per rank; {args.rounds} interleaved rounds after {args.warmup} "
          "warm-up; one thread per rank; per round the slowest rank\n")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    per_rank = dist_harness.run(_worker, WORLD, args, timeout=args.timeout)
    rows, sent, n_muon, load = per_rank[0][:4]
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in load)}\n")
    print(f"same update, Keller stand-in vs ds_muon (one step from zero momentum, lr 1, W={WORLD}), relative "
          "Frobenius differences; 'exact' = the stand-in's maths in float64; tolerance = the stand-in's own bf16 "
          "error against exact:")
    for shape, (ours, theirs, between, fp32) in zip(("512x1536", "1536x512", "512x512"), per_rank[0][4]):
        print(f"  {shape}: bf16 NS: ds_muon vs exact {ours:.2e}, stand-in vs exact {theirs:.2e} "
              f"({'within' if ours <= theirs else 'OUTSIDE'}), ds_muon vs stand-in {between:.2e}; "
              f"fp32 NS, same maths: {fp32:.1e}")
    print(f"  (rank 1 {'agrees' if per_rank[1][4] == per_rank[0][4] else 'DIFFERS'})\n")
    base = rows["adamw"]
    labels = {"adamw": "AdamW (torch)", "ds_muon": "ds_muon, NS bf16, eager",
              "keller": f"Keller Muon (DDP stand-in, {n_muon} matrices), NS bf16"}
    out = []
    for name, r in rows.items():
        wall = statistics.median(x[0] for x in r)
        cpu = statistics.median(x[1] for x in r)
        ow = statistics.median(x[0] - b[0] for x, b in zip(r, base))
        oc = statistics.median(x[1] - b[1] for x, b in zip(r, base))
        mb = f"{max(r[1][name] for r in per_rank) / 1e6:.3g}" if name != "adamw" else "-"
        gf = f"{max(r[5][name] for r in per_rank) / 1e9:.3g}" if name != "adamw" else "-"
        out.append([labels[name], wall * 1e3, cpu * 1e3, ow * 1e3, oc * 1e3, gf, mb])
    table(["optimizer", "wall ms", "CPU ms", "overhead wall ms", "overhead CPU ms", "NS GFLOP max", "Muon MB sent max"],
          out)

    def ratios(k):
        return [(d[k] - b[k]) / (e[k] - b[k]) for d, e, b in zip(rows["ds_muon"], rows["keller"], base)]

    rc, rw = ratios(1), ratios(0)
    print("Muon overhead over AdamW, ds_muon / Keller (below 1: ds_muon adds less), median of per-round ratios:")
    print(f"  CPU {statistics.median(rc):.2f}x (rounds {min(rc):.2f}-{max(rc):.2f}), "
          f"wall {statistics.median(rw):.2f}x (rounds {min(rw):.2f}-{max(rw):.2f})")
    floor = [max(r[6][k] for r in per_rank) for k in range(len(base))]  # the slowest rank's, per round
    rf = [f / (e[1] - b[1]) for f, e, b in zip(floor, rows["keller"], base)]
    print(f"floor: one rank's NS FLOPs (Keller's split; ds_muon's is as large) at a {GEMM_SIZE}² bf16 GEMM's rate "
          f"timed in each round, {statistics.median(floor) * 1e3:.1f} ms, {statistics.median(rf):.2f}x Keller's CPU "
          "overhead (median of per-round ratios): about the least ds_muon / Keller any optimizer running these products "
          "could reach, with the rest of its step and the exchange free")


if __name__ == "__main__":
    main()
