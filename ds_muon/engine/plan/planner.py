"""Home ranks for Newton–Schulz: balance the work, and do not move what is already home.

A pure function of matrix shapes, what each rank holds, and the world size, so
every rank computes the same plan without talking.  The CLI runs the same code at
any scale.

Cost model (one step): rank r spends ``ns_flops(r) / flops_per_s`` on
Newton–Schulz plus ``(bytes_in(r) + bytes_out(r)) / bytes_per_s`` on the two
exchanges, where bytes count everything r sends or receives.  ``strategy="lpt"``
is the classic longest-processing-time rule on NS cost alone (the baseline);
``"locality"`` runs the same LPT order but picks, for each matrix, the
home that keeps the modelled slowest rank fastest, so a matrix the stack already
delivered whole stays where it is unless moving it pays.  ``"auto"`` (the optimizer's
default; the ``locality`` plan where nothing is replicated) then gives
replicated matrices extra homes where running NS again costs less than sending the
result (:func:`plan_multi_homes`), and chooses per HSDP matrix between one home in the
world, one home per replica group (no bytes between groups) and NS at every holder.  With ``CostModel.ranks_per_node`` bytes between
nodes and inside a node go at their own rates (:func:`~.cost_model.rank_seconds`).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..exchange.routes import replica_group_of
from .cost_model import CostModel, MatrixTask, Plan, _Costs, _home_seconds

STRATEGIES = ("locality", "lpt", "round_robin", "auto")


def _lpt_order(tasks: Sequence[MatrixTask]) -> List[int]:
    # Cost descending; ties by shape, then by original order: deterministic everywhere.
    return sorted(range(len(tasks)), key=lambda i: (-tasks[i].flops, tasks[i].rows, tasks[i].cols, i))


def plan_homes(
    tasks: Sequence[MatrixTask],
    world_size: int,
    strategy: str = "locality",
    cost_model: Optional[CostModel] = None,
) -> Plan:
    """Give every matrix one home rank (see the module docstring for the objective)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"planner strategy {strategy!r} is unknown; use one of {list(STRATEGIES)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    cm = cost_model or CostModel()
    tasks = [t if len(t.held) == world_size else dataclasses.replace(
        t, held=tuple(t.held) + (0,) * (world_size - len(t.held))) for t in tasks]
    homes = [0] * len(tasks)
    if strategy == "round_robin":
        homes = [i % world_size for i in range(len(tasks))]
    elif strategy == "lpt":
        heap = [(0.0, r) for r in range(world_size)]
        for i in _lpt_order(tasks):
            load, r = heapq.heappop(heap)
            homes[i] = r
            heapq.heappush(heap, (load + tasks[i].flops, r))
    else:  # locality, and auto's first home
        homes = _plan_locality(tasks, world_size, cm)
    return Plan(world_size, homes, list(tasks), cm, strategy)


def _plan_locality(tasks: List[MatrixTask], world: int, cm: CostModel) -> List[int]:
    """Start where the stack put things, then move work off the slowest rank while it pays.

    1. In LPT order, each matrix goes to the rank holding most of it (ties, e.g.
       replicated DDP tensors: the least-loaded such rank) — zero or minimal traffic.
    2. Repeatedly take the slowest rank (modelled NS + traffic seconds) and move the
       one matrix whose move brings every rank it touches below that rank's time the
       most; stop when no move shortens the step.  Candidate targets for a matrix
       are its holders and the least-loaded rank overall.

    Costs are dense float64 vectors over the ranks (:func:`_home_seconds`, equal to
    :meth:`CostModel.seconds` of :func:`~.cost_model.task_traffic` rank for rank), so thousands of ranks plan in seconds.
    """
    n = len(tasks)
    homes = [0] * n
    t_rank = np.zeros(world)
    per_home: Dict[int, np.ndarray] = {}
    held = [np.asarray(t.held, dtype=np.int64) for t in tasks]

    for i in _lpt_order(tasks):
        t = tasks[i]
        most = int(held[i].max()) if world else 0
        if most > 0:
            cands = np.flatnonzero(held[i] == most)
            h = int(cands[np.argmin(t_rank[cands])])  # least loaded; ties: the lowest rank
        else:
            h = int(np.argmin(t_rank))
        homes[i] = h
        per_home[i] = _home_seconds(t, held[i], h, cm)
        t_rank += per_home[i]

    owned: Dict[int, set] = defaultdict(set)
    for i, h in enumerate(homes):
        owned[h].add(i)
    for _ in range(4 * n + world):
        b = int(np.argmax(t_rank))  # the slowest rank; ties: the lowest
        limit = float(t_rank[b])
        best = None
        idle = int(np.argmin(t_rank))
        for i in sorted(owned[b]):
            t = tasks[i]
            old = per_home[i]
            for h in {idle, *np.flatnonzero(held[i]).tolist()}:  # a set, as before: its order breaks ties
                if h == b:
                    continue
                new = _home_seconds(t, held[i], h, cm)
                touched = np.flatnonzero((old != 0) | (new != 0))
                after = t_rank[touched] - old[touched] + new[touched]
                worst = float(after.max())
                if worst < limit * (1 - 1e-9) and (best is None or worst < best[0]):
                    best = (worst, i, h, new, touched, after)
        if best is None:
            break
        _, i, h, new, touched, after = best
        t_rank[touched] = after
        owned[homes[i]].discard(i)
        owned[h].add(i)
        homes[i] = h
        per_home[i] = new
    return homes


