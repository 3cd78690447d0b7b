"""The maths of one Muon update on a rank's piece of a matrix, as pure functions on tensors.

The step and the overlapped paths (a gather sent from backward, a result applied in the
next forward) all call these, so they run the same operations in the same order and stay
bitwise equal.  ``group`` is the tensor's param group (read, never written).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .scaling import get_muon_scale_factor


def ns_input(grad: torch.Tensor, buf: torch.Tensor, param: torch.Tensor, group: dict,
             commit: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """What NS orthogonalizes, from a piece of the gradient, momentum buffer and parameter:
    L2 weight decay (``weight_decay_mode="l2"``), the momentum lerp, then Nesterov.

    ``commit=True`` updates ``buf`` in place; ``commit=False`` leaves it alone (a wave sent
    from backward commits only once the step has agreed the gradients are good).
    Returns ``(input, new momentum)``.
    """
    if group["weight_decay"] and group["weight_decay_mode"] == "l2":
        grad = grad.add(param, alpha=group["weight_decay"])
    if commit:
        new = buf.lerp_(grad, 1 - group["momentum"])
    else:
        new = buf.lerp(grad, 1 - group["momentum"])
    return (grad.lerp(new, group["momentum"]) if group["nesterov"] else new), new


def apply_coefficients(group: dict, matrix_shape: Tuple[int, int], transposed: bool) -> Tuple[Optional[float], float]:
    """``(decay, alpha)`` for :func:`apply_result`, read from ``group`` now (a scheduler
    stepping before a deferred apply must not change this step's update).  ``decay`` is
    None without decoupled weight decay."""
    lr = float(group["lr"])  # a tensor lr (as torch.optim allows) is read as a number here
    decay = None
    if group["weight_decay"] and group["weight_decay_mode"] == "decoupled":
        decay = 1 - lr * group["weight_decay"]
    rows, cols = matrix_shape
    if transposed:  # stored [in, out]: the layer maps cols -> rows the other way
        rows, cols = cols, rows
    alpha = -lr * get_muon_scale_factor(rows, cols, group["scale_mode"], group["extra_scale_factor"])
    return decay, alpha


def apply_result(param: torch.Tensor, result: torch.Tensor, decay: Optional[float], alpha: float) -> None:
    """``param = param * decay + alpha * result``, in place on the rank's piece."""
    if decay is not None:
        param.mul_(decay)
    param.add_(result.reshape(-1), alpha=alpha)
