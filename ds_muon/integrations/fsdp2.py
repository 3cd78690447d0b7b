"""PyTorch FSDP2 (``fully_shard``): parameters are DTensors sharded by rows.

Parameters are DTensors sharded ``Shard(0)`` over the shard dimension of their
mesh (HSDP: ``(Replicate(), Shard(0))``).  A rank holds a contiguous row range
(uneven, possibly empty) = a contiguous range of the row-major flattening.
Updates go into ``p.to_local()``, a view of the storage FSDP all-gathers from.
The Layout's group is the shard dimension's process group, so HSDP replicas
each plan the same homes within their own shard group.  FSDP2 reduce-scatters a
gradient before the parameter's post-accumulate-grad hook fires, so the gradient
is final there.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layout import _DTENSOR, MatrixSlot, ParamBinding, Piece, matrix_shape
from ..slots import block_slots
from ..tags import is_tagged, is_transposed
from .base import BindContext


class Fsdp2Adapter:
    """DTensor parameters of ``fully_shard`` (FSDP2/HSDP)."""

    applies_in_step = False
    data_parallel_group = None

    def __init__(self):
        self._units: Optional[tuple] = None  # (id(model), ids of the parameters of its fully_shard units)

    def bind(self, param: torch.Tensor, name: str, context: BindContext) -> ParamBinding:
        return bind_fsdp2(param, name)

    def grad_final_at_hook(self, param: torch.Tensor, context: BindContext) -> bool:
        """For a parameter of a ``fully_shard`` unit of ``context.model``: FSDP2 calls the hook
        right after reduce-scattering it (a DTensor distributed by hand is reduced by nobody)."""
        if context.model is None:
            return False
        if self._units is None or self._units[0] != id(context.model) or id(param) not in self._units[1]:
            self._units = (id(context.model), _fully_sharded(context.model))  # rebuilt once a parameter is new
        return id(param) in self._units[1]


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


def _fsdp2_shard_dim(param, name: str) -> Optional[int]:
    """The mesh dimension that shards ``param`` by rows, None when it is replicated on every dim."""
    from torch.distributed.tensor import Replicate, Shard

    shard_dims = []
    for mesh_dim, pl in enumerate(param.placements):
        if type(pl) is Shard and pl.dim == 0:
            shard_dims.append(mesh_dim)
        elif not isinstance(pl, Replicate):
            raise NotImplementedError(
                f"ds_muon: {name} is a DTensor placed {tuple(param.placements)} on mesh dims "
                f"{param.device_mesh.mesh_dim_names or param.device_mesh.ndim}; ds_muon supports FSDP2/HSDP "
                f"row sharding only (Shard(0), optionally with Replicate()), not {pl}. Put this tensor in an "
                "AdamW group (use_muon=False) or shard it with fully_shard's default placement"
            )
    if len(shard_dims) > 1:
        raise NotImplementedError(
            f"ds_muon: {name} is sharded by rows on {len(shard_dims)} mesh dims {tuple(param.placements)}; "
            "ds_muon supports one Shard(0) mesh dim (FSDP2, or HSDP's (Replicate(), Shard(0)))"
        )
    return shard_dims[0] if shard_dims else None


def bind_fsdp2(param, name: str) -> ParamBinding:
    """A DTensor parameter sharded ``Shard(0)`` (FSDP2/HSDP): this rank's row range."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if param.ndim < 2:
        raise ValueError(
            f"ds_muon: {name} has shape {tuple(param.shape)}; Muon needs matrices (ndim >= 2). Put it in an "
            "AdamW group (use_muon=False), e.g. with ds_muon.muon_param_groups(model)"
        )
    shard_dim = _fsdp2_shard_dim(param, name)
    mesh = param.device_mesh
    local = param.to_local()
    if not local.is_contiguous():
        raise ValueError(
            f"ds_muon: the local shard of {name} is not contiguous (strides {local.stride()}); Muon updates "
            "it in place through a flat view"
        )
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, param.placements)
    if tuple(local_shape) != tuple(local.shape):
        raise ValueError(
            f"ds_muon: {name}: the DTensor's placements say the local shard is {tuple(local_shape)} but it "
            f"is {tuple(local.shape)}; the shard does not match its metadata"
        )
    _, cols = matrix_shape(param.shape)
    rows_local = int(local_shape[0])
    piece = Piece(int(offset[0]) * cols, rows_local * cols) if rows_local * cols > 0 else None
    group = mesh.get_group(shard_dim if shard_dim is not None else 0)
    if is_tagged(param):  # split rows / experts: blocks clipped to this rank's row range
        lo = int(offset[0]) * cols
        return ParamBinding(param, _dtensor_flat, block_slots(param, name, lo, lo + rows_local * cols), group=group)
    return ParamBinding(param, _dtensor_flat, [MatrixSlot(name, tuple(param.shape), piece, 0, transposed=is_transposed(param))],
                        group=group)
