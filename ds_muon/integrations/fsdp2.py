"""PyTorch FSDP2 (``fully_shard``) on any DTensor mesh: FSDP, HSDP, FSDP2 x TP.

What a rank holds of a parameter is read from DTensor's own shard arithmetic
(placement after placement, ``Shard``, ``_StridedShard``, ``Replicate``): a row
range (a contiguous range of the row-major flattening) or, when a mesh dim shards
the columns (TP ``RowwiseParallel``), a column block.  Updates go into
``p.to_local()``, a view of the storage FSDP all-gathers from.  The Layout's group
spans the whole mesh: replicas (HSDP) hold identical pieces, so each matrix gets
one home in the world and its result is fanned out to every replica.  FSDP2
reduce-scatters a gradient before the parameter's post-accumulate-grad hook fires,
so the gradient is final there.
"""

from __future__ import annotations

import functools
import itertools
from typing import Optional

import torch
import torch.distributed as dist

from ..engine.exchange.layout import _DTENSOR, MatrixSlot, ParamBinding, Piece, matrix_shape
from ..engine.exchange.slots import block_slots, logical_blocks
from ..tensors.tag_keys import BLOCKS, EXPERTS, is_tagged, is_transposed, row_axes_of
from ..engine.agreement.timeouts import flattened_group
from .base import BindContext


class Fsdp2Adapter:
    """DTensor parameters of ``fully_shard`` (FSDP2/HSDP)."""

    applies_in_step = False
    data_parallel_group = None

    def __init__(self):
        self._units: Optional[tuple] = None  # (id(model), ids of the parameters of its fully_shard units)
        self._meshes: Optional[tuple] = None  # (ids of model and param group, meshes of their DTensors)

    def bind(self, param: torch.Tensor, name: str, context: BindContext) -> ParamBinding:
        return bind_fsdp2(param, name, _planning_mesh(param, self._used_meshes(context)))

    def _used_meshes(self, context: BindContext) -> list:
        """The device meshes of the DTensors of ``context.model`` and of the param group (cached)."""
        key = (id(context.model), id(context.options))
        if self._meshes is None or self._meshes[0] != key:
            tensors = list(context.model.parameters()) if context.model is not None else []
            tensors += list(context.options.get("params", ()))
            meshes = {}
            for t in tensors:
                mesh = getattr(t, "device_mesh", None) if is_dtensor(t) else None
                if mesh is not None:
                    meshes.setdefault(_ranks(mesh), mesh)
            self._meshes = (key, [meshes[r] for r in sorted(meshes)])
        return self._meshes[1]

    def place_grads(self, items, name) -> None:
        place_grads(items, name)

    def grad_final_at_hook(self, param: torch.Tensor, context: BindContext) -> bool:
        """For a parameter of a ``fully_shard`` unit of ``context.model``: FSDP2 calls the hook
        right after reduce-scattering it (a DTensor distributed by hand is reduced by nobody)."""
        if context.model is None:
            return False
        if self._units is None or self._units[0] != id(context.model) or id(param) not in self._units[1]:
            self._units = (id(context.model), _fully_sharded(context.model))  # rebuilt once a parameter is new
        return id(param) in self._units[1]


def place_grads(items, name) -> None:
    """Each DTensor gradient laid out like its parameter, before the step reads the local pieces: one placed
    otherwise on the same mesh is redistributed (DTensor's backward of a row-wise embedding gives a
    ``Replicate`` gradient for a ``Shard(0)`` weight; slicing a replicated tensor is exact), one on another
    mesh or a plain tensor is refused naming the tensor.  ``items``: ``(gi, pi, param)``; ``name(gi, pi)``."""
    for gi, pi, p in items:
        g = p.grad
        if g is None or not is_dtensor(p):
            continue
        if not is_dtensor(g):
            raise ValueError(f"ds_muon: {name(gi, pi)} is a DTensor ({tuple(p.placements)}) and its gradient a plain "
                             f"{type(g).__name__}; give it a DTensor gradient on the parameter's mesh (what "
                             "backward through the sharded model gives)")
        if g.device_mesh != p.device_mesh:
            raise ValueError(f"ds_muon: the gradient of {name(gi, pi)} lives on another device mesh ({g.device_mesh}) "
                             f"than the parameter ({p.device_mesh}); give it a gradient on the parameter's mesh")
        if tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


