"""Team planning: which matrices a team of ranks orthogonalizes (:mod:`.team` runs them), and the
one-home matrices moved off the ranks the teams loaded.

A team NS splits one m×n matrix into column blocks, one per member, with an all_reduce of an m×m
product per iteration: worth it only where that matrix's NS alone bounds the step.  Costed with the
same :mod:`.cost_model` as the homes (:func:`team_seconds` beside :func:`~.cost_model.rank_seconds`), a pure
function of its inputs, so every rank picks the same teams.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .cost_model import CostModel, MatrixTask, _Costs

TEAM_SIZES = (2, 3, 4, 8, 16, 32, 64)  # team sizes plan_teams tries (at most the world)


def team_widths(rows: int, cols: int, k: int) -> List[int]:
    """The widths of the k column blocks of the wide orientation (as :func:`ds_muon.engine.plan.team.team_bounds`)."""
    n = max(rows, cols)
    return [((j + 1) * n) // k - (j * n) // k for j in range(k)]


def team_member_flops(m: int, w: int, steps: int) -> float:
    """Multiply-add FLOPs of one member of a team NS holding a block m×w of the wide orientation:
    per iteration X_j·X_jᵀ (2m²w), then B = bA + cA² and B·X_j (2m³ + 2m²w), or, where w < m,
    Y = A·X_j and A·(X_j + (c/b)·Y) (4m²w): whichever is fewer (:func:`ds_muon.engine.plan.team.team_newton_schulz`)."""
    return float(steps) * (2.0 * m * m * w + min(2.0 * m**3 + 2.0 * m * m * w, 4.0 * m * m * w))


def team_seconds(t: MatrixTask, members: Sequence[int], cm: CostModel) -> np.ndarray:
    """Seconds one matrix costs each rank when the team ``members`` (sorted; member j holds block j)
    orthogonalizes it: each member's share of the NS, ``steps`` all_reduces of the m×m product (at
    ``elem_bytes``, the NS dtype's size when the wire is lossless) plus one of the norm (:meth:`CostModel.allreduce_seconds`), and the bytes of its blocks
    (:func:`team_traffic`).  Dense over the ranks, 0 where the matrix touches nothing."""
    m = min(t.rows, t.cols)
    sent, recv = team_traffic(t, members)
    widths = team_widths(t.rows, t.cols, len(members))
    moved = (sent + recv) * t.elem_bytes
    out = cm.link_seconds(np.zeros(len(t.held)), moved)
    sync = t.steps * cm.allreduce_seconds(members, t.elem_bytes * m * m) + cm.allreduce_seconds(members, 8.0)
    for j, h in enumerate(members):
        out[h] += team_member_flops(m, widths[j], t.steps) / cm.flops_per_s + sync
    touched = moved > 0
    touched[list(members)] = True
    return np.where(touched, out, 0.0)


def team_traffic(t: MatrixTask, members: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Elements each rank sends and receives (gather + scatter) for one team matrix: member j
    collects what it lacks of block j from the holders in proportion to what they hold (each
    holder's share assumed spread evenly over the blocks), then every holder gets its piece of each
    other member's block back (:class:`ds_muon.engine.plan.team.TeamExchange` moves exactly the overlaps)."""
    world = len(t.held)
    n = max(t.rows, t.cols)
    held = np.asarray(t.held, dtype=np.float64)
    total = float(held.sum())
    widths = team_widths(t.rows, t.cols, len(members))
    sent, recv = np.zeros(world), np.zeros(world)
    for j, h in enumerate(members):
        frac = widths[j] / n
        missing = frac * (t.numel - held[h])
        if missing > 0 and total - held[h] > 0:
            share = held * (missing / (total - held[h]))
            share[h] = 0.0
            sent += share
            recv[h] += missing
        back = held * frac
        back[h] = 0.0
        recv += back
        sent[h] += float(back.sum())
    return sent, recv


def plan_teams(tasks: Sequence[MatrixTask], world_size: int, homes: Sequence[Tuple[int, ...]],
               cost_model: Optional[CostModel] = None, eligible: Optional[Sequence[bool]] = None,
               sizes: Sequence[int] = TEAM_SIZES) -> Dict[int, Tuple[int, ...]]:
    """Matrices worth orthogonalizing as a team (:mod:`ds_muon.engine.plan.team`), from a plan's ``homes``:
    ``{matrix: sorted member ranks}``.

    While it shortens the modelled step, take the slowest rank and, of the (up to four largest)
    matrices it alone runs NS for, team the one whose team brings the slowest rank lowest: the slow
    rank and the k-1 least-loaded others (anywhere, or, with ``ranks_per_node``, in its node), k in ``sizes``, costed by :func:`team_seconds` against its
    one home (:func:`~.cost_model.rank_seconds`), kept when every rank it touches ends below the slowest rank's
    time (so equally slow ranks are relieved one by one); of the teams found, the first ones up to the
    shortest modelled step are kept (none if it is not shorter than without teams).  That greedy runs
    with every size of ``sizes`` and with each size alone; the shortest modelled step wins.
    ``eligible[i]`` False keeps matrix i at its home.  A pure function of its inputs: every rank gets
    the same teams."""
    cm = cost_model or CostModel()
    if world_size < 2 or not tasks:
        return {}
    tasks = [t if len(t.held) == world_size else dataclasses.replace(
        t, held=tuple(t.held) + (0,) * (world_size - len(t.held))) for t in tasks]
    costs = _Costs(tasks, world_size, cm)
    # the greedy over every size, and over each size alone (a large first team can take the idle ranks
    # later teams needed): the plan with the shortest modelled step wins; ties: the earlier
    best = None
    for allowed in [tuple(sizes)] + [(k,) for k in sizes if k <= world_size] if len(sizes) > 1 else [tuple(sizes)]:
        teams, step = _greedy_teams(tasks, world_size, homes, cm, costs, eligible, allowed)
        if best is None or step < best[1] * (1 - 1e-9):
            best = (teams, step)
    return best[0]


