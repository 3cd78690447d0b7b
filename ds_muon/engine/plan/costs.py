"""What each way of placing Newton–Schulz costs a step, per rank: the table of ``ds-muon plan``.

Strategies compared on the same shapes and holdings:

* ``locality`` / ``lpt`` / ``round_robin`` — one home per matrix
  (:func:`ds_muon.engine.plan.planner.plan_homes`), two fused all_to_all per step;
* ``duplicated`` — the naive baseline: every rank gathers every matrix and runs
  every NS (one all_gather per matrix);
* ``deepspeed_owner`` — DeepSpeed 0.19.8's built-in Muon: each rank runs NS on
  every matrix that has a piece in its ZeRO partition (a matrix that straddles
  a partition boundary is all-gathered and orthogonalized by each of its holders);
* ``locality+dup`` — when ranks outnumber matrices, the idle ranks become extra
  homes of the matrices whose home sends the most, each home then scattering to
  a share of the holders (duplicate NS, split scatter);
* ``auto`` — ``planner="auto"`` with ``team_ns=False`` (:func:`multi_home_cost`): the
  ``locality`` plan plus extra homes where the cost model says so;
* ``team`` — the optimizer's default, ``planner="auto"`` with team NS (:func:`team_cost`): the
  ``auto`` plan where the matrices that bound the step run as teams of ranks
  (:func:`~ds_muon.engine.plan.team_plan.plan_teams`); its row adds ``teams`` (how many), ``max_team`` (the
  largest team) and ``vs_auto`` (the same plan's modelled step without teams over this one's, both as the
  planner models them: > 1 where teams pay).

The same on a 2-D mesh (``ds-muon plan --mesh``): :mod:`.mesh_costs`.

Every number of the world-size table is the planner's own: the sharded rows read the :class:`~ds_muon.engine.plan.cost_model.Plan`
the optimizer would use (its NS cost, traffic and modelled step time), the baselines
count gathers with :func:`~ds_muon.engine.plan.cost_model.gather_traffic` and turn FLOPs and bytes
into seconds with the same :meth:`CostModel.seconds <ds_muon.engine.plan.cost_model.CostModel.seconds>`.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .cost_model import CostModel, MatrixTask, _Costs, gather_traffic, host_traffic, pair_traffic
from .planner import plan_homes, plan_multi_homes
from .team_plan import plan_teams, rebalance_homes, team_member_flops, team_seconds, team_traffic, team_widths


SHARDED = ("locality", "lpt", "round_robin")
BASELINES = ("duplicated", "deepspeed_owner")
STRATEGIES = SHARDED + BASELINES + ("locality+dup", "auto", "team")  # "team": the optimizer's default
OPTIONAL: tuple = ()  # rows only on request (none now: "auto" plans in under a second at thousands of ranks)


@dataclass
class StrategyCost:
    """One strategy's step, per rank: NS FLOPs, bytes each way, modelled seconds."""

    strategy: str
    ns_flops: List[float]
    bytes_sent: List[float]
    bytes_received: List[float]
    seconds: List[float]
    collectives: int
    max_matrices_per_rank: int
    host_bytes: Optional[List[float]] = None  # host<->device bytes per rank under offload (None: no offload)
    peers: Optional[List[int]] = None  # ranks each rank's exchange talks to (sharded plans; None: not modelled)

    def row(self, tasks: Sequence[MatrixTask]) -> Dict[str, object]:
        world = len(self.ns_flops)
        mean = sum(self.ns_flops) / world
        bound = ns_lower_bound(tasks, world)
        peak = max(self.ns_flops)
        return {
            "world_size": world,
            "strategy": self.strategy,
            "matrices": len(tasks),
            "waves": self.max_matrices_per_rank,
            "ns_max_over_mean": round(peak / mean, 4) if mean else 1.0,
            "ns_max_over_bound": round(peak / bound, 4) if bound else 1.0,
            "max_bytes_sent": int(max(self.bytes_sent)),
            "max_bytes_received": int(max(self.bytes_received)),
            "total_bytes_moved": int(sum(self.bytes_sent)),
            "collectives_per_step": self.collectives,
            "modelled_step_ms": round(max(self.seconds) * 1e3, 4),
            **({"max_host_bytes": int(max(self.host_bytes))} if self.host_bytes is not None else {}),
        }


