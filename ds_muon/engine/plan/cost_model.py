"""The planner's cost model: what one matrix at given homes costs each rank, in seconds.

:class:`CostModel` turns FLOPs and bytes into seconds: rank r spends ``ns_flops(r) / flops_per_s`` on
Newton–Schulz plus ``(bytes_in(r) + bytes_out(r)) / bytes_per_s`` on the two exchanges (with
``ranks_per_node``, bytes inside a node and across nodes at their own rates: :func:`rank_seconds`).
:class:`MatrixTask` is what a planner knows of one matrix, :class:`Plan` one home per matrix with what it
costs; the traffic functions count the elements each rank sends and receives as the exchange moves them,
and :class:`_Costs` caches a (matrix, homes) cost as a dense vector over the ranks.  Home planning
(:mod:`.planner`), team planning (:mod:`.team_plan`) and ``ds-muon plan`` (:mod:`.costs`) all cost with these.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...rules.newton_schulz import ns_flops
from ..exchange.routes import replica_group_of, scatter_source

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
    groups: Tuple[Tuple[int, ...], ...] = ()  # replica groups (HSDP): :func:`~ds_muon.engine.exchange.routes.replica_groups`

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
    shares; with several homes and replica groups, from its own group: :func:`~ds_muon.engine.exchange.routes.gather_source`),
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
