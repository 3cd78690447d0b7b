"""``Muon.summary()``: what the optimizer does with each tensor, and what a step costs each rank.

Every column is read from the optimizer's own decisions, none re-derived from shapes:

* Muon or AdamW: the tensor's param group (``use_muon``); *why*: the reason
  :func:`ds_muon.muon_param_groups` recorded when it decided (``param_reasons``,
  from :func:`ds_muon.models.selection.param_reasons`), else ``"user group"``;
* matrices: the logical matrices of the layouts the optimizer binds (split row
  blocks, one per expert, the global matrix of a tensor-parallel shard), each with
  the scale factor its update gets (:func:`~ds_muon.rules.scaling.get_muon_scale_factor`
  of its group, read ``[out, in]`` for a transposed weight, as the step applies it);
* home ranks and bytes: the exchanges :func:`~ds_muon.engine.plan.compile.compile_exchanges`
  builds for a step in which every matrix steps (the plan the optimizer compiles
  and reuses while the same tensors have gradients); NS FLOPs:
  :func:`~ds_muon.rules.newton_schulz.ns_flops` of the matrices homed at each rank.

Every rank holds the global layout, so every rank computes every rank's columns
itself: ``str(opt.summary())`` on rank 0 shows the whole picture, with no
collective once the optimizer is bound.  Before the first step, ``summary()``
binds the tensors (the same, collective, binding the first step would do), so call
it on every rank then; afterwards it may be called on any rank alone.

A rank knows the layouts of the process groups it is in: with expert domains
smaller than the world, its rank columns count only those (the summary says so).

Under DeepSpeed the optimizer steps flat partitions, one param group (ZeRO-3:
sub-group) per ``step()`` call: rows are the original tensors the groups name,
matrices come from every partition bound so far, and ZeRO-3, which hands them
over only inside ``step()``, is fully described after the first step (the summary
says so before it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from ...rules.newton_schulz import ns_flops
from ...rules.scaling import get_muon_scale_factor
from ..plan.compile import compile_exchanges, ns_settings, planner_task
from ..exchange.all_to_all import Exchange
from ..exchange.layout import Layout, global_shape
from ..plan.planner import team_member_flops, team_widths
from .summary_file import summary_from_dict

logger = logging.getLogger("ds_muon")
USER_GROUP = "user group"  # the reason of tensors in groups that recorded none (built by hand)
MB = 1e6


@dataclass(frozen=True)
class MatrixRow:
    """One logical matrix Newton–Schulz orthogonalizes."""

    key: str  # e.g. "...experts.gate_up_proj[3][gate]": tensor name, then expert and block
    shape: Tuple[int, int]  # the 2-D matrix NS sees (rows, cols)
    scale: float  # the update's scale factor
    homes: Tuple[int, ...]  # global ranks that run its NS (every rank in mode="duplicated")
    ns_flops: float  # of one NS run
    held: Tuple[int, ...]  # elements each rank of its domain holds (the planner's input)
    domain: int  # index of its layout (one per process group; MoE expert domains have their own)
    ns_steps: int
    ns_method: str
    wire_bytes: int  # bytes per element of its gather
    groups: Tuple[Tuple[int, ...], ...] = ()  # replica groups of its domain (HSDP; the planner's input too)
    team: int = 0  # team size when a team of ranks (``homes``) runs its NS in column blocks (ds_muon.engine.plan.team), else 0


@dataclass(frozen=True)
class TensorRow:
    """One tensor of ``param_groups``."""

    name: str
    group: int  # index in param_groups
    algorithm: str  # "Muon", "AdamW", or "Muon+AdamW" (an FSDP1 flat shard holding both)
    reason: str
    shape: Tuple[int, ...]  # as the optimizer sees it (a ZeRO/FSDP1 flat shard is 1-D)
    matrices: Tuple[MatrixRow, ...] = ()


@dataclass(frozen=True)
class RankRow:
    """What one optimizer step costs one rank."""

    rank: int  # global rank
    matrices: int  # NS runs at this rank
    ns_flops: float
    bytes_sent: int  # gather and scatter together, per step
    bytes_received: int

    @property
    def bytes_moved(self) -> int:
        return self.bytes_sent + self.bytes_received


@dataclass
class Summary:
    """:meth:`ds_muon.Muon.summary`: rows per tensor (with their matrices) and per rank; ``str()`` is a table."""

    tensors: List[TensorRow]
    ranks: List[RankRow]
    world_size: int
    rank: int
    mode: str
    planner: str
    waves: int
    domains: int = 1
    notes: List[str] = field(default_factory=list)
    cost_model: Optional[dict] = None  # the rates the optimizer planned with (CostModel fields)
    qk_clip: Optional[dict] = None  # QK-clip: tau, alpha, steps, heads clipped (last step, total), last S_max per head

    # -- counts ------------------------------------------------------------------
    @property
    def muon_tensors(self) -> int:
        return sum(t.algorithm != "AdamW" for t in self.tensors)

    @property
    def adamw_tensors(self) -> int:
        return sum(t.algorithm == "AdamW" for t in self.tensors)

    @property
    def matrices(self) -> List[MatrixRow]:
        return [m for t in self.tensors for m in t.matrices]

    def max_ns_gflop(self) -> float:
        return max((r.ns_flops for r in self.ranks), default=0.0) / 1e9

    def max_mb_moved(self) -> float:
        return max((r.bytes_moved for r in self.ranks), default=0) / MB

    def log_line(self) -> str:
        return (f"ds_muon: {self.muon_tensors} tensors Muon ({len(self.matrices)} matrices), {self.adamw_tensors} "
                f"AdamW; per step, busiest rank: NS {self.max_ns_gflop():.4g} GFLOP, {self.max_mb_moved():.4g} MB "
                f"moved (sent + received); world {self.world_size}, mode {self.mode}, planner {self.planner} "
                "(Muon.summary() prints the table; log_summary=False turns this line off)")

    # -- the planner's table -------------------------------------------------------
    def plan_rows(self, strategies: Optional[Sequence[str]] = None, cost_model=None) -> List[dict]:
        """The ``ds-muon plan`` table (:func:`ds_muon.engine.plan.costs.compare`) for this run's own matrices and
        holdings: the optimizer's strategy next to the baselines, on what each rank really holds, at
        the rates the optimizer planned with (unless ``cost_model`` is given)."""
        from ..plan import costs
        from ..plan.planner import CostModel, MatrixTask

        rows = self.matrices
        if len({m.domain for m in rows}) > 1:
            raise ValueError("Summary.plan_rows: this optimizer plans in several domains (process groups); the "
                             "planner's table compares one domain at a time")
        if not rows:
            return []
        tasks = [MatrixTask(m.shape[0], m.shape[1], m.ns_steps, m.wire_bytes, m.held, m.ns_method, m.groups)
                 for m in rows]  # the optimizer's planner input (compile_exchanges), replica groups included
        if cost_model is None:
            cost_model = CostModel(**self.cost_model) if self.cost_model else CostModel()
        return costs.compare(tasks, len(rows[0].held), cost_model,
                             costs.STRATEGIES if strategies is None else strategies)

    # -- saved for ``ds-muon plan --summary`` ------------------------------------------
    def save(self, path: str) -> None:
        """Write the summary as JSON (``ds-muon plan --summary PATH`` reads it)."""
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Summary":
        """The summary :meth:`save` wrote; a file that is not one (edited, crafted, truncated) raises
        ValueError naming the field (:mod:`ds_muon.engine.report.summary_file`)."""
        with open(path) as f:
            try:
                d = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"Summary file {path!r} is not JSON: {e}") from None
        try:
            return summary_from_dict(d, cls, TensorRow, MatrixRow, RankRow)
        except ValueError as e:
            raise ValueError(f"{path!r}: {e}") from None

    # -- the table -------------------------------------------------------------------
    def __str__(self) -> str:
        head = (f"ds_muon.Muon summary: {self.muon_tensors} tensors Muon ({len(self.matrices)} matrices), "
                f"{self.adamw_tensors} AdamW; world {self.world_size} (computed on rank {self.rank}), mode "
                f"{self.mode}, planner {self.planner}, {self.waves} wave(s)"
                + (f", {self.domains} domains" if self.domains > 1 else ""))
        table = [("tensor", "algo", "why", "shape", "matrix", "rows x cols", "scale", "home")]
        for t in self.tensors:
            shape = "x".join(map(str, t.shape))
            single = len(t.matrices) == 1 and t.matrices[0].key == t.name
            first = t.matrices[0] if single else None
            table.append((t.name, t.algorithm, t.reason, shape, *(_matrix_cells(first, t.name) if first else
                          ("", "", "", "") if not t.matrices else (f"{len(t.matrices)} matrices:", "", "", ""))))
            if not single:
                table.extend(("", "", "", "", *_matrix_cells(m, t.name)) for m in t.matrices)
        ranks = [("rank", "NS matrices", "NS GFLOP", "sent", "received")]
        ranks += [(str(r.rank), str(r.matrices), f"{r.ns_flops / 1e9:.4g}", _bytes(r.bytes_sent),
                   _bytes(r.bytes_received)) for r in self.ranks] or [("all", PLANNED, "", "", "")]
        out = [head, _format(table), "", "per rank, per step:", _format(ranks)]
        if self.qk_clip is not None:
            out += ["", _qk_clip_lines(self.qk_clip)]
        return "\n".join(out + self.notes)


def _qk_clip_lines(q: dict) -> str:
    """QK-clip's settings, how many heads it clipped and each attention module's last S_max per head."""
    lines = [f"QK-clip (tau {q['tau']:g}, alpha {q['alpha']:g}): {q['clipped_heads']} head(s) clipped in the last "
             f"step, {q['clipped_total']} over {q['steps']} step(s); last S_max per head:"]
    table = [("attention", "S_max per head")]
    table += [(name, " ".join(f"{x:.4g}" for x in s)) for name, s in q["s_max"].items()]
    return "\n".join(lines + ([_format(table)] if q["s_max"] else ["(no step yet)"]))


def _matrix_cells(m: MatrixRow, name: str) -> Tuple[str, str, str, str]:
    key = m.key[len(name):] if m.key.startswith(name) and m.key != name else m.key
    # several homes: mode="duplicated" (every rank) or planner="auto"'s extra homes (some ranks)
    homes = ",".join(map(str, m.homes)) if len(m.homes) <= 4 else f"{len(m.homes)} ranks"
    if not m.homes:
        homes = PLANNED  # summarize_planned: one rank alone before the first step
    if m.team:
        homes = f"team of {m.team}: {homes}"
    return (key if key != name else "", f"{m.shape[0]} x {m.shape[1]}", f"{m.scale:.4g}", homes)


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"


def _format(rows: List[tuple]) -> str:
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


# -- building one -------------------------------------------------------------------
def update_scale(group: dict, shape: Tuple[int, int], transposed: bool) -> float:
    """The scale factor the update of a ``shape`` matrix of ``group`` gets (as
    :func:`ds_muon.rules.update.apply_coefficients` applies it: a weight stored ``[in, out]`` reads ``[out, in]``)."""
    rows, cols = (shape[1], shape[0]) if transposed else shape
    return get_muon_scale_factor(rows, cols, group["scale_mode"], group["extra_scale_factor"])


def _global_ranks(layout: Layout) -> List[int]:
    if layout.group is None or not (dist.is_available() and dist.is_initialized()):
        return list(range(layout.world_size))
    return [dist.get_global_rank(layout.group, r) for r in range(layout.world_size)]


def _as_rank(ex: Exchange, rank: int) -> Exchange:
    """The same exchange as rank ``rank`` compiles it (every rank knows the whole plan): for its bytes.
    (Which matrices share one batched NS call at a home, ``stack_key``, changes no byte.)"""
    if rank == ex.rank:
        return ex
    if hasattr(ex, "for_rank"):  # a TeamExchange
        return ex.for_rank(rank)
    return Exchange(dataclasses.replace(ex.layout, rank=rank), ex.active, ex.homes, {i: 0 for i in ex.active},
                    ex.gather_dtype, ex.scatter_dtype, ex.device, ex.group)


def _mixed(p, binding) -> bool:
    """Does the tensor hold AdamW elements besides its matrices, on any rank?  (An FSDP1
    FlatParameter: its originals' sizes, ``_numels``, are known on every rank.)"""
    numels = getattr(p, "_numels", None)
    if numels is None:
        return bool(binding.adam_ranges)
    return sum(numels) > sum(math.prod(s.shape) for s in binding.matrices)


def _bound_sets(opt) -> List[tuple]:
    """The ``(bindings, layouts)`` a step uses: the current ones, and under DeepSpeed (which hands
    the optimizer one param group or ZeRO-3 sub-group at a time, as fixed flat partitions) every
    set bound so far."""
    runtime = opt.runtime
    runtime.resolve()
    if opt.adapter.applies_in_step:
        return [s for s in runtime.resolved.values()]
    return [(runtime.bindings, runtime.layouts)]


def _base(key: str) -> str:
    """The tensor name of a matrix key (``name[expert][block]`` -> ``name``)."""
    return key.split("[", 1)[0]


def _groups_of(groups: List[dict], bindings) -> Dict[int, dict]:
    """Each bound tensor's Muon param group; a DeepSpeed partition no longer in ``param_groups``
    (ZeRO-3 empties them between calls) by the group that names its matrices."""
    current = {id(p): g for g in groups if g["use_muon"] for p in g["params"]}
    by_name = {n: g for g in groups if g["use_muon"] for n in g.get("param_names") or []}
    out = {}
    for pid, b in bindings.items():
        g = current.get(pid)
        if g is None and b.matrices:
            g = by_name.get(_base(b.matrices[0].key))
        if g is None:
            raise RuntimeError(f"ds_muon: Muon.summary(): no param group holds the tensor of matrix "
                               f"{b.matrices[0].key if b.matrices else '?'}; call it after the first step")
        out[pid] = g
    return out


def summarize(opt, groups: Optional[List[dict]] = None, sets: Optional[List[tuple]] = None) -> Summary:
    """:meth:`ds_muon.Muon.summary` (see the module docstring).  ``groups``: the param groups to
    describe (default ``opt.param_groups``; DeepSpeed narrows those to one group per ``step()`` call);
    ``sets``: the ``(bindings, layouts)`` to describe (default: bound now, see :func:`_bound_sets`)."""
    groups = opt.param_groups if groups is None else groups
    by_key: Dict[str, MatrixRow] = {}
    flops, homed = defaultdict(float), defaultdict(int)
    sent, received = defaultdict(int), defaultdict(int)
    bindings: Dict[int, object] = {}
    domains = 0
    sets = _bound_sets(opt) if sets is None else sets
    for bound, layouts in sets:
        bindings.update(bound)
        group_of = _groups_of(groups, bound)
        for layout in (lay for lay in layouts if lay.matrices):
            d, domains = domains, domains + 1
            ranks = _global_ranks(layout)
            for ex, _ in compile_exchanges(layout, list(range(len(layout.matrices))), group_of, mode=opt.mode,
                                           planner=opt.planner, cost_model=opt.planning_cost_model(),
                                           comm_dtype=opt.comm_dtype, waves=opt.waves,
                                           team_ns=getattr(opt, "team_ns", False)):
                for r in range(layout.world_size):
                    them = _as_rank(ex, r)
                    sent[ranks[r]] += them.bytes_sent
                    received[ranks[r]] += them.bytes_received
                for i in ex.active:
                    info = layout.matrices[i]
                    b, slot = layout.local[i]
                    g = group_of[id(b.param)]
                    ns = ns_settings(g)
                    cost = ns_flops(info.rows, info.cols, ns.steps, ns.method)
                    at = tuple(ranks[h] for h in ex.homes[i])
                    team = len(at) if hasattr(ex, "teams") else 0
                    widths = team_widths(info.rows, info.cols, team) if team else ()
                    for k, h in enumerate(at):
                        flops[h] += (team_member_flops(min(info.rows, info.cols), widths[k], ns.steps) if team
                                     else cost)
                        homed[h] += 1
                    task = planner_task(layout, i, ns, ex.gather_dtype.itemsize)  # what the optimizer planned on
                    by_key[info.key] = MatrixRow(
                        info.key, (info.rows, info.cols), update_scale(g, (info.rows, info.cols), slot.transposed),
                        at, cost, task.held, d, ns.steps, ns.method, task.elem_bytes, task.groups, team)
    tensors = _tensor_rows(opt, groups, bindings, by_key)
    all_ranks = sorted(set(sent) | set(flops)) or [_this_rank()]
    rank_rows = [RankRow(r, homed[r], flops[r], sent[r], received[r]) for r in all_ranks]
    notes = []
    teamed = [m for m in by_key.values() if m.team]
    if teamed:
        notes.append(f"Team NS (planner auto, team_ns=True): {len(teamed)} matrices run as teams of ranks, each "
                     "member orthogonalizing a column block (not bitwise equal to one process): " + ", ".join(
                         f"{m.key} ({m.shape[0]}x{m.shape[1]}) on {m.team}" for m in teamed[:8])
                     + (", ..." if len(teamed) > 8 else "") + ".")
    if by_key:
        notes.append("Homes and bytes are those of a step in which every Muon matrix has a gradient; a step where "
                     "some have none plans (and compiles) its own.")
    if any(lay.world_size < _world() for _, layouts in sets for lay in layouts if lay.matrices):
        notes.append(f"Some matrices live in process groups smaller than the world (expert domains): rank "
                     f"columns count the domains rank {_this_rank()} belongs to; other domains' work is in their "
                     "ranks' own summary().")
    if _zero3_before_step(groups, by_key):
        notes.append(ZERO3_NOTE)
    clip = getattr(opt, "qk_clip", None)  # ds_muon.QKClip: what it did at the last step
    return Summary(tensors, rank_rows, _world(), _this_rank(), opt.mode, opt.planner, opt.waves, max(1, domains),
                   notes, dataclasses.asdict(opt.planning_cost_model()), clip.report() if clip is not None else None)


ZERO3_NOTE = ("DeepSpeed ZeRO-3 hands the optimizer its partitions only inside step(): matrices, homes and "
              "bytes are known after the first step.")
PLANNED = "planned at the first step"


def _zero3_before_step(groups: List[dict], by_key) -> bool:
    return any(g["use_muon"] and g.get("param_names") and not g["params"] for g in groups) and not by_key


def summarize_planned(opt, bind) -> Summary:
    """The summary one rank can give alone before the first step of a multi-rank run: placing every rank's
    pieces (the layouts, and so the homes and each rank's costs) is a collective, but each tensor's matrices,
    shapes, scale factors and NS cost follow from this rank's own metadata (``bind()``: the optimizer's
    local binding).  Homes and the per-rank table read "planned at the first step"."""
    groups = opt.param_groups
    try:
        bindings = bind()
    except Exception as e:  # noqa: BLE001 - a stack that binds only inside step(): rows without matrices
        bindings, failed = {}, f"{type(e).__name__}: {e}"
    else:
        failed = None
    by_key: Dict[str, MatrixRow] = {}
    for g in groups:
        if not g["use_muon"]:
            continue
        ns = ns_settings(g)
        for p in g["params"]:
            b = bindings.get(id(p))
            for s in (b.matrices if b is not None else ()):
                rows, cols = s.matrix_shape
                if rows * cols:
                    by_key[s.key] = MatrixRow(s.key, (rows, cols), update_scale(g, (rows, cols), s.transposed), (),
                                              ns_flops(rows, cols, ns.steps, ns.method), (), 0, ns.steps, ns.method, 0)
    notes = [f"Before the first step, on rank {_this_rank()} alone: homes, team NS and the per-rank NS FLOPs and "
             f"bytes are {PLANNED} (placing every rank's pieces is a collective). summary() after the first "
             "step, or summary(all_ranks=True) called on every rank now, gives the exact plan."]
    if failed:
        notes.append(f"The tensors bind only inside step() on this stack ({failed[:200]}): matrices are "
                     f"{PLANNED} too.")
    if _zero3_before_step(groups, by_key):
        notes.append(ZERO3_NOTE)
    clip = getattr(opt, "qk_clip", None)
    return Summary(_tensor_rows(opt, groups, bindings, by_key), [], _world(), _this_rank(), opt.mode, opt.planner,
                   opt.waves, 1, notes, dataclasses.asdict(opt.planning_cost_model()),
                   clip.report() if clip is not None else None)


def _tensor_rows(opt, groups: List[dict], bindings, by_key: Dict[str, MatrixRow]) -> List[TensorRow]:
    """One row per tensor of ``param_groups``; a group of flat partitions that names more tensors
    than it holds (DeepSpeed ZeRO) gets one row per named original, with the matrices keyed by it."""
    shapes = {n: tuple(global_shape(p)) for p, n in (getattr(opt.adapter, "names", None) or {}).items()}
    by_name: Dict[str, List[MatrixRow]] = defaultdict(list)
    for key, m in by_key.items():
        by_name[_base(key)].append(m)
    rows = []
    for gi, g in enumerate(groups):
        names = g.get("param_names") or []
        originals = bool(names) and len(names) != len(g["params"])
        count = len(names) if originals else len(g["params"])
        reasons = g.get("param_reasons")
        reasons = reasons if reasons and len(reasons) == count else None
        algo = "Muon" if g["use_muon"] else "AdamW"
        for k in range(count):
            why = reasons[k] if reasons else USER_GROUP
            if originals:
                mats = tuple(by_name.get(names[k], ())) if g["use_muon"] else ()
                rows.append(TensorRow(names[k], gi, algo, why, shapes.get(names[k], ()), mats))
                continue
            p, mats = g["params"][k], ()
            b = bindings.get(id(p)) if g["use_muon"] else None
            if b is not None:
                mats = tuple(by_key[s.key] for s in b.matrices if s.key in by_key)
                algo = "Muon+AdamW" if _mixed(p, b) else "Muon"
            name = names[k] if names else f"param_groups[{gi}]['params'][{k}]"
            rows.append(TensorRow(name, gi, algo, why, tuple(global_shape(p)), mats))
    return rows


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _this_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_first_step(opt) -> bool:
    """The one-time INFO line (logger ``"ds_muon"``) after the first step, on global rank 0 only; computed
    only when that logger shows INFO (the step has bound and planned everything: no collective here).
    Under DeepSpeed, which calls ``step()`` once per param group or ZeRO-3 sub-group, it waits for the
    first set of tensors to come back (every set has been bound).  Returns whether it is done."""
    if _this_rank() != 0 or not logger.isEnabledFor(logging.INFO):
        return True
    groups = None
    if opt.adapter.applies_in_step:
        runtime = opt.runtime
        if runtime.summary_seen is None:
            runtime.summary_seen = (set(), {})
        seen, groups = runtime.summary_seen
        for g in opt.param_groups:  # DeepSpeed narrows param_groups to the group it steps; same dicts
            groups.setdefault(id(g), g)
        if runtime.signature not in seen:
            seen.add(runtime.signature)
            return False
        groups = list(groups.values())
        runtime.summary_seen = None
    logger.info(summarize(opt, groups).log_line())
    return True
