"""Team NS (ds_muon.engine.plan.team) against one home: a step dominated by one large matrix, at W=2–4 gloo.

One 2048×2048 matrix beside small ones (8 × 512×512, 8 × 256×1024), DDP-like (every rank holds every
tensor).  ``planner="locality"`` gives the large matrix one home, so its NS is the step;
``planner="auto"`` (team NS on, at the planner's CPU rates: ``CostModel.for_device("cpu")``) runs it as
a team of ranks, each orthogonalizing a column block and all-reducing the m×m product per iteration.
Both optimizers live in the same processes and step in interleaved rounds (auto, locality, auto, ...);
each step's time is the slowest rank's (wall, and this process's CPU time), and the table reports the
median over rounds of each round's auto/locality ratio, so the machine's minute-to-minute swings cancel.
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

LARGE = (2048, 2048)
SMALL = [(512, 512)] * 8 + [(256, 1024)] * 8


def _step_time(opt):
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    opt.step()
    mine = time.process_time() - c0
    t = torch.tensor([time.perf_counter() - t0, mine], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].item(), t[1].item(), mine


def _worker(rank, world, shapes, rounds, ns_dtype):
    torch.manual_seed(0)
    init = [torch.randn(s) * 0.02 for s in shapes]
    opts = {}
    for planner in ("auto", "locality"):
        params = [nn.Parameter(t.clone()) for t in init]
        opts[planner] = (params, ds_muon.Muon(params, lr=0.02, ns_dtype=ns_dtype, planner=planner))

    def grads(params, s):
        g = torch.Generator().manual_seed(s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)

    times = {k: [] for k in opts}
    for s in range(rounds + 1):  # round 0 plans, compiles and warms up
        for planner, (params, opt) in opts.items():
            grads(params, s)
            t = _step_time(opt)
            if s:
                times[planner].append(t)
    summary = opts["auto"][1].summary()
    teams = [(m.shape, m.team) for m in summary.matrices if m.team]
    diff = max(float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())
               for a, b in zip(opts["auto"][0], opts["locality"][0]))
    per_rank = {k: statistics.median(t[2] for t in v) for k, v in times.items()}
    return times, teams, diff, per_rank


ACCURACY_SHAPES = [(512, 512), (256, 1024), (1024, 256), (96, 200)]  # docs/PERFORMANCE.md also ran 2048x2048


def _accuracy_worker(rank, world, shapes):
    """team_newton_schulz over the world against newton_schulz at one home and in float64."""
    from ds_muon.engine.plan.compile import NSSettings
    from ds_muon.rules.newton_schulz import newton_schulz
    from ds_muon.engine.plan.team import team_bounds, team_newton_schulz

    out = []
    for shape in shapes:
        G = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0] * 7 + shape[1]))
        exact = newton_schulz(G, dtype=torch.float64)
        tall = shape[0] > shape[1]
        c0, c1 = team_bounds(*shape, world)[rank]
        for dtype in (torch.float32, torch.bfloat16):
            block = (G[c0:c1] if tall else G[:, c0:c1]).contiguous()
            mine = team_newton_schulz(block, tall, NSSettings(5, "keller", dtype, 1e-7, "standard"), None)
            parts = [None] * world
            dist.all_gather_object(parts, mine.float())
            team = torch.cat(parts, 0 if tall else 1).double()
            home = newton_schulz(G, dtype=dtype).double()
            e = lambda t: float((t - exact).norm() / exact.norm())  # noqa: E731
            out.append((shape, str(dtype).split(".")[1], world, e(home), e(team), e(team) / e(home),
                        float((team - home).norm() / home.norm())))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--accuracy", action="store_true", help="also: team NS against one home and float64")
    args = ap.parse_args()
    header(f"Team NS vs one home: {LARGE[0]}x{LARGE[1]} beside {len(SMALL)} small matrices, DDP-like, gloo, "
           f"{args.dtype} NS")
    dtype = getattr(torch, args.dtype)
    rows = []
    for world in args.worlds:
        out = dist_harness.run(_worker, world, [LARGE] + SMALL, args.rounds, dtype, timeout=900)
        times, teams, diff, _ = out[0]
        print(f"W={world}: CPU ms per rank (auto | locality):",
              " ".join(f"{o[3]['auto'] * 1e3:.0f}|{o[3]['locality'] * 1e3:.0f}" for o in out))
        loc_cpu = [o[3]["locality"] for o in out]  # the ideal: locality's work split evenly, nothing sent
        print(f"W={world}: ideal auto/locality (locality's CPU per rank, mean over max): "
              f"{statistics.mean(loc_cpu) / max(loc_cpu):.3f}")
        auto, loc = times["auto"], times["locality"]
        wall = statistics.median(a[0] / b[0] for a, b in zip(auto, loc))
        cpu = statistics.median(a[1] / b[1] for a, b in zip(auto, loc))
        rows.append((world, ", ".join(f"{r}x{c} on {k}" for (r, c), k in teams) or "none",
                     statistics.median(a[0] for a in auto) * 1e3, statistics.median(b[0] for b in loc) * 1e3,
                     wall, cpu, diff))
    table(("W", "teams (auto)", "auto step ms", "locality step ms", "auto/locality wall (median of ratios)",
           "auto/locality CPU", "max rel. param diff"), rows)
    print(f"{args.rounds} interleaved rounds per W; step = slowest rank; CPU = process_time of the slowest rank.")
    if args.accuracy:
        print()
        acc = [r for world in args.worlds for r in dist_harness.run(_accuracy_worker, world, ACCURACY_SHAPES)[0]]
        table(("shape", "NS dtype", "team of", "one home vs f64", "team vs f64", "ratio", "team vs one home"),
              [("x".join(map(str, r[0])), *r[1:]) for r in acc])
        print("relative Frobenius errors of the orthogonalized matrix; f64 = the same 5 Keller steps in float64.")


if __name__ == "__main__":
    main()
