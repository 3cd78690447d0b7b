"""The step's check, before anything changes: :class:`Agreement`, one small all_reduce.

The step all-reduces a small int64 table (a row per tensor: has a gradient, has
none, non-finite), so every rank raises, skips or steps alike.  Two more checks
ride in it and need no collective of their own:

* **replicas stay replicas** — a tensor every rank holds whole (no wrapper, DDP,
  DeepSpeed stage 0) must get the same gradient on every rank; a model that was
  never wrapped (or whose wrapper was bypassed) trains each rank on its own data,
  and Muon's scattered results would hide the drift of everything else;
* **copies stay copies** — ranks that hold identical copies of a DTensor's shard
  (HSDP's replicate dim; parameters FSDP2 x TP leaves on the ``dp`` sub-mesh, one
  copy per ``tp`` coordinate; dense parameters of EP x FSDP2) must get the same
  gradient: ds_muon orthogonalizes one copy and its result overwrites the others,
  so a difference would be lost silently.  Each group of copies gets a row of its
  own, fingerprinted by its members only (:mod:`~ds_muon.engine.exchange.copies`);
* **settings agree** — NS steps, dtypes, planner, learning rates … must be equal
  on every rank, or the exchange sizes or the updates differ;
* **local checks fail everywhere** — a check of this rank's own input before the
  agreement (a setting edited into ``param_groups``, a loaded state that does not fit,
  a sparse gradient) that fails on some ranks only is flagged in the table
  (:class:`LocalFailure`): the failing ranks re-raise their error, the others raise
  one naming them, instead of waiting in the all_reduce for the group's timeout.

The table itself (its columns, the rows written on the device, the codes the host reads) is
:mod:`.table`, the fingerprints (gradient extremes and settings, hashed) :mod:`.fingerprints`, and a
local check's failure carried to every rank :mod:`.local_failure`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from ..exchange.copies import copy_key, describe, holders
from .extremes import Extremes
from ..exchange.layout import _DTENSOR_OR_NONE as _DTENSOR, is_flat_shard, local_data as local
from .fingerprints import STEPPED, first_difference, settings_hash
from .local_failure import LocalFailure
from .table import (ACTIVE, COLUMNS, CONFLICT, DRIFT, FAILED, FAILED_AT, HAS_GRAD, NO_GRAD, NONFINITE_BIT, STALE,
                    _comm_device, _on_device, _summary, hashed_row)
from .timeouts import flattened_group


@dataclass
class Verdict:
    """What every rank agreed: the tensors that step, and those with a non-finite gradient somewhere."""

    active: Set[int]  # ids of the tensors with a gradient
    nonfinite: List[str]  # names of the tensors whose gradient is NaN or ±inf on some rank


@dataclass
class Rows:
    """Where each tensor's flags go in the all_reduce (see :meth:`Agreement._rows_for`).

    ``rows[i]``: item ``i``'s row (gradient present, finite); ``hash_at[i]``: the row its
    gradient's fingerprint goes to (-1: none), its own row for a tensor every rank holds
    whole, a row of its group of copies for a shard held by several ranks.  Rows
    ``[0, main)`` are the tensors' own; ``copies[j]`` is ``(item, global ranks)`` of row
    ``main + j``."""

    rows: List[int]
    hash_at: List[int]
    count: int
    main: int
    names: List[str]
    copies: List[Tuple[int, List[int]]]


class Agreement:
    """The step's check, before anything changes: one small all_reduce of a table with a
    row per tensor (gradient present or not, finite or not, replica fingerprints), a row
    per group of copies of a shard (their fingerprints), one row "an early dispatch is
    stale" and one row of settings fingerprints.

    Raises on the first problem, the same error on every rank (the flags are summed over
    ranks, not local).  Caches, per set of tensors, where each tensor's row goes, and
    the group of the DTensors' mesh; :meth:`clear` forgets both (after re-sharding).
    """

    def __init__(self):
        self._rows: Dict[tuple, Rows] = {}  # per set of tensors: rows of the all_reduce
        self._mesh: Optional[tuple] = None  # (binding signature, group of the DTensors' mesh)
        self._extremes = Extremes()  # each gradient's (min, max), many at once

    def clear(self) -> None:
        self._extremes.clear()
        self._rows.clear()
        self._mesh = None

    def group(self, process_group, param_groups, signature) -> Tuple[Optional[dist.ProcessGroup], int]:
        """The group every rank of the optimizer runs the step's collectives in, and its size:
        ``process_group``, else the ranks of the FSDP2 mesh the parameters live on (a sub-mesh
        need not be the world).  ``signature`` identifies the tensors (the mesh is cached)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1
        group = process_group
        if group is None:
            if self._mesh is None or self._mesh[0] != signature:
                self._mesh = (signature, _mesh_group(param_groups))
            group = self._mesh[1]
        return group, dist.get_world_size(group)

    def check(self, items, name: Callable[[int, int], str], group, world: int, settings: Optional[Dict[str, Any]],
              early=None, failed: Optional[Exception] = None) -> Verdict:
        """Agree on ``items`` (``(group index, tensor index, tensor)``) with every rank.

        ``name(gi, pi)`` names a tensor for errors; ``settings`` (when ``world > 1``) are this
        rank's :func:`settings_of`.  ``early`` (the backward dispatch, or None) answers
        ``stale(minmax)`` locally; when any rank finds it stale, every rank calls its ``redo()``.
        ``failed``: this rank's failed local check (see :class:`LocalFailure`), raised on every rank.
        """
        if failed is not None and world == 1:
            raise failed
        key = tuple(id(p) for _, _, p in items)
        where = self._rows_for(items, name, group, world, key)
        rows, hash_at, nrows, names = where.rows, where.hash_at, where.count, where.names
        has, missing = [], []  # rows with a gradient; rows without one (but with local elements)
        grads, checks, hashed, ids = [], [], [], []  # non-empty local gradients: their rows, fingerprint rows
        for i, (gi, pi, p) in enumerate(items):
            g = p.grad
            if g is None:
                # FSDP1 (use_orig_params=True) gives no grad to a parameter with no local elements
                if local(p).numel():
                    missing.append(rows[i])
                continue
            lg = g._local_tensor if isinstance(g, _DTENSOR) else g  # local_data, inline
            if lg.is_sparse:
                sparse = ValueError(
                    f"ds_muon: {name(gi, pi)} has a sparse gradient; Muon and AdamW here need dense ones")
                if world == 1:
                    raise sparse
                failed = failed or sparse  # raised after the all_reduce, on every rank
                continue
            has.append(rows[i])
            if lg.numel():
                grads.append(lg)
                checks.append(rows[i])
                hashed.append(hash_at[i])
                ids.append(id(p))
        # min and max of every gradient, in a few calls: NaN and ±inf both show up in them
        mm = self._extremes(grads) if grads else None
        # two more rows: "a wave dispatched from backward read something that changed since" (a bool,
        # or a flag still on the device), and every rank's settings, hashed
        stale = early is not None and early.stale(_RowsById(ids, mm))
        extra = [[0] * COLUMNS, hashed_row(settings_hash(settings)) if world > 1 else [0] * COLUMNS]
        extra[0][FAILED_AT] = int(failed is not None)
        grads_on = mm.device if mm is not None else torch.device("cpu")
        device = _comm_device(group, grads_on) if world > 1 else grads_on
        table = _on_device(nrows, has, missing, extra, checks, mm, hashed, stale, device, bool(where.copies))
        if world > 1:
            dist.all_reduce(table, group=group)
        codes = _summary(table, nrows).tolist()  # the step's one device-to-host read
        if codes[nrows] & FAILED:  # first: a bad setting on one rank also reads as settings drift
            LocalFailure.raise_everywhere(failed, group, world)
        if codes[nrows + 1] & DRIFT:
            everyone = [None] * world
            dist.all_gather_object(everyone, settings, group=group)
            if len({s.get(STEPPED) for s in everyone}) > 1:
                raise ValueError(_several_optimizers(everyone, group))
            raise ValueError(
                f"ds_muon: optimizer settings differ between ranks: {first_difference(everyone)}; "
                "every rank must build Muon with the same arguments and param groups, and change them alike")
        if codes[nrows] & STALE:  # on every rank alike: wait out the early gathers, redo them at step()
            early.redo()
        problems, codes = codes[nrows + 2], codes[:nrows]
        if problems:
            conflict = [k for k, c in enumerate(codes) if c & CONFLICT]
            if conflict:
                k = conflict[0]
                with_grad, without = table[k, HAS_GRAD].item(), table[k, NO_GRAD].item()  # raising: read again
                raise RuntimeError(
                    f"ds_muon: {names[k]} has a gradient on {with_grad} rank(s) and none on "
                    f"{without}; every rank must produce the same set of gradients (unused parameters "
                    "need the same treatment everywhere, e.g. set their grad to zeros or None on all ranks)"
                )
            drift = [k for k, c in enumerate(codes) if c & DRIFT]
            if drift[0] >= where.main:
                raise ValueError(_copies_differ(where, drift, items, name))
            raise RuntimeError(
                f"ds_muon: {names[drift[0]]} (and {len(drift) - 1} more) is replicated (every rank holds all of it) "
                "but its gradient differs between ranks, so the ranks would train different models: gradients are "
                "not being averaged. Wrap the model in DDP (or FSDP / DeepSpeed) before training; with "
                "transformers' Trainer do not call trainer.evaluate() before trainer.train() (it then never wraps "
                "the model; use TrainingArguments(eval_on_start=True)). Nothing was changed")
        return Verdict({id(p) for r, (_, _, p) in zip(rows, items) if codes[r] & ACTIVE},
                       [names[k] for k, c in enumerate(codes[:where.main]) if c & NONFINITE_BIT])

    def _rows_for(self, items, name, group, world, key: tuple) -> Rows:
        """Where each tensor's flags and fingerprint go in the one all_reduce of :meth:`check`.

        Tensors without a :func:`~ds_muon.domain` tag (or whose domain is the whole
        agreement group) are the same tensors on every rank: one row each, in order.
        Tensors of a smaller domain (expert data parallelism) differ between domains,
        so each domain gets its own block of rows, written only by its members: the
        sums then count agreement within the domain, and every rank still sees every
        problem (and raises or skips alike).  A tensor every rank holds whole is
        fingerprinted in its own row; a DTensor shard that several ranks hold
        identical copies of gets one more row per group of copies, fingerprinted by
        that group's members only.  The layout is agreed once per set of tensors
        (``key``: their ids; one all_gather_object).
        """
        cached = self._rows.get((world, key))
        if cached is not None:
            return cached
        names = [name(gi, pi) for gi, pi, _ in items]
        if world == 1:
            n = len(items)
            out = self._rows[(world, key)] = Rows(list(range(n)), [-1] * n, n, n, names, [])
            return out
        from ...tensors.tag_keys import domain_of

        here = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        common: List[int] = []
        mine: Dict[tuple, List[int]] = {}
        for k, (_, _, p) in enumerate(items):
            d = domain_of(p)
            ranks = None if d is None else tuple(sorted(dist.get_process_group_ranks(d)))
            if ranks is None or ranks == tuple(sorted(here)):
                common.append(k)
            else:
                if not set(ranks) <= set(here):
                    raise ValueError(
                        f"ds_muon: {names[k]} is tagged with a domain of ranks {list(ranks)}, not all of which are in "
                        f"the optimizer's process_group (ranks {sorted(here)})")
                mine.setdefault(ranks, []).append(k)
        keys = [copy_key(items[k][2]) for k in common]
        everyone = [None] * world
        dist.all_gather_object(everyone, (len(common), {r: [names[k] for k in ks] for r, ks in mine.items()},
                                          keys if any(c is not None for c in keys) else None), group=group)
        if len({n for n, _, _ in everyone}) > 1:
            raise ValueError(
                "ds_muon: ranks list different numbers of tensors outside expert domains "
                f"({[n for n, _, _ in everyone]} by rank); every rank must build the optimizer over the same model")
        blocks: Dict[tuple, List[str]] = {}
        for r, (_, doms, _) in enumerate(everyone):
            for ranks, dnames in doms.items():
                if here[r] not in ranks:
                    raise ValueError(f"ds_muon: rank {here[r]} tags {dnames[0]} with a domain it is not in {list(ranks)}")
                if ranks in blocks and len(blocks[ranks]) != len(dnames):
                    raise ValueError(
                        f"ds_muon: the ranks of domain {list(ranks)} list different numbers of tensors in it "
                        f"({len(blocks[ranks])} and {len(dnames)}, e.g. {dnames[0]}); replicas of an expert must "
                        "hold the same tensors")
                blocks.setdefault(ranks, dnames)
        rows = [0] * len(items)
        for j, k in enumerate(common):
            rows[k] = j
        row_names = [names[k] for k in common]
        for ranks in sorted(blocks):
            for j, k in enumerate(mine.get(ranks, [])):
                rows[k] = len(row_names) + j
            row_names.extend(f"{n} (domain of ranks {list(ranks)})" for n in blocks[ranks])
        hash_at = [rows[k] if _is_replica(p) else -1 for k, (_, _, p) in enumerate(items)]
        main, copies = len(row_names), []
        me = dist.get_rank(group)
        for j, column in _copy_columns(everyone, len(common)):
            for members in holders(column):
                if me in members:
                    hash_at[common[j]] = main + len(copies)
                copies.append((common[j], [here[r] for r in members]))
        out = self._rows[(world, key)] = Rows(rows, hash_at, main + len(copies), main, row_names, copies)
        return out