def _greedy_teams(tasks, world_size, homes, cm, costs, eligible, sizes) -> Tuple[Dict[int, Tuple[int, ...]], float]:
    """:func:`plan_teams`'s greedy with team sizes ``sizes``: the teams and the modelled step."""
    part = [costs(i, tuple(hs)) for i, hs in enumerate(homes)]
    t_rank = np.zeros(world_size)
    for p in part:
        t_rank += p
    teams: Dict[int, Tuple[int, ...]] = {}
    steps = [(float(t_rank.max()), 0)]  # the modelled step after each team, and how many
    ranks = np.arange(world_size)
    for _ in range(len(tasks)):
        b = int(np.argmax(t_rank))
        limit = float(t_rank[b])
        cands = [i for i, hs in enumerate(homes) if i not in teams and tuple(hs) == (b,)
                 and (eligible is None or eligible[i]) and max(tasks[i].rows, tasks[i].cols) >= 2]
        cands = sorted(cands, key=lambda i: (-tasks[i].flops, i))[:4]
        best = None
        for i in cands:
            base = t_rank - part[i]
            order = np.lexsort((ranks, base)).tolist()  # least loaded first; ties: the lowest rank
            pools = [[r for r in order if r != b]]
            if cm.ranks_per_node:  # or inside b's node, where the all_reduces run at the intra-node rate
                pools.append([r for r in pools[0] if cm.node(r) == cm.node(b)])
            for others in pools:
                for k in sizes:
                    if k > len(others) + 1 or k > max(tasks[i].rows, tasks[i].cols):
                        break
                    members = tuple(sorted([b] + others[:k - 1]))
                    new = team_seconds(tasks[i], members, cm)
                    touched = (new != 0) | (part[i] != 0)  # the others keep their time: ties between slow ranks
                    worst = float((base + new)[touched].max())
                    if worst < limit * (1 - 1e-9) and (best is None or worst < best[0]):
                        best = (worst, i, members, new)
        if best is None:
            break
        _, i, members, new = best
        t_rank = t_rank - part[i] + new
        part[i] = new
        teams[i] = members
        steps.append((float(t_rank.max()), len(teams)))
    # relieving equally slow ranks one by one may stall before the step gets shorter: keep the best prefix
    best_step, keep = min(steps, key=lambda s: (s[0], s[1]))
    if best_step < steps[0][0] * (1 - 1e-9):
        return dict(list(teams.items())[:keep]), best_step
    return {}, steps[0][0]


def rebalance_homes(tasks: Sequence[MatrixTask], world_size: int, homes: Sequence[Tuple[int, ...]],
                    teams: Dict[int, Tuple[int, ...]], cost_model: Optional[CostModel] = None) -> List[Tuple[int, ...]]:
    """One-home matrices moved off the slowest rank once ``teams`` have loaded their members: while it
    shortens the modelled step, move one matrix whose only home is the slowest rank to the least-loaded
    rank or one of its holders (where the matrix's NS and bytes keep every rank they touch below the
    slowest).  Only homes move: a one-home NS is the same bits wherever it runs.  Deterministic."""
    cm = cost_model or CostModel()
    homes = [tuple(h) for h in homes]
    if not teams or world_size < 2:
        return homes
    tasks = [t if len(t.held) == world_size else dataclasses.replace(
        t, held=tuple(t.held) + (0,) * (world_size - len(t.held))) for t in tasks]
    costs = _Costs(tasks, world_size, cm)
    part = [team_seconds(tasks[i], teams[i], cm) if i in teams else costs(i, hs) for i, hs in enumerate(homes)]
    t_rank = np.zeros(world_size)
    for p in part:
        t_rank += p
    for _ in range(2 * len(tasks)):
        b = int(np.argmax(t_rank))
        limit = float(t_rank[b])
        idle = int(np.argmin(t_rank))
        best = None
        for i, hs in enumerate(homes):
            if i in teams or hs != (b,):
                continue
            for h in sorted({idle, *np.flatnonzero(costs.held[i]).tolist()} - {b}):
                new = costs(i, (h,))
                touched = (new != 0) | (part[i] != 0)
                worst = float((t_rank - part[i] + new)[touched].max())
                if worst < limit * (1 - 1e-9) and (best is None or worst < best[0]):
                    best = (worst, i, h, new)
        if best is None:
            break
        _, i, h, new = best
        t_rank += new - part[i]
        homes[i], part[i] = (h,), new
    return homes
