"""Home ranks for Newton–Schulz: balance the work, and do not move what is already home.

A pure function of matrix shapes, what each rank holds, and the world size, so
every rank computes the same plan without talking.  The CLI runs the same code at
any scale.

Cost model (one step): rank r spends ``ns_flops(r) / flops_per_s`` on
Newton–Schulz plus ``(bytes_in(r) + bytes_out(r)) / bytes_per_s`` on the two
exchanges, where bytes count everything r sends or receives.  ``strategy="lpt"``
is the classic longest-processing-time rule on NS cost alone (the baseline);
``"locality"`` (default) runs the same LPT order but picks, for each matrix, the
home that keeps the modelled slowest rank fastest, so a matrix the stack already
delivered whole stays where it is unless moving it pays.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .newton_schulz import ns_flops

STRATEGIES = ("locality", "lpt", "round_robin")


@dataclass(frozen=True)
class CostModel:
    """Rates that turn FLOPs and bytes into seconds (defaults: one H100/H200-class GPU
    at 400 TFLOP/s of bf16 matmul in NS, 50 GB/s per rank of all_to_all bandwidth)."""

    flops_per_s: float = 400e12
    bytes_per_s: float = 50e9


@dataclass(frozen=True)
class MatrixTask:
    """What the planner needs of one matrix: its 2-D shape, NS steps, bytes per
    element on the wire, and how many elements each rank already holds."""

    rows: int
    cols: int
    steps: int = 5
    elem_bytes: int = 2
    held: Tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def flops(self) -> float:
        return ns_flops(self.rows, self.cols, self.steps)


@dataclass
class Plan:
    """Homes per matrix and what they cost each rank."""

    world_size: int
    homes: List[int]
    tasks: List[MatrixTask]
    cost_model: CostModel = field(default_factory=CostModel)
    strategy: str = "locality"

    @property
    def ns_cost(self) -> List[float]:
        cost = [0.0] * self.world_size
        for t, h in zip(self.tasks, self.homes):
            cost[h] += t.flops
        return cost

    def traffic(self) -> Tuple[List[int], List[int]]:
        """Bytes each rank sends and receives per step (gather + scatter together)."""
        sent = [0] * self.world_size
        recv = [0] * self.world_size
        for t, h in zip(self.tasks, self.homes):
            for r, (s, rc) in task_traffic(t, h).items():
                sent[r] += s * t.elem_bytes
                recv[r] += rc * t.elem_bytes
        return sent, recv

    @property
    def bytes_sent(self) -> List[int]:
        return self.traffic()[0]

    @property
    def bytes_received(self) -> List[int]:
        return self.traffic()[1]

    @property
    def imbalance(self) -> float:
        """max / mean of per-rank NS cost (1.0 is perfect)."""
        cost = self.ns_cost
        mean = sum(cost) / len(cost)
        return max(cost) / mean if mean > 0 else 1.0

    @property
    def lower_bound(self) -> float:
        """No plan's busiest rank does less NS work than this."""
        cost = self.ns_cost
        largest = max((t.flops for t in self.tasks), default=0.0)
        return max(sum(cost) / len(cost), largest)

    @property
    def imbalance_vs_bound(self) -> float:
        """max / lower bound of per-rank NS cost."""
        lb = self.lower_bound
        return max(self.ns_cost) / lb if lb > 0 else 1.0

    def step_time(self) -> List[float]:
        """Modelled seconds per rank: NS plus both exchanges."""
        sent, recv = self.traffic()
        cm = self.cost_model
        return [
            c / cm.flops_per_s + (s + r) / cm.bytes_per_s for c, s, r in zip(self.ns_cost, sent, recv)
        ]

    def groups_at(self, rank: int, key=None) -> Dict[tuple, List[int]]:
        """Same-shape groups at a home: {(rows, cols[, key]): [matrix indices]} in order."""
        out: Dict[tuple, List[int]] = defaultdict(list)
        for i, (t, h) in enumerate(zip(self.tasks, self.homes)):
            if h == rank:
                k = (t.rows, t.cols) if key is None else (t.rows, t.cols, key(i))
                out[k].append(i)
        return dict(out)