def ns_lower_bound(tasks: Sequence[MatrixTask], world: int) -> float:
    """No placement's busiest rank does less NS work than this: an equal share, or the largest matrix."""
    return max(sum(t.flops for t in tasks) / world, max((t.flops for t in tasks), default=0.0))


def sharded_cost(tasks: Sequence[MatrixTask], world: int, strategy: str, cm: CostModel) -> StrategyCost:
    plan = plan_homes(tasks, world, strategy, cm)
    sent, recv = plan.traffic()
    per_home = [plan.homes.count(r) for r in range(world)]
    host = host_traffic(plan.tasks, world) if cm.offload else None
    return StrategyCost(strategy, plan.ns_cost, sent, recv, plan.step_time(), 2, max(per_home), host,
                        peer_counts(plan.tasks, [(h,) for h in plan.homes], world))


def peer_counts(tasks: Sequence[MatrixTask], homes: Sequence[Sequence[int]], world: int) -> List[int]:
    """How many other ranks each rank's exchange talks to (either direction), from the pairs
    :func:`~ds_muon.engine.plan.cost_model.pair_traffic` moves bytes between: the ``max_peers`` of ``--exchange``."""
    links = [set() for _ in range(world)]
    for t, hs in zip(tasks, homes):
        for (a, b), n in pair_traffic(t, hs).items():
            if n:
                links[a].add(b)
                links[b].add(a)
    return [len(x) for x in links]


def _modelled(strategy: str, ns: List[float], sent: List[float], recv: List[float], collectives: int,
              count: List[int], cm: CostModel, tasks: Sequence[MatrixTask] = ()) -> StrategyCost:
    """A baseline's step from its per-rank NS FLOPs and traffic (plus, under offload, each rank's
    pieces to the device and back, as for the sharded strategies)."""
    host = host_traffic(tasks, len(ns)) if cm.offload else [0.0] * len(ns)
    seconds = [cm.seconds(f, s + r, h) for f, s, r, h in zip(ns, sent, recv, host)]
    return StrategyCost(strategy, ns, sent, recv, seconds, collectives, max(count), host if cm.offload else None)


def _gather(t: MatrixTask, receivers: Sequence[int], sent: List[float], recv: List[float]) -> None:
    """Add the bytes of every receiver collecting ``t`` whole (:func:`~ds_muon.engine.plan.cost_model.gather_traffic`)."""
    for r, (s, rc) in gather_traffic(t, receivers).items():
        sent[r] += s * t.elem_bytes
        recv[r] += rc * t.elem_bytes


def duplicated_cost(tasks: Sequence[MatrixTask], world: int, cm: CostModel) -> StrategyCost:
    sent, recv = [0.0] * world, [0.0] * world
    for t in tasks:
        _gather(t, range(world), sent, recv)
    total = sum(t.flops for t in tasks)
    return _modelled("duplicated", [total] * world, sent, recv, len(tasks), [len(tasks)], cm, tasks)


def deepspeed_owner_cost(tasks: Sequence[MatrixTask], world: int, cm: CostModel) -> StrategyCost:
    ns, sent, recv, count = [0.0] * world, [0.0] * world, [0.0] * world, [0] * world
    gathers = 0
    for t in tasks:
        holders = [r for r in range(world) if t.held[r] > 0]
        if any(t.held[r] < t.numel for r in holders):
            gathers += 1
            _gather(t, holders, sent, recv)
        for r in holders:
            ns[r] += t.flops
            count[r] += 1
    return _modelled("deepspeed_owner", ns, sent, recv, gathers, count, cm, tasks)


