"""The maths of one Muon update on a rank's piece of a matrix, as pure functions on tensors.

The step and the overlapped paths (a gather sent from backward, a result applied in the
next forward) all call these, so they run the same operations in the same order and stay
bitwise equal.  ``group`` is the tensor's param group (read, never written).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .decay import Decay, decay_, decay_of
from .scaling import get_muon_scale_factor


def to_device_of(params: List[torch.Tensor], results: List[torch.Tensor]) -> List[torch.Tensor]:
    """Results computed on the accelerator for pieces held on the host, copied to the host
    (one copy each; unchanged when they are already where the pieces are)."""
    if not results or results[0].device == params[0].device:
        return results
    return [r.to(p.device) for p, r in zip(params, results)]


ONE_CALL_NUMEL = 1 << 14  # pieces from this size take a call of their own (ns_input's Nesterov)


def ns_input(grads: List[torch.Tensor], bufs: List[torch.Tensor], params: List[torch.Tensor], group: dict,
             commit: bool = True, out: Optional[List[torch.Tensor]] = None, only: Optional[List[int]] = None
             ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """What NS orthogonalizes, from pieces of gradients, momentum buffers and parameters
    (lists of flat tensors of equal sizes, all of one param group ``group``): L2 weight decay
    (``weight_decay_mode="l2"``), the momentum lerp, then Nesterov.

    One ``torch._foreach_*`` call per operation for all the pieces (the same arithmetic per
    element as the single-tensor ops, so results do not depend on how pieces are batched).
    ``commit=True`` updates ``bufs`` in place; ``commit=False`` leaves them alone (a wave sent
    from backward commits only once the step has agreed the gradients are good).
    ``out`` (tensors shaped like ``grads``, kept by the caller) receives the Nesterov inputs in
    place of new tensors: the same lerp, of a copy of ``grads``.  ``only`` (positions): the pieces
    whose inputs are wanted (every momentum moves; with Nesterov only those get an input).
    Returns ``(inputs, new momenta)``.
    """
    if not grads:
        return [], []
    if group["weight_decay"] and group["weight_decay_mode"] == "l2":
        grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
    if commit:
        torch._foreach_lerp_(bufs, grads, 1 - group["momentum"])
        new = list(bufs)
    else:
        new = list(torch._foreach_lerp(bufs, grads, 1 - group["momentum"]))
    if not group["nesterov"]:
        return (new if only is None else [new[k] for k in only]), new
    if only is not None:
        grads, wanted = [grads[k] for k in only], [new[k] for k in only]
    else:
        wanted = new
    if not grads:
        return [], new
    if out is not None:
        # large pieces: one lerp each straight into ``out`` (one pass, where a copy then an in-place lerp made
        # two: 1.6 of the wide bank's 47 ms on the Intel AMX box); small ones: two foreach calls, not one call
        # each.  The same lerp of the same operands either way, so the same bits
        small = [k for k, g in enumerate(grads) if g.numel() < ONE_CALL_NUMEL]
        for o, g, w in zip(out, grads, wanted):
            if g.numel() >= ONE_CALL_NUMEL:
                torch.lerp(g, w, group["momentum"], out=o)
        if small:
            torch._foreach_copy_([out[k] for k in small], [grads[k] for k in small])
            torch._foreach_lerp_([out[k] for k in small], [wanted[k] for k in small], group["momentum"])
        return out, new
    return list(torch._foreach_lerp(grads, wanted, group["momentum"])), new


def apply_coefficients(group: dict, matrix_shape: Tuple[int, int], transposed: bool) -> Tuple[Decay, float]:
    """``(decay, alpha)`` for :func:`apply_result`, read from ``group`` now (a scheduler
    stepping before a deferred apply must not change this step's update).  ``decay``
    (:func:`ds_muon.rules.decay.decay_of`): None without weight decay on the weight (none, or
    ``l2``), a factor (decoupled, independent) or a cautious factor."""
    lr = float(group["lr"])  # a tensor lr (as torch.optim allows) is read as a number here
    decay = decay_of(group["weight_decay_mode"], lr, group["weight_decay"])
    rows, cols = matrix_shape
    if transposed:  # stored [in, out]: the layer maps cols -> rows the other way
        rows, cols = cols, rows
    alpha = -lr * get_muon_scale_factor(rows, cols, group["scale_mode"], group["extra_scale_factor"])
    return decay, alpha


def apply_result(params: List[torch.Tensor], results: List[torch.Tensor], decay: Decay,
                 alpha: float, all_flat: bool = False) -> None:
    """``param = param * decay + alpha * result`` in place, for pieces (flat) that share
    ``decay`` and ``alpha``; one ``torch._foreach_*`` call per operation (cautious decay:
    only where ``param * result >= 0``, :mod:`ds_muon.rules.decay`).  A result may be a
    ``[rows, length]`` piece (a column block), shaped here like its parameter piece (flat, or a
    strided view of a fused block) unless the caller says ``all_flat``."""
    if not params:
        return
    results = to_device_of(params, results)  # NS ran on the accelerator for host pieces (offload)
    if not all_flat:
        results = [r if r.shape == p.shape else r.reshape(p.shape) for p, r in zip(params, results)]
    decay_(params, results, decay)
    torch._foreach_add_(params, results, alpha=alpha)
