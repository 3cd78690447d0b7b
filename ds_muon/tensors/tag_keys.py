"""The attributes ds_muon's tags set on a tensor, and their readers.

(On the ground floor, :mod:`ds_muon.tensors`.) :mod:`ds_muon.models.tags` writes them (``split_rows``, ``tensor_parallel``, ``expert_weight``, …: what a
tensor is, said by the model readers and by users); the engine and the stack adapters only read them
here, so the engine never depends on the model readers.
"""

from __future__ import annotations

from typing import Optional

import torch

from .shape import global_shape

SPLIT_ROWS = "_ds_muon_split_rows"  # tuple of (label, rows)
TENSOR_PARALLEL = "_ds_muon_tp"  # (tp group, partition_dim)
EXPERTS = "_ds_muon_experts"  # True: dim 0 indexes matrices
DOMAIN = "_ds_muon_domain"  # process group of the tensor's replicas / shards
TRANSPOSED = "_ds_muon_transposed"  # True: stored as [in, out] (GPT-2's Conv1D)
BLOCKS = "_ds_muon_blocks"  # tuple of (label, rows run, cols run): fused blocks, see fused_blocks
ROW_AXES = "_ds_muon_row_axes"  # int k > 1: the matrix is [prod(shape[:k]), rest] (per expert), see row_axes


def is_transposed(param: torch.Tensor) -> bool:
    return bool(getattr(param, TRANSPOSED, False))


def row_axes_of(param: torch.Tensor) -> int:
    """How many leading axes (after an expert stack's) are the rows of the matrix ``param`` holds (1 unless
    tagged :func:`ds_muon.row_axes`)."""
    return int(getattr(param, ROW_AXES, None) or 1)


def domain_of(param: torch.Tensor, default=None):
    """The process group a tensor's replicas live in: its :func:`domain` tag, else ``default``."""
    return getattr(param, DOMAIN, default)


def is_tagged(param: torch.Tensor) -> bool:
    """Does ``param`` carry a tag that changes which matrices it holds?"""
    return any(getattr(param, a, None) is not None for a in (SPLIT_ROWS, TENSOR_PARALLEL, BLOCKS)) or bool(
        getattr(param, EXPERTS, False)) or row_axes_of(param) != 1


SHAPE_TAGS = (SPLIT_ROWS, EXPERTS, TRANSPOSED, BLOCKS, ROW_AXES)  # which matrices a tensor holds, and how each scales


def shape_tags(param: torch.Tensor) -> Optional[dict]:
    """The tensor's shape tags as plain values, with its shape (None when untagged): what
    :func:`ds_muon.muon_param_groups` records in a group as ``param_tags``."""
    tags = {a: getattr(param, a) for a in SHAPE_TAGS if getattr(param, a, None)}
    return {"shape": tuple(global_shape(param)), **tags} if tags else None


def restore_tags(param: torch.Tensor, recorded: Optional[dict]) -> None:
    """Put recorded tags back on a tensor a stack swapped in for the tagged one (FSDP2's
    ``fully_shard`` or accelerate after the optimizer was built), so a fused expert stack is
    not silently one matrix.  Only on an untagged tensor of the recorded shape: a flat
    partition (DeepSpeed) or a tensor the user re-tagged is left as it is."""
    if not recorded or any(getattr(param, a, None) for a in SHAPE_TAGS):
        return
    if tuple(global_shape(param)) != tuple(recorded["shape"]):
        return
    for a in SHAPE_TAGS:
        if a in recorded:
            setattr(param, a, recorded[a])