def _fully_sharded(model) -> set:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return set()
    return {id(p) for m in model.modules() if isinstance(m, FSDPModule) for p in m.parameters()}


def is_dtensor(t) -> bool:
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


def _dtensor_flat(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (param, grad or state made ``zeros_like`` it), flat, as a view."""
    if not is_dtensor(t):
        raise TypeError(
            f"ds_muon: expected a DTensor shard (FSDP2) but got a plain tensor of shape {tuple(t.shape)}; "
            "optimizer state of FSDP2 parameters must stay DTensors: load it with "
            "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict"
        )
    local = t.to_local()
    return local.view(-1) if local.is_contiguous() else local.reshape(-1)


def _held_ranges(param, name: str) -> list:
    """``[(lo, hi), ...]`` per tensor dim: the global index range this rank holds along it.

    Read from DTensor's own shard arithmetic (``_get_shard_size_and_offsets``, the
    helper behind ``compute_local_shape_and_global_offset``), applied mesh dim by mesh
    dim as DTensor does, so ``Shard`` on any dim, ``_StridedShard`` (FSDP2 over TP) and
    uneven or empty shards come out exactly as the local tensor holds them.  A shard
    that is not one index range along a dim (a ``_StridedShard`` that interleaves rows)
    or a ``Partial`` placement raises NotImplementedError, on every rank: with a strided
    placement every mesh coordinate is checked (once per shape and placement).
    """
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = param.device_mesh
    shape, mesh_shape, placements = tuple(int(s) for s in param.shape), tuple(mesh.shape), tuple(param.placements)
    if any(isinstance(pl, _StridedShard) for pl in placements):
        bad = _first_split_coordinate(shape, mesh_shape, placements)
        if bad is not None:
            coord, d, idx = bad
            raise NotImplementedError(
                f"ds_muon: {name} is placed {placements} on a mesh of shape {mesh_shape}; the rank at mesh "
                f"coordinate {coord} holds indices {idx[:4]}... of dim {d}, not one range, which ds_muon "
                "cannot describe yet. Put this tensor in an AdamW group (use_muon=False)")
    return _ranges_at(shape, mesh_shape, placements, tuple(mesh.get_coordinate()), name)  # Shard chains: ranges


@functools.lru_cache(maxsize=256)
def _first_split_coordinate(shape, mesh_shape, placements):
    """``(coordinate, dim, indices)`` of the first rank whose shard is not one range along a dim."""
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        for d, r in enumerate(_ranges_at(shape, mesh_shape, placements, coord, "")):
            if not isinstance(r, tuple):
                return coord, d, r
    return None


def _ranges_at(shape, mesh_shape, placements, coord, name: str) -> list:
    """Per tensor dim, ``(lo, hi)`` held at mesh ``coord``, or the list of indices when not one range."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard

    sizes = list(shape)
    index = {}
    for mesh_dim, pl in enumerate(placements):
        if isinstance(pl, Replicate):
            continue
        if not isinstance(pl, (Shard, _StridedShard)):
            raise NotImplementedError(
                f"ds_muon: {name} is a DTensor placed {placements}; ds_muon supports Shard, _StridedShard and "
                f"Replicate placements, not {pl}. Put this tensor in an AdamW group (use_muon=False)")
        d = pl.dim
        size, idx = _get_shard_size_and_offsets(sizes[d], mesh_shape[mesh_dim], coord[mesh_dim], pl,
                                                index.get(d), shape[d], False)
        sizes[d] = int(size)
        index[d] = idx[:int(size)]
    ranges = []
    for d, n in enumerate(shape):
        if d not in index:
            ranges.append((0, n))
            continue
        idx = [int(i) for i in index[d].tolist()]
        if not idx:
            ranges.append((0, 0))
        elif idx != list(range(idx[0], idx[0] + len(idx))):
            ranges.append(idx)
        else:
            ranges.append((idx[0], idx[-1] + 1))
    return ranges


