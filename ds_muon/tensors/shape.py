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


def matrix_shape(shape: Sequence[int]) -> Tuple[int, int]:
    """The 2-D shape Muon orthogonalizes: ``[shape[0], prod(shape[1:])]``."""
    return int(shape[0]), int(math.prod(shape[1:]))