def task_traffic(t: MatrixTask, home: int) -> Dict[int, Tuple[float, float]]:
    """Elements each rank sends and receives for one matrix homed at ``home``.

    Gather: the home receives what it lacks, ``numel - held[home]``, spread over the
    other holders (replicas share the sending).  Scatter: every other holder gets
    its piece back from the home.
    """
    others = [(r, n) for r, n in enumerate(t.held) if n > 0 and r != home]
    held_elsewhere = sum(n for _, n in others)
    missing = t.numel - (t.held[home] if home < len(t.held) else 0)
    frac = missing / held_elsewhere if held_elsewhere else 0.0
    out = {home: (float(held_elsewhere), float(missing))}
    for r, n in others:
        out[r] = (n * frac, float(n))
    return out


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
    tasks = [t if len(t.held) == world_size else MatrixTask(t.rows, t.cols, t.steps, t.elem_bytes,
                                                            tuple(t.held) + (0,) * (world_size - len(t.held)))
             for t in tasks]
    homes = [0] * len(tasks)
    if strategy == "round_robin":
        homes = [i % world_size for i in range(len(tasks))]
    elif strategy == "lpt":
        heap = [(0.0, r) for r in range(world_size)]
        for i in _lpt_order(tasks):
            load, r = heapq.heappop(heap)
            homes[i] = r
            heapq.heappush(heap, (load + tasks[i].flops, r))
    else:
        homes = _plan_locality(tasks, world_size, cm)
    return Plan(world_size, homes, list(tasks), cm, strategy)


def _plan_locality(tasks: List[MatrixTask], world: int, cm: CostModel) -> List[int]:
    """LPT order; per matrix, the home minimising the modelled busiest rank.

    Candidates are the ranks holding part of the matrix and the least-loaded rank
    that holds none of it (every non-holder costs the same traffic, so the
    least-loaded one dominates the others).  O(n·(holders + log W)).
    """
    t_rank = [0.0] * world  # modelled seconds per rank so far
    heap = [(0.0, r) for r in range(world)]  # lazy min-heap of (t_rank, rank)
    homes = [0] * len(tasks)
    busiest = 0.0
    for i in _lpt_order(tasks):
        t = tasks[i]
        ns_s = t.flops / cm.flops_per_s
        holders = [r for r, n in enumerate(t.held) if n > 0]
        holder_set = set(holders)
        while heap and heap[0][0] != t_rank[heap[0][1]]:
            heapq.heappop(heap)  # stale entry
        candidates = list(holders)
        if len(holders) < world:
            # least loaded non-holder: pop stale/holder entries without losing them
            kept = []
            while heap:
                load, r = heapq.heappop(heap)
                if load != t_rank[r]:
                    continue
                kept.append((load, r))
                if r not in holder_set:
                    candidates.append(r)
                    break
            for e in kept:
                heapq.heappush(heap, e)

        def costs(h: int) -> Dict[int, float]:
            per = {r: (sn + rc) * t.elem_bytes / cm.bytes_per_s for r, (sn, rc) in task_traffic(t, h).items()}
            per[h] += ns_s
            return per

        def outcome(h: int):
            per = costs(h)
            worst = max(t_rank[r] + c for r, c in per.items())
            moved = t.numel - t.held[h]
            # the busiest rank after this choice; then fewer elements moved; then load; then rank
            return (max(busiest, worst), moved, t_rank[h], h)

        best = min(candidates, key=outcome)
        homes[i] = best
        for r, c in costs(best).items():
            t_rank[r] += c
            heapq.heappush(heap, (t_rank[r], r))
            busiest = max(busiest, t_rank[r])
    return homes