def replica_homes(t: MatrixTask, home: int) -> List[Tuple[int, ...]]:
    """Alternatives to a single ``home`` for a matrix held by replica groups: one home per group
    (the rank at the home's position in each group: no bytes between groups) and every holder
    (NS everywhere, no scatter).  ``[]`` when ``t`` has no replica groups or ``home`` is in none."""
    mine = replica_group_of(t.groups, home)
    if not mine:
        return []
    pos = mine.index(home)
    per_group = tuple(sorted(g[min(pos, len(g) - 1)] for g in t.groups))
    return [per_group, tuple(sorted(r for g in t.groups for r in g))]


def plan_multi_homes(tasks: Sequence[MatrixTask], world_size: int, cost_model: Optional[CostModel] = None,
                     strategy: str = "auto") -> List[Tuple[int, ...]]:
    """Homes per matrix, several where the cost model says duplicating NS beats sending the result.

    Starts from :func:`plan_homes`.  Only ``strategy="auto"`` goes on (the others keep one home):
    while it shortens the modelled step, take the slowest rank and give one of the matrices it
    touches more homes among the ranks already holding it whole (DDP replicas: nothing to gather),
    which run the same NS and take over part of the scatter: that rank itself, the least-loaded
    rank, or every whole holder at once; a matrix held by replica groups (HSDP) may instead get one
    home per group or NS at every holder (:func:`replica_homes`).  (Single steps cannot always get there:
    a new home also takes over scatter targets.)  A move is kept when the slowest rank gets faster, or stays as
    fast while the ranks together spend less time (ties between equally slow ranks); then
    :func:`_best_duplication` tries those alternatives on whole prefixes.  A pure function of its inputs:
    every rank gets the same homes.

    Each (matrix, homes) is costed once, as a dense vector over the ranks (:class:`_Costs`), whole-prefix
    duplication is tried first (it often ends the search at once: GPT-125M under DDP), and the local
    moves stop after a fixed amount of work (``MOVE_WORK``), so planning stays under a second for
    hundreds of matrices at thousands of ranks (``ds-muon plan --strategies auto`` shows the plan)."""
    cm = cost_model or CostModel()
    plan = plan_homes(tasks, world_size, strategy, cm)
    tasks = plan.tasks
    homes: List[Tuple[int, ...]] = [(h,) for h in plan.homes]
    if strategy != "auto" or world_size == 1:
        return homes
    costs = _Costs(tasks, world_size, cm)
    homes = _best_duplication(costs, homes)
    return _best_duplication(costs, _local_moves(costs, homes))


# How much :func:`_local_moves` may look at: about 0.2 s of CPU.  Small models converge long before
# (GPT-125M at 64 ranks: a few moves); a large model on many replicas (Llama-70B's 560 matrices) would
# otherwise take thousands of one-home moves, each weighing every matrix.  The plan is then the best
# found so far, still checked against whole-prefix duplication (:func:`_best_duplication`).
MOVE_WORK = 5_000_000
MOVE_WORK_MIN_RANKS = 256