def duplicate_surplus_cost(tasks: Sequence[MatrixTask], world: int, cm: CostModel) -> StrategyCost:
    """Locality plan, then every rank left without a matrix becomes an extra home of the
    matrix whose homes send the most; that matrix's holders are split among its homes."""
    plan = plan_homes(tasks, world, "locality", cm)
    homes = [[h] for h in plan.homes]
    idle = sorted(set(range(world)) - set(plan.homes))
    # bytes each matrix's homes scatter, shared among its homes: a max-heap
    scatter = [sum(n for r, n in enumerate(t.held) if r != h) * t.elem_bytes for t, h in zip(tasks, plan.homes)]
    heap = [(-s, i) for i, s in enumerate(scatter) if s > 0]
    heapq.heapify(heap)
    for r in idle:
        if not heap:
            break
        _, i = heapq.heappop(heap)
        homes[i].append(r)
        scatter[i] -= tasks[i].held[r] * tasks[i].elem_bytes
        if scatter[i] > 0:
            heapq.heappush(heap, (-scatter[i] / len(homes[i]), i))
    ns = [0.0] * world
    sent = [0.0] * world
    recv = [0.0] * world
    count = [0] * world
    for t, hs in zip(tasks, homes):
        _gather(t, hs, sent, recv)
        for h in hs:
            ns[h] += t.flops
            count[h] += 1
        others = [r for r in range(world) if r not in hs and t.held[r] > 0]
        for k, r in enumerate(others):  # scatter: holders split among homes
            sent[hs[k % len(hs)]] += t.held[r] * t.elem_bytes
            recv[r] += t.held[r] * t.elem_bytes
    return _modelled("locality+dup", ns, sent, recv, 2, count, cm, tasks)


def multi_home_cost(tasks: Sequence[MatrixTask], world: int, cm: CostModel) -> StrategyCost:
    """The optimizer's ``planner="auto"`` (:func:`~ds_muon.engine.plan.planner.plan_multi_homes`), counted the way
    its exchange moves bytes (:func:`~ds_muon.engine.plan.cost_model.pair_traffic`)."""
    tasks = _held_by_every_rank(tasks, world)  # replica groups kept: the optimizer plans with them
    homes = plan_multi_homes(tasks, world, cm, "auto")
    ns, sent, recv, count = [0.0] * world, [0.0] * world, [0.0] * world, [0] * world
    for t, hs in zip(tasks, homes):
        _count_homes(t, hs, ns, count, sent, recv)
    cost = _modelled("auto", ns, sent, recv, 2 if any(sent) else 0, count, cm, tasks)  # no bytes: no collective
    cost.peers = peer_counts(tasks, homes, world)
    return cost


def _held_by_every_rank(tasks: Sequence[MatrixTask], world: int) -> List[MatrixTask]:
    """Tasks whose ``held`` has an entry per rank (ranks past the given ones hold nothing)."""
    return [t if len(t.held) == world else dataclasses.replace(t, held=tuple(t.held) + (0,) * (world - len(t.held)))
            for t in tasks]


def _count_homes(t: MatrixTask, homes, ns, count, sent, recv) -> None:
    """Add one matrix's NS at each of its homes, and the bytes its exchange moves, to the per-rank totals."""
    for h in homes:
        ns[h] += t.flops
        count[h] += 1
    for (a, b), n in pair_traffic(t, homes).items():
        sent[a] += n * t.elem_bytes
        recv[b] += n * t.elem_bytes


