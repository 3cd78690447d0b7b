"""The step's check, before anything changes: :class:`Agreement`, one small all_reduce.

The step all-reduces a small int64 table (a row per tensor: has a gradient, has
none, non-finite), so every rank raises, skips or steps alike.  Two more checks
ride in it and need no collective of their own:

* **replicas stay replicas** — a tensor every rank holds whole (no wrapper, DDP,
  DeepSpeed stage 0) must get the same gradient on every rank; a model that was
  never wrapped (or whose wrapper was bypassed) trains each rank on its own data,
  and Muon's scattered results would hide the drift of everything else;
* **settings agree** — NS steps, dtypes, planner, learning rates … must be equal
  on every rank, or the exchange sizes or the updates differ.

Each rank contributes, per row, ``(1, h, h²)`` for a 16-bit hash ``h``; after the
sum, all contributions were equal exactly when ``n·Σh² == (Σh)²`` (equality in
Cauchy–Schwarz), in exact integer arithmetic for up to 2¹⁵ ranks.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from .layout import is_flat_shard

HASH_MOD = 65521  # a prime below 2**16: h² summed over 2**15 ranks fits in int64

# columns of the agreement table
HAS_GRAD, NO_GRAD, NONFINITE, N_HASHED, HASH, HASH_SQ = range(6)
COLUMNS = 6


def minmax_hash(minmax: torch.Tensor) -> torch.Tensor:
    """A 16-bit hash of each row's (min, max) bit patterns, on the tensors' device.

    ``minmax`` is ``[n, 2]`` (any float dtype); returns int64 ``[n]``.  Equal
    gradients give equal hashes; a gradient computed from other data changes its
    extremes, and so the hash, with overwhelming probability.
    """
    bits = minmax.float().view(torch.int32).to(torch.int64)
    return torch.remainder(bits[:, 0] * 1000003 + bits[:, 1], HASH_MOD)


def text_hash(text: str) -> int:
    return zlib.crc32(text.encode()) % HASH_MOD


def hashed_row(h: int) -> List[int]:
    row = [0] * COLUMNS
    row[N_HASHED], row[HASH], row[HASH_SQ] = 1, h, h * h
    return row


def hashes_differ(row: Sequence[int]) -> bool:
    """After the sum: did the ranks that hashed this row hash it differently?"""
    n, s, q = row[N_HASHED], row[HASH], row[HASH_SQ]
    return n > 1 and n * q != s * s


def _plain(v: Any) -> Any:
    if torch.is_tensor(v):
        return v.item() if v.numel() == 1 else tuple(v.flatten().tolist())
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return v


def settings_of(optimizer) -> Dict[str, Any]:
    """Everything that must be equal on every rank, as plain values (names for the error)."""
    out: Dict[str, Any] = {}
    for k in ("mode", "planner", "waves", "comm_dtype", "nonfinite", "adam_betas", "adam_eps"):
        out[k] = _plain(getattr(optimizer, k, None))
    out["cost_model"] = repr(getattr(optimizer, "cost_model", None))
    out["overlap"] = getattr(optimizer, "_deferred", None) is not None
    out["dispatch_in_backward"] = getattr(optimizer, "_dispatch", None) is not None
    for gi, g in enumerate(optimizer.param_groups):
        for k, v in g.items():
            if k not in ("params", "param_names", "param_tags"):
                out[f"param_groups[{gi}][{k!r}]"] = _plain(v)
    return out


def settings_hash(settings: Dict[str, Any]) -> int:
    return text_hash(repr(sorted((k, repr(v)) for k, v in settings.items())))


def first_difference(everyone: List[Dict[str, Any]]) -> str:
    """Name the first setting that differs between ranks, with each rank's value."""
    keys = sorted({k for s in everyone for k in s})
    for k in keys:
        values = [s.get(k, "<missing>") for s in everyone]
        if any(v != values[0] for v in values[1:]):
            return f"{k} is " + ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values))
    return "the settings hash differs, but no single setting does (a hash collision)"


@dataclass
class Verdict:
    """What every rank agreed: the tensors that step, and those with a non-finite gradient somewhere."""

    active: Set[int]  # ids of the tensors with a gradient
    nonfinite: List[str]  # names of the tensors whose gradient is NaN or ±inf on some rank


