"""What each way of placing Newton–Schulz costs a step, per rank: the table of ``ds-muon plan``.

Strategies compared on the same shapes and holdings:

* ``locality`` / ``lpt`` / ``round_robin`` — one home per matrix
  (:func:`ds_muon.planner.plan_homes`), two fused all_to_all per step;
* ``duplicated`` — the naive baseline: every rank gathers every matrix and runs
  every NS (one all_gather per matrix);
* ``deepspeed_owner`` — DeepSpeed 0.19.8's built-in Muon: each rank runs NS on
  every matrix that has a piece in its ZeRO partition (a matrix that straddles
  a partition boundary is all-gathered and orthogonalized by each of its holders);
* ``locality+dup`` — when ranks outnumber matrices, the idle ranks become extra
  homes of the matrices whose home sends the most, each home then scattering to
  a share of the holders (duplicate NS, split scatter).

Every number is the planner's own: the sharded rows read the :class:`~ds_muon.planner.Plan`
the optimizer would use (its NS cost, traffic and modelled step time), the baselines
count gathers with :func:`~ds_muon.planner.gather_traffic` and turn FLOPs and bytes
into seconds with the same :meth:`CostModel.seconds <ds_muon.planner.CostModel.seconds>`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .planner import CostModel, MatrixTask, gather_traffic, host_traffic, plan_homes

SHARDED = ("locality", "lpt", "round_robin")
BASELINES = ("duplicated", "deepspeed_owner")
STRATEGIES = SHARDED + BASELINES + ("locality+dup",)


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
    return StrategyCost(strategy, plan.ns_cost, sent, recv, plan.step_time(), 2, max(per_home), host)


def _modelled(strategy: str, ns: List[float], sent: List[float], recv: List[float], collectives: int,
              count: List[int], cm: CostModel, tasks: Sequence[MatrixTask] = ()) -> StrategyCost:
    """A baseline's step from its per-rank NS FLOPs and traffic (plus, under offload, each rank's
    pieces to the device and back, as for the sharded strategies)."""
    host = host_traffic(tasks, len(ns)) if cm.offload else [0.0] * len(ns)
    seconds = [cm.seconds(f, s + r, h) for f, s, r, h in zip(ns, sent, recv, host)]
    return StrategyCost(strategy, ns, sent, recv, seconds, collectives, max(count), host if cm.offload else None)


def _gather(t: MatrixTask, receivers: Sequence[int], sent: List[float], recv: List[float]) -> None:
    """Add the bytes of every receiver collecting ``t`` whole (:func:`~ds_muon.planner.gather_traffic`)."""
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


def compare(tasks: Sequence[MatrixTask], world: int, cm: CostModel,
            strategies: Sequence[str] = STRATEGIES) -> List[Dict[str, object]]:
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
        else:
            raise ValueError(f"unknown strategy {s!r}")
        rows.append(cost.row(tasks))
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

