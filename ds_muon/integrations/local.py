"""Replicated parameters: no wrapper, or DDP.  Every rank holds every matrix whole."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout import MatrixSlot, ParamBinding, Piece
from ..tagging import TENSOR_PARALLEL, block_slots, domain_of, is_tagged, tp_slots


def bind_replicated(param: torch.Tensor, name: str, group=None) -> ParamBinding:
    """Each rank of ``group`` holds the full tensor, ``[0, numel)`` of its flattening.

    A :func:`~ds_muon.domain` tag replaces ``group``; split-row and expert tags make
    one slot per logical matrix (see :mod:`ds_muon.tagging`).
    """
    group = domain_of(param, group)
    if getattr(param, TENSOR_PARALLEL, None) is not None:
        return bind_tensor_parallel(param, name, group)
    if not param.is_contiguous():
        raise ValueError(
            f"ds_muon: {name} (shape {tuple(param.shape)}) is not contiguous (channels_last?); "
            "Muon updates tensors in place through a flat view: make the parameter contiguous"
        )
    piece = Piece(0, param.numel())
    slots = (block_slots(param, name, 0, param.numel()) if is_tagged(param)
             else [MatrixSlot(name, tuple(param.shape), piece, 0)])
    return ParamBinding(param=param, flat=lambda t: t.reshape(-1), matrices=slots, group=group)


def bind_tensor_parallel(param: torch.Tensor, name: str, group=None) -> ParamBinding:
    """A :func:`~ds_muon.tensor_parallel` shard: a row range (column-parallel) or column block
    (row-parallel) of the global weight; ``group`` spans tensor × data parallelism."""
    group = domain_of(param, group)
    tp_group = getattr(param, TENSOR_PARALLEL)[0]
    if dist.is_available() and dist.is_initialized() and tp_group is not None:
        outer = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        inner = set(dist.get_process_group_ranks(tp_group))
        if not inner <= outer:
            raise ValueError(
                f"ds_muon: {name}: its tensor-parallel group (ranks {sorted(inner)}) is not inside the group the "
                f"optimizer plans it in (ranks {sorted(outer)}); pass tensor_parallel(..., domain_group=) the "
                "group spanning tensor and data parallelism")
    return ParamBinding(param=param, flat=lambda t: t.reshape(-1), matrices=tp_slots(param, name), group=group)