def _local_moves(costs: _Costs, homes: List[Tuple[int, ...]]) -> List[Tuple[int, ...]]:
    """:func:`plan_multi_homes`'s moves: from ``homes``, while the slowest rank gets faster (or stays
    as fast with less time in all), give one matrix it touches other homes."""
    tasks, world = costs.tasks, costs.world
    homes = list(homes)
    part = [costs(i, hs) for i, hs in enumerate(homes)]
    t_rank = np.zeros(world)
    for p in part:  # in matrix order, as a sum per rank
        t_rank += p
    is_whole = []
    for w in costs.whole:
        m = np.zeros(world, bool)
        m[w] = True
        is_whole.append(m)
    work = 0  # ranks looked at, each move costed at least MOVE_WORK_MIN_RANKS (a bound, not a clock: deterministic)
    for _ in range(4 * len(tasks) + world):
        if work > MOVE_WORK:
            break
        b = int(np.argmax(t_rank))  # the slowest rank; ties: the lowest
        limit = float(t_rank[b])
        best = None
        for i, hs in enumerate(homes):
            if not part[i][b]:
                continue
            cands = []
            spare = is_whole[i].copy()
            spare[list(hs)] = False
            if spare.any():
                # the slowest rank itself (it stops receiving this result) or the least-loaded holder
                least = int(np.argmin(np.where(spare, t_rank, np.inf)))
                cands = [tuple(sorted(hs + (c,))) for c in sorted({least, *([b] if spare[b] else [])})]
                cands.append(tuple(sorted(set(hs) | set(np.flatnonzero(spare).tolist()))))  # NS everywhere
            if len(hs) == 1:  # HSDP: one home per replica group, or NS at every holder
                cands += [c for c in replica_homes(tasks[i], hs[0]) if c != hs]
            for new_hs in dict.fromkeys(cands):
                work += max(world, MOVE_WORK_MIN_RANKS)
                new = costs(i, new_hs)
                touched = np.flatnonzero((part[i] != 0) | (new != 0))
                now = t_rank[touched]
                after = now - part[i][touched] + new[touched]
                worst = float(after.max())
                gain = sum(after.tolist()) - sum(now.tolist())  # < 0: less time in all
                shorter = worst < limit * (1 - 1e-9)
                if (shorter or (worst <= limit and gain < -1e-12 * limit)) and (best is None or (worst, gain) < best[:2]):
                    best = (worst, gain, i, new_hs, touched, after)
        if best is None:
            break
        _, _, i, new_hs, touched, after = best
        t_rank[touched] = after
        homes[i], part[i] = new_hs, costs(i, new_hs)
    return homes


def _best_duplication(costs: _Costs, homes: List[Tuple[int, ...]]) -> List[Tuple[int, ...]]:
    """Local moves stall on ties between equally slow ranks; so also try, for the 1, 2, 4, ... (up to all)
    matrices where it saves the most time in all, each one's best alternative: NS at every whole holder
    (DDP), or one home per replica group / NS at every holder (HSDP, :func:`replica_homes`); keep the
    fastest plan.  Alternatives that cost more time in all stay in (last): at thousands of DDP ranks
    duplicating everything still beats one home sending each result W-1 times."""
    tasks, world = costs.tasks, costs.world

    def alternatives(i: int) -> List[Tuple[int, ...]]:
        whole = tuple(costs.whole[i].tolist())
        out = [whole] if len(whole) > len(homes[i]) else []
        return out + (replica_homes(tasks[i], homes[i][0]) if len(homes[i]) == 1 else [])

    def total(v: np.ndarray) -> float:
        return sum(v[v != 0].tolist())

    def step(hs_list) -> float:
        t_rank = np.zeros(world)
        for i, hs in enumerate(hs_list):
            t_rank += costs(i, hs)
        return float(t_rank.max())

    now = [total(costs(i, hs)) for i, hs in enumerate(homes)]
    best_alt = {}
    for i in range(len(tasks)):
        for alt in alternatives(i):
            saving = now[i] - total(costs(i, alt))  # may be < 0: NS everywhere can still shorten the step
            if i not in best_alt or saving > best_alt[i][0]:
                best_alt[i] = (saving, alt)
    order = sorted(best_alt, key=lambda i: (-best_alt[i][0], i))
    best, best_t = homes, step(homes)
    k = 1
    while order and k <= 2 * len(order):
        dup = set(order[:k])
        cand = [best_alt[i][1] if i in dup else hs for i, hs in enumerate(homes)]
        t = step(cand)
        if t < best_t * (1 - 1e-9):
            best, best_t = cand, t
        k *= 2
    return best