class Agreement:
    """The step's check, before anything changes: one small all_reduce of a table with a
    row per tensor (gradient present or not, finite or not, replica fingerprints), one
    row "an early dispatch is stale" and one row of settings fingerprints.

    Raises on the first problem, the same error on every rank (the flags are summed over
    ranks, not local).  Caches, per set of tensors, where each tensor's row goes, and
    the group of the DTensors' mesh; :meth:`clear` forgets both (after re-sharding).
    """

    def __init__(self):
        self._rows: Dict[tuple, tuple] = {}  # per set of tensors: rows of the all_reduce
        self._replicas: Dict[tuple, List[bool]] = {}  # per set of tensors: which are held whole everywhere
        self._mesh: Optional[tuple] = None  # (binding signature, group of the DTensors' mesh)

    def clear(self) -> None:
        self._rows.clear()
        self._replicas.clear()
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

    def check(self, items, name: Callable[[int, int], str], flat: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              group, world: int, settings: Optional[Dict[str, Any]], early=None) -> Verdict:
        """Agree on ``items`` (``(group index, tensor index, tensor)``) with every rank.

        ``name(gi, pi)`` names a tensor for errors; ``flat(p, t)`` is this rank's flat
        local data of ``p``'s tensor ``t``; ``settings`` (when ``world > 1``) are this
        rank's :func:`settings_of`.  ``early`` (the backward dispatch, or None) answers
        ``stale(minmax)`` locally; when any rank finds it stale, every rank calls its ``redo()``.
        """
        rows, nrows, names = self._rows_for(items, name, group, world)
        replicas = self._replicas_for(items, world)
        flags = [[0] * COLUMNS for _ in range(nrows)]
        checks = []  # (row, (min, max), is a replica)
        minmax = {}
        for i, (gi, pi, p) in enumerate(items):
            k = rows[i]
            g = p.grad
            if g is None:
                # FSDP1 (use_orig_params=True) gives no grad to a parameter with no local elements
                flags[k][NO_GRAD] = int(flat(p, p).numel() > 0)
                continue
            if g.is_sparse:
                raise ValueError(f"ds_muon: {name(gi, pi)} has a sparse gradient; Muon and AdamW here need dense ones")
            flags[k][HAS_GRAD] = 1
            lg = flat(p, g)
            if lg.numel():
                # min and max in one pass: NaN and ±inf both show up in them
                minmax[id(p)] = torch.stack(torch.aminmax(lg))
                checks.append((k, minmax[id(p)], replicas[i]))
        # one more row: "a wave dispatched from backward read something that changed since"
        flags.append([0] * COLUMNS)
        stale = early is not None and early.stale(minmax)  # a bool, or a flag still on the device
        if world > 1:
            flags.append(hashed_row(settings_hash(settings)))  # and one: every rank's settings, hashed
        device = _comm_device(group, _first_device(checks)) if world > 1 else _first_device(checks)
        table = _on_device(flags, checks, stale, nrows, device)
        if world > 1:
            dist.all_reduce(table, group=group)
        flags = table.tolist()  # the step's one device-to-host read
        if world > 1:
            if hashes_differ(flags[nrows + 1]):
                everyone = [None] * world
                dist.all_gather_object(everyone, settings, group=group)
                raise ValueError(
                    f"ds_muon: optimizer settings differ between ranks: {first_difference(everyone)}; "
                    "every rank must build Muon with the same arguments and param groups, and change them alike")
        if flags[nrows][0]:  # on every rank alike: wait out the early gathers, redo them at step()
            early.redo()
        for k in range(nrows):
            if flags[k][0] and flags[k][1]:
                raise RuntimeError(
                    f"ds_muon: {names[k]} has a gradient on {flags[k][0]} rank(s) and none on "
                    f"{flags[k][1]}; every rank must produce the same set of gradients (unused parameters "
                    "need the same treatment everywhere, e.g. set their grad to zeros or None on all ranks)"
                )
        drift = [k for k in range(nrows) if hashes_differ(flags[k]) and not flags[k][NONFINITE]]
        if drift:
            raise RuntimeError(
                f"ds_muon: {names[drift[0]]} (and {len(drift) - 1} more) is replicated (every rank holds all of it) "
                "but its gradient differs between ranks, so the ranks would train different models: gradients are "
                "not being averaged. Wrap the model in DDP (or FSDP / DeepSpeed) before training; with "
                "transformers' Trainer do not call trainer.evaluate() before trainer.train() (it then never wraps "
                "the model; use TrainingArguments(eval_on_start=True)). Nothing was changed")
        return Verdict({id(p) for k, (_, _, p) in enumerate(items) if flags[rows[k]][0]},
                       [names[k] for k in range(nrows) if flags[k][NONFINITE]])

    def _replicas_for(self, items, world: int) -> List[bool]:
        """Which of ``items`` every rank holds whole (their gradients must agree), by row of
        ``items``; worked out once per set of tensors, not every step."""
        key = (world,) + tuple(id(p) for _, _, p in items)
        cached = self._replicas.get(key)
        if cached is None:
            cached = self._replicas[key] = [world > 1 and _is_replica(p) for _, _, p in items]
        return cached

    def _rows_for(self, items, name, group, world) -> Tuple[List[int], int, List[str]]:
        """Where each tensor's flags go in the one all_reduce of :meth:`check`.

        Tensors without a :func:`~ds_muon.domain` tag (or whose domain is the whole
        agreement group) are the same tensors on every rank: one row each, in order.
        Tensors of a smaller domain (expert data parallelism) differ between domains,
        so each domain gets its own block of rows, written only by its members: the
        sums then count agreement within the domain, and every rank still sees every
        problem (and raises or skips alike).  The block layout is agreed once per set
        of tensors (one all_gather_object); returns (row of each item, rows, row names).
        """
        key = tuple(id(p) for _, _, p in items)
        cached = self._rows.get(key)
        if cached is not None:
            return cached
        names = [name(gi, pi) for gi, pi, _ in items]
        if world == 1:
            out = (list(range(len(items))), len(items), names)
            self._rows[key] = out
            return out
        from .tags import domain_of

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
        everyone = [None] * world
        dist.all_gather_object(everyone, (len(common), {r: [names[k] for k in ks] for r, ks in mine.items()}),
                               group=group)
        if len({n for n, _ in everyone}) > 1:
            raise ValueError(
                "ds_muon: ranks list different numbers of tensors outside expert domains "
                f"({[n for n, _ in everyone]} by rank); every rank must build the optimizer over the same model")
        blocks: Dict[tuple, List[str]] = {}
        for r, (_, doms) in enumerate(everyone):
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
        out = (rows, len(row_names), row_names)
        self._rows[key] = out
        return out


