"""``Muon.summary()``: what the optimizer does with each tensor, and what a step costs each rank.

Every column is read from the optimizer's own decisions, none re-derived from shapes:

* Muon or AdamW: the tensor's param group (``use_muon``); *why*: the reason
  :func:`ds_muon.muon_param_groups` recorded when it decided (``param_reasons``,
  from :func:`ds_muon.models.reading.param_reasons`), else ``"user group"``;
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
import logging
import math
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from ...rules import ns_auto
from ...rules.newton_schulz import ns_flops
from ...rules.scaling import get_muon_scale_factor
from ..plan.compile import compile_exchanges, ns_settings, planner_task
from ..exchange.all_to_all import Exchange
from ..exchange.layout import Layout, global_shape
from ..plan.team_plan import team_member_flops, team_widths
from .rows import PLANNED, MatrixRow, RankRow, Summary, TensorRow

logger = logging.getLogger("ds_muon")
USER_GROUP = "user group"  # the reason of tensors in groups that recorded none (built by hand)


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
                    cost = ns_flops(info.rows, info.cols, ns.steps, ns.method_for(info.rows, info.cols))
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
                        at, cost, task.held, d, ns.steps, task.method, task.elem_bytes, task.groups, team)
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
    ns, ns_notes = ns_line(groups)
    return Summary(tensors, rank_rows, _world(), _this_rank(), opt.mode, opt.planner, opt.waves, max(1, domains),
                   notes + ns_notes, dataclasses.asdict(opt.planning_cost_model()),
                   clip.report() if clip is not None else None, ns)


def ns_line(groups: List[dict]) -> Tuple[str, List[str]]:
    """The NS each Muon group runs, e.g. ``NS in auto -> bfloat16, method auto -> standard (auto on
    cpu:GenuineIntel:amx_bf16)``: what ``"auto"`` became on this machine (:mod:`~ds_muon.rules.ns_auto`),
    an explicit setting as given; and a note per device saying why (for the table)."""
    parts, why = [], {}
    for gi, g in enumerate(groups):
        if not g.get("use_muon", True):
            continue
        ns = ns_settings(g)
        asked = ns_auto.resolve_dtype(g["ns_dtype"], ns.device_type)
        text = f"in {'auto -> ' if g['ns_dtype'] == ns_auto.AUTO else ''}{str(asked).replace('torch.', '')}, method "
        if g["ns_method"] == ns_auto.AUTO:
            gram = ns_auto.gram_pays(ns.device_type, asked)
            text += "auto -> " + ("gram where it saves FLOPs, else standard" if gram else "standard")
        else:
            text += g["ns_method"]
        if g["ns_dtype"] == ns_auto.AUTO or g["ns_method"] == ns_auto.AUTO:
            choice = ns_auto.choice(ns.device_type)
            text += f" (auto on {choice.device})"
            why.setdefault(ns.device_type, f"NS auto on {choice.device}: {choice.why}.")
        if not parts or parts[-1][1] != text:
            parts.append((gi, text))
    line = ("NS " + "; ".join((f"group {gi}+: " if len(parts) > 1 else "") + t for gi, t in parts)) if parts else ""
    return line, list(why.values())


ZERO3_NOTE = ("DeepSpeed ZeRO-3 hands the optimizer its partitions only inside step(): matrices, homes and "
              "bytes are known after the first step.")


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
                    method = ns.method_for(rows, cols)
                    by_key[s.key] = MatrixRow(s.key, (rows, cols), update_scale(g, (rows, cols), s.transposed), (),
                                              ns_flops(rows, cols, ns.steps, method), (), 0, ns.steps, method, 0)
    notes = [f"Before the first step, on rank {_this_rank()} alone: homes, team NS and the per-rank NS FLOPs and "
             f"bytes are {PLANNED} (placing every rank's pieces is a collective). summary() after the first "
             "step, or summary(all_ranks=True) called on every rank now, gives the exact plan."]
    if failed:
        notes.append(f"The tensors bind only inside step() on this stack ({failed[:200]}): matrices are "
                     f"{PLANNED} too.")
    if _zero3_before_step(groups, by_key):
        notes.append(ZERO3_NOTE)
    clip = getattr(opt, "qk_clip", None)
    ns, ns_notes = ns_line(groups)
    return Summary(_tensor_rows(opt, groups, bindings, by_key), [], _world(), _this_rank(), opt.mode, opt.planner,
                   opt.waves, 1, notes + ns_notes, dataclasses.asdict(opt.planning_cost_model()),
                   clip.report() if clip is not None else None, ns)


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
        evidence = g.get("param_evidence")
        evidence = evidence if evidence and len(evidence) == count else None
        algo = "Muon" if g["use_muon"] else "AdamW"
        for k in range(count):
            why = reasons[k] if reasons else USER_GROUP
            by = evidence[k] if evidence else ""
            if originals:
                mats = tuple(by_name.get(names[k], ())) if g["use_muon"] else ()
                rows.append(TensorRow(names[k], gi, algo, why, shapes.get(names[k], ()), mats, by))
                continue
            p, mats = g["params"][k], ()
            b = bindings.get(id(p)) if g["use_muon"] else None
            if b is not None:
                mats = tuple(by_key[s.key] for s in b.matrices if s.key in by_key)
                algo = "Muon+AdamW" if _mixed(p, b) else "Muon"
            name = names[k] if names else f"param_groups[{gi}]['params'][{k}]"
            rows.append(TensorRow(name, gi, algo, why, tuple(global_shape(p)), mats, by))
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