def team_cost(tasks: Sequence[MatrixTask], world: int, cm: CostModel) -> Tuple[StrategyCost, dict]:
    """The optimizer's default (``planner="auto"``, ``team_ns=True``): :func:`multi_home_cost`'s homes,
    then :func:`~ds_muon.engine.plan.team_plan.plan_teams` and :func:`~ds_muon.engine.plan.team_plan.rebalance_homes`.  Team members count their share of the NS, the bytes
    of their blocks (:func:`~ds_muon.engine.plan.team_plan.team_traffic`) and of the ring all_reduces; seconds
    are the planner's own (:func:`~ds_muon.engine.plan.team_plan.team_seconds` beside one home's).  Also returns
    the row's extra columns."""
    tasks = _held_by_every_rank(tasks, world)
    homes = plan_multi_homes(tasks, world, cm, "auto")
    teams = plan_teams(tasks, world, homes, cm)
    alone, homes = homes, rebalance_homes(tasks, world, homes, teams, cm)
    ns, sent, recv, count = [0.0] * world, [0.0] * world, [0.0] * world, [0] * world
    costs = _Costs(tasks, world, cm)
    seconds, one_home = [0.0] * world, np.zeros(world)  # the planner's seconds, with and without teams
    for i, hs in enumerate(alone):
        one_home += costs(i, tuple(hs))
    for i, (t, hs) in enumerate(zip(tasks, homes)):
        if i in teams:
            members = teams[i]
            m = min(t.rows, t.cols)
            for h, w in zip(members, team_widths(t.rows, t.cols, len(members))):
                ns[h] += team_member_flops(m, w, t.steps)
                count[h] += 1
                ring = (t.steps * t.elem_bytes * m * m + 8.0) * 2 * (len(members) - 1) / len(members)
                sent[h] += ring
                recv[h] += ring
            s_el, r_el = team_traffic(t, members)
            vec = team_seconds(t, members, cm)
            for r in range(world):
                sent[r] += float(s_el[r]) * t.elem_bytes
                recv[r] += float(r_el[r]) * t.elem_bytes
        else:
            _count_homes(t, hs, ns, count, sent, recv)
            vec = costs(i, tuple(hs))
        for r in range(world):
            seconds[r] += float(vec[r])
    collectives = (2 if any(sent) else 0) + (2 + sum(t.steps + 1 for i, t in enumerate(tasks) if i in teams)
                                             if teams else 0)
    cost = StrategyCost("team", ns, sent, recv, seconds, collectives, max(count),
                        host_traffic(tasks, world) if cm.offload else None)
    auto_ms = float(one_home.max())
    extra = {"teams": len(teams), "max_team": max((len(v) for v in teams.values()), default=0),
             "vs_auto": round(auto_ms / max(seconds), 4) if max(seconds) else 1.0}
    return cost, extra


def compare(tasks: Sequence[MatrixTask], world: int, cm: CostModel,
            strategies: Sequence[str] = STRATEGIES, transport: bool = False) -> List[Dict[str, object]]:
    """One row per strategy; with ``transport``, the most peers any rank's exchange talks to
    and the transport ``cm`` would use for it (:meth:`CostModel.transport`; "-" for the baselines,
    whose collectives are not the exchange)."""
    rows = []
    for s in strategies:
        if s in SHARDED:
            cost = sharded_cost(tasks, world, s, cm)
        elif s == "duplicated":
            cost = duplicated_cost(tasks, world, cm)
        elif s == "deepspeed_owner":
            cost = deepspeed_owner_cost(tasks, world, cm)
        elif s == "locality+dup":
            cost = duplicate_surplus_cost(tasks, world, cm)
        elif s == "auto":
            cost = multi_home_cost(tasks, world, cm)
        elif s == "team":
            cost, extra = team_cost(tasks, world, cm)
        else:
            raise ValueError(f"unknown strategy {s!r}")
        row = cost.row(tasks)
        if s == "team":
            row.update(extra)
        if transport:
            peers = max(cost.peers) if cost.peers else None
            row["max_peers"] = "-" if peers is None else peers
            row["transport"] = "-" if peers is None else cm.transport(world, peers)
        rows.append(row)
    return rows


def holdings(shapes: Sequence[Tuple[int, int]], world: int, layout: str) -> List[Tuple[int, ...]]:
    """Elements each rank holds of each matrix: ``replicated`` (DDP) or ``partitioned``
    (matrices end to end, each rank one equal contiguous range: ZeRO-1/2, FSDP1)."""
    if layout == "replicated":
        return [(r * c,) * world for r, c in shapes]
    if layout != "partitioned":
        raise ValueError(f"layout {layout!r} is unknown; use 'replicated' or 'partitioned'")
    total = sum(r * c for r, c in shapes)
    bounds = [(total * k // world, total * (k + 1) // world) for k in range(world)]
    out, pos = [], 0
    for r, c in shapes:
        n = r * c
        out.append(tuple(max(0, min(hi, pos + n) - max(lo, pos)) for lo, hi in bounds))
        pos += n
    return out


def tasks_for(shapes: Sequence[Tuple[int, int]], world: int, layout: str, steps: int = 5,
              elem_bytes: int = 2, method: str = "standard") -> List[MatrixTask]:
    return [MatrixTask(r, c, steps, elem_bytes, held, method)
            for (r, c), held in zip(shapes, holdings(shapes, world, layout))]
