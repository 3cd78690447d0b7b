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
nodes and inside a node go at their own rates (:func:`rank_seconds`).
"""

from __future__ import annotations

import dataclasses
import heapq
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...rules.newton_schulz import ns_flops
from ..exchange.routes import gather_source, replica_group_of, replica_groups, scatter_source  # noqa: F401

STRATEGIES = ("locality", "lpt", "round_robin", "auto")
TEAM_SIZES = (2, 3, 4, 8, 16, 32, 64)  # team sizes plan_teams tries (at most the world)
EXCHANGES = ("all_to_all", "p2p", "auto")  # CostModel.exchange: the transport (auto: the cheaper by transport_seconds)


@dataclass(frozen=True)
class CostModel:
    """Rates that turn FLOPs and bytes into seconds (defaults: one H100/H200-class GPU
    at 400 TFLOP/s of bf16 matmul in NS, 50 GB/s per rank of all_to_all bandwidth).

    ``offload``: optimizer state lives in host memory (ZeRO-Offload, FSDP2
    ``CPUOffloadPolicy``), so each rank's pieces cross host→device before NS and their
    results device→host after it, at ``pcie_bytes_per_s`` (default 50 GB/s, PCIe Gen5
    x16 in practice); :func:`host_traffic` counts those bytes."""

    flops_per_s: float = 400e12
    bytes_per_s: float = 50e9
    pcie_bytes_per_s: float = 50e9
    offload: bool = False
    ranks_per_node: Optional[int] = None  # None: one flat link (every byte at bytes_per_s)
    intra_bytes_per_s: float = 400e9  # per rank inside a node (NVLink-class); bytes_per_s is then inter-node
    # How the exchange moves its bytes (:class:`~ds_muon.engine.exchange.all_to_all.Exchange`): "all_to_all" over the
    # whole group, "p2p" (batch_isend_irecv with the ranks it really talks to), or "auto" (the cheaper
    # by :meth:`transport`).  The per-peer latencies are assumptions, not measured on a GPU cluster.
    exchange: str = "all_to_all"
    a2a_peer_s: float = 2e-6  # per rank of the group, each all_to_all (zero-size splits included)
    p2p_peer_s: float = 8e-6  # per send or receive of a batched p2p exchange
    allreduce_hop_s: float = 2e-6  # per step of a ring all_reduce (team NS: 2(k-1) steps per all_reduce); assumed

    def __post_init__(self):
        if self.exchange not in EXCHANGES:
            raise ValueError(f"ds_muon: CostModel(exchange={self.exchange!r}) is unknown; use one of {list(EXCHANGES)}")

    @classmethod
    def for_device(cls, device_type: str) -> "CostModel":
        """The default rates for the device Newton–Schulz runs on, what ``Muon(cost_model=None)``
        plans with.  An accelerator: the class defaults.  A CPU: 0.5 TFLOP/s (bf16 NS on one
        core of the project's 2-core box, ``benchmarks/ns_roofline.py``) and 1.5 GB/s per rank
        (a gloo all_to_all of 8 MB per peer on loopback: 1.1–1.8 GB/s, ``benchmarks/a2a_scale.py
        --worlds 2 --elems 2097152``), and 1 ms per ring step of an all_reduce (gloo on loopback, this
        box loaded: 16 MB in fp32 at W=2 took 19 ms; team NS, ``benchmarks/team_ns.py``), so about 330 FLOPs cost one byte
        instead of 8000: on a CPU, NS imbalance costs more than moving a matrix to balance it.
        Both are a function of the device type alone, the same on every rank."""
        if device_type == "cpu":
            return cls(flops_per_s=0.5e12, bytes_per_s=1.5e9, intra_bytes_per_s=1.5e9, allreduce_hop_s=1e-3)
        return cls()

    def allreduce_seconds(self, ranks: Sequence[int], nbytes: float) -> float:
        """One ring all_reduce of ``nbytes`` over ``ranks``: each rank sends and receives
        2(k-1)/k of the buffer in 2(k-1) steps (the bandwidth-optimal schedule NCCL and gloo use
        for large buffers), inside a node at ``intra_bytes_per_s`` when all are on one node."""
        k = len(ranks)
        if k < 2:
            return 0.0
        one_node = bool(self.ranks_per_node) and len({self.node(r) for r in ranks}) == 1
        rate = self.intra_bytes_per_s if one_node else self.bytes_per_s
        return 2 * (k - 1) * (self.allreduce_hop_s + nbytes / k / rate)

    def transport_seconds(self, world: int, peers: int) -> Dict[str, float]:
        """Latency of one exchange call per transport: all_to_all pays for every rank of the
        group, p2p for each peer a rank really sends to and receives from (bytes are equal)."""
        return {"all_to_all": world * self.a2a_peer_s, "p2p": 2 * peers * self.p2p_peer_s}

    def transport(self, world: int, peers: int) -> str:
        """The transport the exchange uses: ``exchange`` unless "auto", then the cheaper one for
        a group of ``world`` ranks whose busiest rank talks to ``peers`` others."""
        if self.exchange != "auto":
            return self.exchange
        t = self.transport_seconds(world, peers)
        return "p2p" if t["p2p"] < t["all_to_all"] else "all_to_all"

    def node(self, rank: int) -> int:
        """The node of ``rank``: ranks are numbered node by node (torchrun's order)."""
        return rank // self.ranks_per_node if self.ranks_per_node else 0

    def link_seconds(self, intra: float, inter: float) -> float:
        """Seconds for bytes moved inside a node and across nodes.  Flat model: both at ``bytes_per_s``."""
        if not self.ranks_per_node:
            return (intra + inter) / self.bytes_per_s
        return intra / self.intra_bytes_per_s + inter / self.bytes_per_s

    def seconds(self, flops: float, bytes_moved: float, host_bytes: float = 0.0) -> float:
        """One rank's modelled step: its NS FLOPs plus every byte it sends or receives, plus
        (with ``offload``) every byte it copies between host and device."""
        pcie = host_bytes / self.pcie_bytes_per_s if self.offload else 0.0
        return flops / self.flops_per_s + bytes_moved / self.bytes_per_s + pcie


def ranks_per_node_from_env(default: Optional[int] = None) -> Optional[int]:
    """``LOCAL_WORLD_SIZE`` (set by torchrun) when present, else ``default``."""
    v = os.environ.get("LOCAL_WORLD_SIZE")
    return int(v) if v and v.isdigit() and int(v) > 0 else default


@dataclass(frozen=True)
class MatrixTask:
    """What the planner needs of one matrix: its 2-D shape, NS steps, bytes per
    element on the wire, and how many elements each rank already holds."""

    rows: int
    cols: int
    steps: int = 5
    elem_bytes: int = 2
    held: Tuple[int, ...] = ()
    method: str = "standard"
    groups: Tuple[Tuple[int, ...], ...] = ()  # replica groups (HSDP): :func:`replica_groups`

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def flops(self) -> float:
        return ns_flops(self.rows, self.cols, self.steps, self.method)


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

    def step_time(self) -> List[float]:
        """Modelled seconds per rank: NS plus both exchanges (plus host↔device copies under offload)."""
        sent, recv = self.traffic()
        host = host_traffic(self.tasks, self.world_size)
        return [self.cost_model.seconds(c, s + r, h) for c, s, r, h in zip(self.ns_cost, sent, recv, host)]


def host_traffic(tasks: Sequence[MatrixTask], world_size: int) -> List[float]:
    """Bytes each rank copies between host and device per step when its optimizer state is
    offloaded: its pieces of every matrix host→device, their results device→host.  Where the
    homes are does not change it (a rank moves what it holds), so it never moves a home."""
    out = [0.0] * world_size
    for t in tasks:
        for r, n in enumerate(t.held[:world_size]):
            out[r] += 2 * n * t.elem_bytes
    return out


def gather_traffic(t: MatrixTask, receivers: Sequence[int]) -> Dict[int, List[float]]:
    """Elements each rank sends and receives when every rank of ``receivers`` collects ``t`` whole.

    A receiver gets what it lacks, ``numel - held[r]``, from the other holders in
    proportion to what they hold (replicas share the sending); it sends nothing to itself.
    Ranks that neither send nor receive are left out.
    """
    holders = [(r, n) for r, n in enumerate(t.held) if n > 0]
    held = sum(n for _, n in holders)
    out: Dict[int, List[float]] = {}
    for home in receivers:
        mine = t.held[home] if home < len(t.held) else 0
        missing = t.numel - mine
        if not missing:
            continue
        frac = missing / (held - mine) if held - mine else 0.0
        out.setdefault(home, [0.0, 0.0])[1] += missing
        for r, n in holders:
            if r != home:
                out.setdefault(r, [0.0, 0.0])[0] += n * frac
    return out


def task_traffic(t: MatrixTask, home: int) -> Dict[int, Tuple[float, float]]:
    """Elements each rank sends and receives for one matrix homed at ``home``: the
    gather (:func:`gather_traffic` to the home), then the scatter, where every other
    holder gets its piece back from the home."""
    gathered = gather_traffic(t, [home])
    others = [(r, n) for r, n in enumerate(t.held) if n > 0 and r != home]
    out = {home: (float(sum(n for _, n in others)), gathered.get(home, (0.0, 0.0))[1])}
    for r, n in others:
        out[r] = (gathered.get(r, (0.0, 0.0))[0], float(n))
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
    :meth:`CostModel.seconds` of :func:`task_traffic` rank for rank), so thousands of ranks plan in seconds.
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


def _home_seconds(t: MatrixTask, held: np.ndarray, home: int, cm: CostModel) -> np.ndarray:
    """:meth:`CostModel.seconds` of :func:`task_traffic` (``t`` homed at ``home``) per rank, dense; 0
    where the matrix touches no byte.  A home that holds it whole gathers nothing: each other holder
    gets its piece back (the DDP case, in closed form); otherwise :func:`task_traffic` itself."""
    world = len(held)
    if held[home] == t.numel:
        recv = held.astype(np.float64)
        recv[home] = 0.0
        sent = np.zeros(world)
        sent[home] = float(int(held.sum()) - int(held[home]))
    else:
        sent, recv = np.zeros(world), np.zeros(world)
        for r, (sn, rc) in task_traffic(t, home).items():
            sent[r], recv[r] = sn, rc
    flops = np.zeros(world)
    flops[home] = t.flops
    out = cm.seconds(flops, (sent + recv) * t.elem_bytes)
    touched = (sent + recv) > 0
    touched[home] = True
    return np.where(touched, out, 0.0)


def pair_traffic(t: MatrixTask, homes: Sequence[int]) -> Dict[Tuple[int, int], float]:
    """Elements from rank to rank for one matrix with one or more ``homes``, as the exchange
    moves them: every home collects what it lacks from the holders (:func:`gather_traffic`'s
    shares; with several homes and replica groups, from its own group: :func:`gather_source`),
    then every other holder ``d`` gets its piece back from :func:`scatter_source`."""
    out: Dict[Tuple[int, int], float] = defaultdict(float)
    holders = [(r, n) for r, n in enumerate(t.held) if n > 0]
    held = sum(n for _, n in holders)
    for h in homes:
        mine = t.held[h] if h < len(t.held) else 0
        missing = t.numel - mine
        own = replica_group_of(t.groups, h) if len(homes) > 1 else ()
        if missing and own:
            for r in own:
                if r != h and t.held[r]:
                    out[(r, h)] += t.held[r]
        elif missing and held - mine:
            for r, n in holders:
                if r != h:
                    out[(r, h)] += missing * n / (held - mine)
    for d, n in holders:
        if d not in homes:
            out[(scatter_source(homes, d, t.groups), d)] += n
    return out


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


def rank_seconds(t: MatrixTask, homes: Sequence[int], cm: CostModel) -> Dict[int, float]:
    """Seconds one matrix costs each rank it touches: NS at its homes, and every byte each rank
    sends or receives, inside a node or across nodes (:meth:`CostModel.link_seconds`)."""
    intra: Dict[int, float] = defaultdict(float)
    inter: Dict[int, float] = defaultdict(float)
    for (a, b), n in pair_traffic(t, homes).items():
        side = intra if cm.node(a) == cm.node(b) else inter
        side[a] += n * t.elem_bytes
        side[b] += n * t.elem_bytes
    ranks = set(homes) | set(intra) | set(inter)
    return {r: (t.flops / cm.flops_per_s if r in homes else 0.0) + cm.link_seconds(intra[r], inter[r])
            for r in ranks}


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


class _Costs:
    """:func:`rank_seconds` of each (matrix, homes) the search looks at, as a dense float64 vector
    over the ranks, computed once.  Values equal :func:`rank_seconds`'s, rank for rank; a rank the
    matrix does not touch is 0 (every rank it touches costs more than 0)."""

    def __init__(self, tasks: Sequence[MatrixTask], world: int, cm: CostModel):
        self.tasks, self.world, self.cm = tasks, world, cm
        self.held = [np.asarray(t.held, dtype=np.int64) for t in tasks]
        self.whole = [np.flatnonzero(h == t.numel) for h, t in zip(self.held, tasks)]
        self._seen: Dict[Tuple[int, Tuple[int, ...]], np.ndarray] = {}

    def __call__(self, i: int, homes: Tuple[int, ...]) -> np.ndarray:
        key = (i, homes)
        v = self._seen.get(key)
        if v is None:
            v = self._seen[key] = self._compute(i, homes)
        return v

    def _compute(self, i: int, homes: Tuple[int, ...]) -> np.ndarray:
        t, held, cm = self.tasks[i], self.held[i], self.cm
        out = np.zeros(self.world)
        if any(held[h] != t.numel for h in homes) or (t.groups and len(homes) > 1):
            for r, v in rank_seconds(t, homes, cm).items():  # gathers or replica groups: the general path
                out[r] = v
            return out
        # every home holds it whole (DDP): no gather; holder d gets its copy from homes[d % len(homes)]
        at = np.asarray(homes, dtype=np.int64)
        d = np.flatnonzero(held)
        d = d[~np.isin(d, at)]
        src = at[d % len(at)]
        n = held[d].astype(np.float64) * t.elem_bytes
        same = (src // cm.ranks_per_node == d // cm.ranks_per_node) if cm.ranks_per_node else np.ones(len(d), bool)
        intra, inter = np.zeros(self.world), np.zeros(self.world)
        for side, sel in ((intra, same), (inter, ~same)):
            side += np.bincount(src[sel], weights=n[sel], minlength=self.world)
            side[d[sel]] += n[sel]
        is_home = np.zeros(self.world, bool)
        is_home[at] = True
        out = np.where(is_home, t.flops / cm.flops_per_s, 0.0) + cm.link_seconds(intra, inter)
        touched = is_home | (intra > 0) | (inter > 0)
        out[~touched] = 0.0
        return out


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


# -- team NS: one matrix on several ranks (ds_muon.engine.plan.team) ------------------------------------------
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
    one home (:func:`rank_seconds`), kept when every rank it touches ends below the slowest rank's
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