def _copy_columns(everyone, n: int):
    """``(j, key of common tensor j on each rank)`` for the tensors some rank holds a copy key of."""
    lists = [keys if keys is not None else [None] * n for _, _, keys in everyone]
    if all(keys is None for _, _, keys in everyone):
        return
    for j, column in enumerate(zip(*lists)):
        if any(c is not None for c in column):
            yield j, column


def _several_optimizers(everyone: List[Dict[str, Any]], group) -> str:
    """The error for ranks stepping different optimizers at once (same text on every rank)."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    which = "; ".join(f"rank {r} steps {s.get(STEPPED)}" for r, s in zip(ranks, everyone))
    return (f"ds_muon: the ranks are stepping different optimizers at once ({which}). With several Muon "
            "optimizers in one job, every rank must build them in the same order and step them in the same "
            "order (their collectives pair up by order). Nothing was changed")


def _copies_differ(where: Rows, drift: List[int], items, name) -> str:
    """The error for copies of a shard whose gradients differ (named only now: it costs a mesh lookup)."""
    k, ranks = where.copies[drift[0] - where.main]
    gi, pi, p = items[k]
    more = f" (and {len(drift) - 1} more)" if len(drift) > 1 else ""
    return (
        f"ds_muon: {describe(name(gi, pi), p, ranks)}{more}: ranks that hold identical copies of this shard got "
        "different gradients. ds_muon orthogonalizes one copy and overwrites the others with its result, so the "
        "difference would be lost silently. Copies (HSDP's replicate dim; parameters tensor parallelism leaves on "
        "the dp sub-mesh, one per tp rank; dense parameters under expert parallelism, one per ep rank) must see "
        "the same data: give the ranks of a tp group the same batch, combine what differs between them (e.g. "
        "all_reduce expert outputs over ep) before these parameters, and let FSDP reduce gradients on every "
        "micro-batch you step on. Nothing was changed")


def _is_replica(p: torch.Tensor) -> bool:
    """Does every rank of the agreement group hold all of ``p`` (no wrapper, DDP, DeepSpeed stage 0)?

    Shards (DTensors, FSDP1 flat parameters and views, ZeRO partitions) and
    tensor-parallel pieces differ between ranks by design."""
    from ...tensors.tag_keys import TENSOR_PARALLEL

    return not (is_flat_shard(p) or hasattr(p, "placements")
                or getattr(p, TENSOR_PARALLEL, None) is not None)


def _mesh_group(param_groups) -> Optional[dist.ProcessGroup]:
    """With ``process_group=None``: the group spanning the device mesh of the DTensor parameters, None
    (the world) when they span the world or there are none.  Raises when it cannot be named here."""
    meshes = {}
    for g in param_groups:
        for p in g["params"]:
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                meshes.setdefault(tuple(mesh.mesh.flatten().tolist()), mesh)
    if not meshes:
        return None
    # sub-meshes of one mesh (FSDP2 x TP: TP weights on (dp, tp), the rest on dp) step in the one spanning them
    spanning = [r for r in meshes if all(set(o) <= set(r) for o in meshes)]
    if not spanning:
        raise ValueError(
            f"ds_muon: the DTensor parameters live on {len(meshes)} device meshes with different ranks "
            f"({sorted(meshes)[:2]} ...); pass Muon(..., process_group=) the group spanning all of them")
    ranks, mesh = spanning[0], meshes[spanning[0]]
    if sorted(ranks) == list(range(dist.get_world_size())):
        return None
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.mesh_dim_names:  # the group the layouts plan in (integrations/fsdp2.py); DeviceMesh caches it
        return flattened_group(mesh)  # with its mesh's timeout (ds_muon.engine.agreement.timeouts)
    raise ValueError(
        f"ds_muon: the DTensor parameters live on a {mesh.ndim}-D device mesh over ranks {sorted(ranks)} without "
        "mesh_dim_names, not the whole world; build the mesh with mesh_dim_names, or pass Muon(..., process_group=) "
        "a process group spanning exactly those ranks (one that every rank created with torch.distributed.new_group)")


class _RowsById(Mapping):
    """Each gradient's (min, max) by id of its tensor, read from the rows of ``mm`` on demand
    (the backward dispatch's stale check reads a few)."""

    def __init__(self, ids: List[int], mm: Optional[torch.Tensor]):
        self._ids, self._mm, self._at = ids, mm, None

    def _index(self) -> Dict[int, int]:
        if self._at is None:
            self._at = {pid: j for j, pid in enumerate(self._ids)}
        return self._at

    def __getitem__(self, pid: int) -> torch.Tensor:
        return self._mm[self._index()[pid]]

    def __iter__(self):
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, pid) -> bool:
        return pid in self._index()