def _ranks(mesh) -> tuple:
    return tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))


def _planning_mesh(param, used: list):
    """The mesh a parameter's matrices are planned over: the largest mesh the model uses that
    contains every rank of the parameter's own mesh and comes from the same root mesh.

    FSDP2 x TP leaves the parameters TP does not touch on the ``dp`` sub-mesh: each ``tp``
    coordinate holds an identical copy (replicas), so planning them over the whole
    ``(dp, tp)`` mesh gives each matrix one home in the world instead of one per ``tp``
    group.  Every rank of that mesh holds the same model, so the choice is the same on
    every rank (``build_layout`` checks it).

    Roots compare by value (ranks, layout, dim names), not identity: torch caches meshes it derives
    (FSDP2's ``(dp, ep)`` mesh for an EP parameter) by value, so in a process that built an equal mesh
    before, a parameter's root can be that earlier, equal object.
    """
    mesh = param.device_mesh
    own, root = set(_ranks(mesh)), mesh._get_root_mesh()
    best = mesh
    for other in used:
        ranks = _ranks(other)
        if (other._get_root_mesh() == root and own < set(ranks)
                and (len(ranks), ranks) > (len(_ranks(best)), _ranks(best))):
            best = other
    return best


def _mesh_group(mesh, name: str):
    """The process group over every rank of ``mesh``: a matrix is planned once over all of them
    (replicas hold identical pieces and get the result fanned out)."""
    if mesh.ndim == 1:
        return mesh.get_group(0)
    ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    if dist.is_initialized() and ranks == list(range(dist.get_world_size())):
        return None  # the default group: every world rank
    if not mesh.mesh_dim_names:
        raise NotImplementedError(
            f"ds_muon: {name} lives on a {mesh.ndim}-D DeviceMesh without mesh_dim_names that does not span "
            "the world; give the mesh mesh_dim_names (init_device_mesh(..., mesh_dim_names=...)) so its ranks can "
            "be flattened into one process group, or put this tensor in an AdamW group (use_muon=False)")
    return flattened_group(mesh)  # DeviceMesh caches it: one group per mesh (with its mesh's timeout)


