"""Replicated parameters: no wrapper, or DDP.  Every rank holds every matrix whole."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout import MatrixSlot, ParamBinding, Piece


def _group_size(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def bind_replicated(param: torch.Tensor, name: str, group=None) -> ParamBinding:
    """Each rank of ``group`` holds the full tensor, ``[0, numel)`` of its flattening."""
    if not param.is_contiguous():
        raise ValueError(
            f"ds_muon: {name} (shape {tuple(param.shape)}) is not contiguous (channels_last?); "
            "Muon updates tensors in place through a flat view: make the parameter contiguous"
        )
    piece = Piece(0, param.numel())
    return ParamBinding(
        param=param,
        flat=lambda t: t.reshape(-1),
        matrices=[MatrixSlot(name, tuple(param.shape), piece, 0)],
        group=group,
    )
