"""What each way of placing Newton–Schulz costs a step on a 2-D mesh: ``ds-muon plan --mesh``.

HSDP ``replicate=R,shard=S`` and FSDP x TP ``dp=D,tp=T`` (:func:`mesh_rows`), with bytes split inside /
across nodes (:meth:`CostModel.link_seconds <ds_muon.engine.plan.cost_model.CostModel.link_seconds>`): today's
per-replica plan, each NS once in the world, the per-matrix choice between them, and the
baselines.  These rows are analytic (equal pieces, LPT); the ``auto`` row is the optimizer's own plan
(:func:`planned_mesh_cost`) on the same holdings and replica groups the optimizer would see.
The world-size table (one flat group of ranks) is :mod:`.costs`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..exchange.routes import replica_groups
from .cost_model import CostModel, MatrixTask, pair_traffic
from .planner import plan_multi_homes

MESH_STRATEGIES = ("per_replica", "one_home", "hierarchical", "auto", "duplicated", "deepspeed_owner")


@dataclass
class MeshCost:
    """One strategy on a mesh, per rank: NS FLOPs and bytes moved inside / across nodes."""

    strategy: str
    ns_flops: List[float]
    intra: List[float]
    inter: List[float]
    cm: CostModel
    note: str = ""

    def step_seconds(self) -> float:
        """The slowest rank's NS plus its bytes inside and across nodes."""
        return max(f / self.cm.flops_per_s + self.cm.link_seconds(a, b)
                   for f, a, b in zip(self.ns_flops, self.intra, self.inter))

    def row(self, mesh: str, n_matrices: int) -> Dict[str, object]:
        return {"mesh": mesh, "strategy": self.strategy, "matrices": n_matrices,
                "ns_tflop_per_rank": round(max(self.ns_flops) / 1e12, 3),
                "ns_ms": round(max(self.ns_flops) / self.cm.flops_per_s * 1e3, 3),
                "max_intra_node_MB": round(max(self.intra) / 1e6, 1),
                "max_inter_node_MB": round(max(self.inter) / 1e6, 1),
                "modelled_step_ms": round(self.step_seconds() * 1e3, 3), "note": self.note}


def parse_mesh(spec: str) -> Tuple[str, int, int]:
    """``replicate=R,shard=S`` (HSDP) or ``dp=D,tp=T`` (FSDP x tensor parallel): (kind, outer, inner)."""
    try:
        dims = {k.strip(): int(v) for k, v in (p.split("=") for p in spec.split(","))}
    except ValueError:
        raise ValueError(f"--mesh {spec!r}: write it as replicate=R,shard=S or dp=D,tp=T") from None
    for kind, (outer, inner) in (("hsdp", ("replicate", "shard")), ("tp", ("dp", "tp"))):
        if set(dims) == {outer, inner}:
            if dims[outer] < 1 or dims[inner] < 1:
                raise ValueError(f"--mesh {spec!r}: every dimension must be >= 1")
            return kind, dims[outer], dims[inner]
    raise ValueError(f"--mesh {spec!r}: dimensions {sorted(dims)} are not supported; "
                     "use replicate=R,shard=S or dp=D,tp=T")


