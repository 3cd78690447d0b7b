"""A parameter's shape in the model, wherever a stack hides it, and the matrix Muon sees of it."""

from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch


def global_shape(t: torch.Tensor) -> Tuple[int, ...]:
    """The shape a parameter has in the model, wherever a stack hides it.

    ZeRO-3 (``deepspeed.zero.Init``, HF ``from_pretrained`` under ZeRO-3) leaves
    parameters of shape ``(0,)`` outside forward and keeps the real shape in
    ``ds_shape``; everything else (DTensors included) reports its global shape.
    """
    ds_shape = getattr(t, "ds_shape", None)
    return tuple(int(s) for s in (ds_shape if ds_shape is not None else t.shape))


def matrix_shape(shape: Sequence[int], row_axes: int = 1) -> Tuple[int, int]:
    """The 2-D shape Muon orthogonalizes: ``[prod(shape[:row_axes]), prod(shape[row_axes:])]`` (by default
    ``[shape[0], rest]``): a run of leading axes as rows and the rest as columns, a contiguous view of the
    tensor's row-major elements whatever ``row_axes`` is."""
    return int(math.prod(shape[:row_axes])), int(math.prod(shape[row_axes:]))
