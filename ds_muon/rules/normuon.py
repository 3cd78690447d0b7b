"""NorMuon (Li et al., arXiv 2510.05491): a per-neuron second moment of the orthogonalized update.

Newton–Schulz gives every singular direction the same size, but the rows of the result (one per
output neuron of the layer) can still differ widely in norm.  NorMuon keeps an Adam-like running
mean of each neuron's mean square and divides it out, then rescales the whole matrix back to the
Frobenius norm it had after NS, so Muon's usual shape scaling and learning rate still apply:

    v ← β₂·v + (1 − β₂)·mean_cols(O ⊙ O)       (one value per output neuron)
    O' ← O / (√v + ε)                           (each row divided by its own √v)
    O' ← O' · ‖O‖_F / max(‖O'‖_F, ε)            (the norm O had before the normalization)

This is the rescale of the paper's reference code and of Dion's NorMuon (``norm_U / norm_U_new``),
not ``0.2·√(mn)/‖O‖_F``.  ``v`` starts at zero and has no bias correction (as both do).

"Rows" are the layer's output neurons: rows of a weight stored ``[out, in]`` (``nn.Linear``), columns
of one stored ``[in, out]`` (``transformers``' ``Conv1D``, a tensor tagged :func:`ds_muon.transposed`): pass
``transposed=True`` for those.  The maths runs in float32 (``v`` is always float32) and the result
is cast back to O's dtype, so whoever receives O (the home itself or a holder it scatters to) sees
the same bits.

Pure functions: the engine calls :func:`normalize` on each matrix of a home's stack after NS
(one matrix at a time, so the bits do not depend on how many matrices share the stack).
"""

from __future__ import annotations

from typing import Tuple

import torch

VARIANTS = ("muon", "normuon")
EPS = 1e-8  # the floor of √v and of the normalized norm (Dion's NorMuon uses the same)


def neurons(shape: Tuple[int, int], transposed: bool) -> int:
    """How many output neurons (entries of ``v``) a ``rows × cols`` matrix has."""
    rows, cols = shape
    return cols if transposed else rows


def normalize(o: torch.Tensor, v: torch.Tensor, beta2: float, transposed: bool = False,
              eps: float = EPS) -> Tuple[torch.Tensor, torch.Tensor]:
    """NorMuon's step on one orthogonalized matrix ``o`` (``[rows, cols]``, any float dtype) with its
    second moment ``v`` (float32, ``[neurons(o.shape, transposed)]``).

    Returns ``(o', v')``: ``o'`` in ``o``'s dtype and layout, ``v'`` a new float32 tensor (``v`` is
    not written: the engine decides where the new moment goes)."""
    x = o.float()
    if transposed:
        x = x.t()  # output neurons first
    v = v.to(device=x.device, dtype=torch.float32)
    norm = torch.linalg.vector_norm(x)
    v_new = torch.lerp(v, (x * x).mean(dim=1), 1.0 - beta2)
    y = x / (v_new.sqrt() + eps).unsqueeze(1)
    y = y * (norm / torch.linalg.vector_norm(y).clamp_min(eps))
    if transposed:
        y = y.t()
    return y.to(o.dtype), v_new