def _lpt(weights: Sequence[float], bins: int, start: Optional[List[float]] = None) -> Tuple[List[int], List[float]]:
    """Longest-processing-time assignment of ``weights`` to ``bins`` (deterministic)."""
    load = list(start) if start is not None else [0.0] * bins
    heap = [(v, b) for b, v in enumerate(load)]
    heapq.heapify(heap)
    out = [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        v, b = heapq.heappop(heap)
        out[i] = b
        load[b] = v + weights[i]
        heapq.heappush(heap, (load[b], b))
    return out, load


def dedupe_pays(t: MatrixTask, cm: CostModel) -> bool:
    """Orthogonalize a replicated matrix once in the world (and send results across nodes) rather
    than once per replica group: per rank, both sides scale with (1 - 1/R) / S, so it pays when
    NS FLOPs per element beat the two inter-node bytes per element (piece out, result in)."""
    return t.flops / t.numel / cm.flops_per_s > 2 * t.elem_bytes / cm.bytes_per_s


def hsdp_cost(tasks: Sequence[MatrixTask], replicas: int, shards: int, strategy: str, cm: CostModel) -> MeshCost:
    """HSDP: each matrix in ``shards`` equal pieces over consecutive ranks, replicated ``replicas`` times.

    ``per_replica`` is today's plan (homes inside each shard group, NS run once per replica);
    ``one_home`` runs every NS once in the world, the home's group peers forwarding their result
    pieces to the same shard of every other replica (a two-level fan-out); ``hierarchical`` picks
    per matrix by :func:`dedupe_pays` (or all-once / all-per-replica where the model finds either
    faster, since per-rank maxima are not additive); ``duplicated`` / ``deepspeed_owner`` gather every matrix at
    every rank of a group (DeepSpeed's rule when every rank holds a piece of every matrix)."""
    if strategy == "hierarchical":  # the cost model's per-matrix pick, or all-once / all-per-replica if faster
        picks = [_hsdp_cost(tasks, replicas, shards, s, cm) for s in ("hierarchical", "one_home", "per_replica")]
        best = min(picks, key=lambda c: c.step_seconds())
        once = sum(dedupe_pays(t, cm) for t in tasks) if best is picks[0] else (len(tasks) if best is picks[1] else 0)
        return MeshCost("hierarchical", best.ns_flops, best.intra, best.inter, cm,
                        f"{once} of {len(tasks)} once in the world")
    return _hsdp_cost(tasks, replicas, shards, strategy, cm)


def _hsdp_cost(tasks: Sequence[MatrixTask], replicas: int, shards: int, strategy: str, cm: CostModel) -> MeshCost:
    R, S, W = replicas, shards, replicas * shards
    rpn = cm.ranks_per_node or W
    same_node = (min(S, rpn) - 1) / (S - 1) if S > 1 else 1.0  # share of a rank's group peers on its node
    ns, intra, inter = [0.0] * W, [0.0] * W, [0.0] * W
    group_intra = [0.0] * S  # per shard index, the same in every replica group
    group_inter = [0.0] * S

    if strategy in ("duplicated", "deepspeed_owner"):
        for t in tasks:
            b = t.numel * t.elem_bytes * (S - 1) / S * 2  # receive the rest, send your piece to S-1
            for s in range(S):
                group_intra[s] += b * same_node
                group_inter[s] += b * (1 - same_node)
        total = sum(t.flops for t in tasks)
        ns = [total] * W
    else:
        once = [strategy == "one_home" or (strategy == "hierarchical" and dedupe_pays(t, cm)) for t in tasks]
        local = [i for i, o in enumerate(once) if not o]
        slots, slot_load = _lpt([tasks[i].flops for i in local], S)
        for i, s in zip(local, slots):
            t = tasks[i]
            piece = t.numel * t.elem_bytes / S
            for k in range(S):  # gather to the home, scatter back: 2 pieces per peer, all at the home
                b = 2 * piece * (S - 1) if k == s else 2 * piece
                group_intra[k] += b * same_node
                group_inter[k] += b * (1 - same_node)
        ns = [slot_load[r % S] for r in range(W)]
        glob = [i for i, o in enumerate(once) if o]
        ranks, _ = _lpt([tasks[i].flops for i in glob], W, ns)
        everyone_inter = 0.0
        for i, h in zip(glob, ranks):
            t = tasks[i]
            ns[h] += t.flops
            piece = t.numel * t.elem_bytes / S
            g0 = (h // S) * S
            for r in range(g0, g0 + S):  # inside the home's group: gather + scatter as above
                b = 2 * piece * (S - 1) if r == h else 2 * piece
                intra[r] += b * same_node
                inter[r] += b * (1 - same_node) + piece * (R - 1) - piece  # forward to R-1 replicas
            everyone_inter += piece  # every other replica's rank receives its piece
        inter = [v + everyone_inter for v in inter]
    intra = [v + group_intra[r % S] for r, v in enumerate(intra)]
    inter = [v + group_inter[r % S] for r, v in enumerate(inter)]
    notes = {"per_replica": f"today: NS {R}x duplicated", "deepspeed_owner": "every holder gathers + NS",
             "one_home": "every NS once in the world"}
    return MeshCost(strategy, ns, intra, inter, cm, notes.get(strategy, ""))


def tp_cost(tasks: Sequence[MatrixTask], dp: int, tp: int, strategy: str, cm: CostModel) -> MeshCost:
    """FSDP x TP: each matrix in ``dp * tp`` equal pieces, TP ranks consecutive (inside a node).

    ``one_home`` gathers each matrix at one rank (LPT over the world) and scatters it back;
    ``duplicated`` / ``deepspeed_owner`` gather every matrix everywhere.  Today ds_muon refuses TP
    placements (``per_replica`` row: not available)."""
    W = dp * tp
    rpn = cm.ranks_per_node or W
    share = (rpn - 1) / (W - 1) if W > 1 else 1.0  # share of a rank's peers on its node
    if strategy == "per_replica":
        return MeshCost(strategy, [float("nan")] * W, [float("nan")] * W, [float("nan")] * W, cm,
                        "today: TP placements refused (NotImplementedError)")
    if strategy == "hierarchical":
        strategy_used = "one_home"  # no replicas: nothing to dedupe, one home is the plan
    else:
        strategy_used = strategy
    ns, intra, inter = [0.0] * W, [0.0] * W, [0.0] * W
    if strategy_used in ("duplicated", "deepspeed_owner"):
        ns = [sum(t.flops for t in tasks)] * W
        for r in range(W):
            b = sum(2 * t.numel * t.elem_bytes * (W - 1) / W for t in tasks)
            intra[r], inter[r] = b * share, b * (1 - share)
    else:
        homes, ns = _lpt([t.flops for t in tasks], W)
        each = 0.0
        for t, h in zip(tasks, homes):
            piece = t.numel * t.elem_bytes / W
            each += 2 * piece
            extra = 2 * piece * (W - 1) - 2 * piece
            intra[h] += extra * share
            inter[h] += extra * (1 - share)
        intra = [v + each * share for v in intra]
        inter = [v + each * (1 - share) for v in inter]
    note = "no replicas: one home per matrix" if strategy == "hierarchical" else (
        "every holder gathers + NS" if strategy == "deepspeed_owner" else "")
    return MeshCost(strategy, ns, intra, inter, cm, note)


def mesh_tasks(shapes: Sequence[Tuple[int, int]], kind: str, outer: int, inner: int, steps: int = 5,
               elem_bytes: int = 2) -> List[MatrixTask]:
    """The optimizer's planner input on a mesh (as :func:`ds_muon.engine.plan.compile.planner_task` builds it): rank
    ``o * inner + k`` (row-major, torch's ``init_device_mesh`` order) holds piece ``k`` of ``inner`` near-equal
    pieces (HSDP: replicated over ``outer`` groups, with :func:`~ds_muon.engine.exchange.routes.replica_groups`), or piece
    ``o * inner + k`` of ``outer * inner`` (FSDP x TP: every rank its own piece, no replicas)."""
    world = outer * inner
    out = []
    for r, c in shapes:
        n = r * c
        if kind == "hsdp":
            piece = [n // inner + (k < n % inner) for k in range(inner)]
            held = tuple(piece[q % inner] for q in range(world))
            groups = replica_groups([[o * inner + k for o in range(outer)] for k in range(inner)])
        else:
            held, groups = tuple(n // world + (q < n % world) for q in range(world)), ()
        out.append(MatrixTask(r, c, steps, elem_bytes, held, groups=groups))
    return out


def planned_mesh_cost(tasks: Sequence[MatrixTask], world: int, cm: CostModel) -> MeshCost:
    """The optimizer's own plan (``planner="auto"``, :func:`~ds_muon.engine.plan.planner.plan_multi_homes`) on
    :func:`mesh_tasks`, its bytes counted as the exchange moves them (:func:`~ds_muon.engine.plan.cost_model.pair_traffic`)."""
    homes = plan_multi_homes(tasks, world, cm, "auto")
    ns, intra, inter = [0.0] * world, [0.0] * world, [0.0] * world
    for t, hs in zip(tasks, homes):
        for h in hs:
            ns[h] += t.flops
        for (a, b), n in pair_traffic(t, hs).items():
            side = intra if cm.node(a) == cm.node(b) else inter
            side[a] += n * t.elem_bytes
            side[b] += n * t.elem_bytes
    per_group = sum(len(hs) > 1 for hs in homes)
    return MeshCost("auto", ns, intra, inter, cm, f"the optimizer's plan: {per_group} of {len(tasks)} with several homes")


def mesh_rows(shapes: Sequence[Tuple[int, int]], spec: str, cm: CostModel, steps: int = 5, elem_bytes: int = 2,
              strategies: Sequence[str] = MESH_STRATEGIES) -> List[Dict[str, object]]:
    """One row per strategy on the mesh ``spec`` (:func:`parse_mesh`)."""
    kind, outer, inner = parse_mesh(spec)
    tasks = [MatrixTask(r, c, steps, elem_bytes) for r, c in shapes]
    fn = hsdp_cost if kind == "hsdp" else tp_cost
    rows = []
    for s in strategies:
        if s == "auto":  # the optimizer's planner on what each rank holds, replica groups included
            cost = planned_mesh_cost(mesh_tasks(shapes, kind, outer, inner, steps, elem_bytes), outer * inner, cm)
        else:
            cost = fn(tasks, outer, inner, s, cm)
        rows.append(cost.row(spec, len(tasks)))
    return rows