def bind_fsdp2(param, name: str, plan_mesh=None) -> ParamBinding:
    """A DTensor parameter on any mesh (FSDP2, HSDP, FSDP2 x TP): this rank's block of it.

    The block is the row range x column range the placements give this rank
    (:func:`_held_ranges`): a contiguous range of the row-major flattening when
    the columns are whole (``Shard(0)``, ``_StridedShard(0)``), a column block when a
    mesh dim shards dim 1 (TP ``RowwiseParallel``); for an :func:`ds_muon.expert_weight`
    stack ``[E, out, in]`` any box of experts x rows x columns (EP ``Shard(0)`` x FSDP2
    ``Shard(1)``).  The group spans ``plan_mesh`` (default: the parameter's own mesh).
    """
    if param.ndim < 2:
        raise ValueError(
            f"ds_muon: {name} has shape {tuple(param.shape)}; Muon needs matrices (ndim >= 2). Put it in an "
            "AdamW group (use_muon=False), e.g. with ds_muon.muon_param_groups(model)"
        )
    experts = param.ndim == 3 and getattr(param, EXPERTS, False)  # [E, out, in]: any dim may be sharded
    if not experts and any(getattr(pl, "dim", 0) >= (1 if param.ndim > 2 else 2) for pl in param.placements):
        k = row_axes_of(param)  # an N-D tensor read as one [prod(shape[:k]), rest] matrix (ds_muon.row_axes)
        raise NotImplementedError(
            f"ds_muon: {name} of shape {tuple(param.shape)} is sharded along a dim past 0 "
            f"({tuple(param.placements)}); ds_muon describes column shards of 2-D matrices only"
            + (f" (it holds one [prod(shape[:{k}]), rest] matrix, ds_muon.row_axes, read from whole dim-0 slices)"
               if k != 1 else "")
            + ". Shard it along dim 0 (FSDP2's default placement), or put it in an AdamW group (use_muon=False)")
    mesh = param.device_mesh
    local = param.to_local()
    if not local.is_contiguous():
        raise ValueError(
            f"ds_muon: the local shard of {name} is not contiguous (strides {local.stride()}); Muon updates "
            "it in place through a flat view"
        )
    ranges = _held_ranges(param, name)
    if tuple(hi - lo for lo, hi in ranges) != tuple(local.shape):
        raise ValueError(
            f"ds_muon: {name}: the DTensor's placements say the local shard is "
            f"{tuple(hi - lo for lo, hi in ranges)} but it is {tuple(local.shape)}; the shard does not match "
            "its metadata"
        )
    group = _mesh_group(plan_mesh if plan_mesh is not None else mesh, name)
    if getattr(param, BLOCKS, None) is not None and any(
            (lo, hi) != (0, n) for (lo, hi), n in zip(ranges[1:], param.shape[1:])):
        raise NotImplementedError(
            f"ds_muon: {name} holds fused blocks (ds_muon.fused_blocks) and is sharded past dim 0 "
            f"({tuple(param.placements)}); ds_muon reads such blocks from row ranges only. Shard it along dim 0, "
            "or build the groups with muon_param_groups(..., split_fused=False)")
    if experts and ranges[1:] != [(0, n) for n in param.shape[1:]]:  # EP x FSDP2 Shard(1)/Shard(2)
        return ParamBinding(param, _dtensor_flat, expert_block_slots(param, name, ranges), group=group)
    (r0, r1) = ranges[0]
    cols = matrix_shape(param.shape)[1]
    c0, c1 = ranges[1] if param.ndim == 2 else (0, cols)
    if c0 == 0 and c1 == cols:  # whole rows: a contiguous range of the flattening
        lo, hi = r0 * cols, r1 * cols
        if is_tagged(param):  # split rows / experts: blocks clipped to this rank's row range
            return ParamBinding(param, _dtensor_flat, block_slots(param, name, lo, hi), group=group)
        piece = Piece(lo, hi - lo) if hi > lo else None
        return ParamBinding(param, _dtensor_flat,
                            [MatrixSlot(name, tuple(param.shape), piece, 0, transposed=is_transposed(param))],
                            group=group)
    slots = []  # a column block [r0:r1, c0:c1], clipped to each logical block (split rows)
    for key, bshape, start in logical_blocks(param, name):
        b0 = start // cols
        b1 = b0 + matrix_shape(bshape)[0]
        a, b = max(r0, b0), min(r1, b1)
        piece = Piece.block((b1 - b0, cols), a - b0, b - b0, c0, c1) if a < b and c1 > c0 else None
        slots.append(MatrixSlot(key, tuple(bshape), piece, (a - r0) * (c1 - c0) if piece else 0,
                                transposed=is_transposed(param)))
    return ParamBinding(param, _dtensor_flat, slots, group=group)


def expert_block_slots(param, name: str, ranges) -> list:
    """Slots of a 3-D expert stack ``[E, out, in]`` of which this rank holds the box
    ``ranges`` (experts ``[e0, e1)``, rows ``[o0, o1)``, columns ``[c0, c1)``): for each
    expert (and row block of :func:`ds_muon.split_rows`) the block it holds, at its offset
    in the local ``[e1-e0, o1-o0, c1-c0]`` shard (EP ``Shard(0)`` x FSDP2 ``Shard(1)``)."""
    (e0, e1), (o0, o1), (c0, c1) = ranges
    _, out, cols = (int(n) for n in param.shape)
    per_expert = (o1 - o0) * (c1 - c0)
    slots = []
    for key, bshape, start in logical_blocks(param, name):
        e, rest = divmod(start, out * cols)
        b0 = rest // cols
        b1 = b0 + bshape[0]
        a, b = max(o0, b0), min(o1, b1)
        held = e0 <= e < e1 and a < b and c1 > c0
        piece = Piece.block(tuple(bshape), a - b0, b - b0, c0, c1) if held else None
        offset = (e - e0) * per_expert + (a - o0) * (c1 - c0) if held else 0
        slots.append(MatrixSlot(key, tuple(bshape), piece, offset, transposed=is_transposed(param)))
    return slots