def _is_replica(p: torch.Tensor) -> bool:
    """Does every rank of the agreement group hold all of ``p`` (no wrapper, DDP, DeepSpeed stage 0)?

    Shards (DTensors, FSDP1 flat parameters and views, ZeRO partitions) and
    tensor-parallel pieces differ between ranks by design."""
    from .tags import TENSOR_PARALLEL

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
    if len(meshes) > 1:
        raise ValueError(
            f"ds_muon: the DTensor parameters live on {len(meshes)} device meshes with different ranks "
            f"({sorted(meshes)[:2]} ...); pass Muon(..., process_group=) the group spanning all of them")
    ranks, mesh = next(iter(meshes.items()))
    if sorted(ranks) == list(range(dist.get_world_size())):
        return None
    if mesh.ndim == 1:
        return mesh.get_group()
    raise ValueError(
        f"ds_muon: the DTensor parameters live on a {mesh.ndim}-D device mesh over ranks {sorted(ranks)}, not the "
        "whole world; pass Muon(..., process_group=) a process group spanning exactly those ranks (one that every "
        "rank of the mesh created with torch.distributed.new_group)")


def _on_device(flags: List[List[int]], checks, stale, nrows: int, device: torch.device) -> torch.Tensor:
    """The agreement table on ``device``: the flags known on the host, with the finite flags,
    replica fingerprints and the stale flag written in on the device, so that reading the
    (reduced) table is the step's only wait for the device."""
    table = _host_to(device, flags)
    if checks:
        mm = torch.stack([c for _, c, _ in checks]).to(device)
        row = _host_to(device, [k for k, _, _ in checks])
        table[row, NONFINITE] = (~torch.isfinite(mm).all(dim=1)).to(torch.int64)
        replica = [j for j, (_, _, rep) in enumerate(checks) if rep]
        if replica:  # its gradient must be the same on every rank
            pick = _host_to(device, replica)
            h = minmax_hash(mm[pick])
            table[row[pick], N_HASHED] = 1
            table[row[pick], HASH] = h
            table[row[pick], HASH_SQ] = h * h
    if torch.is_tensor(stale):
        table[nrows, 0] = stale.to(device=device, dtype=torch.int64)
    else:
        table[nrows, 0] = int(stale)
    return table


def _host_to(device: torch.device, values) -> torch.Tensor:
    """int64 values from the host, copied without waiting for work already queued on the device
    (a blocking host-to-device copy synchronizes the stream)."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _first_device(checks) -> torch.device:
    """Where the gradients are (the first non-empty one's device)."""
    return checks[0][1].device if checks else torch.device("cpu")


def _comm_device(group, grads_on: torch.device) -> torch.device:
    """Where the table is reduced: the gradients' GPU when the group's backend runs collectives
    there (NCCL: the device the parameters live on, not whichever is current), else the CPU."""
    backend = dist.get_backend(group)
    if grads_on.type == "cuda" and "nccl" in backend:
        return grads_on
    if backend == "nccl":  # no local gradient elements on this rank to tell
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
