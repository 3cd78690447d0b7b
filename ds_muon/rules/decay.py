"""Weight decay modes: what each does to a weight, as pure functions on tensors.

``weight_decay_mode`` (a group key, like ``lr``) with ``wd = weight_decay``:

=============  ==========================================================================
decoupled      ``p <- p * (1 - lr * wd)`` before the update (AdamW's, torch.optim.Muon's)
l2             ``g <- g + wd * p`` before the momentum (classic L2: Muon matrices only,
               see :func:`adamw_decay_`)
independent    ``p <- p * (1 - wd)`` before the update: not tied to ``lr`` (a scheduled
               ``lr`` leaves the decay alone), as NVIDIA Emerging-Optimizers'
               ``weight_decay_method="independent"`` (which writes ``p <- p - wd * p``)
cautious       ``p <- p * (1 - lr * wd)`` only where ``p * u >= 0``, ``p`` unchanged
               elsewhere, as dion's ``cautious_wd`` (Cautious Weight Decay, arXiv
               2510.12402: decay only where the update and the weight agree in sign)
=============  ==========================================================================

Cautious, exactly: ``u`` is the update *direction* the step subtracts — for a Muon matrix
the orthogonalized result at the apply (NS output, after any rule that reshapes it, before
the ``-lr * scale`` factor, whose sign is fixed), for an AdamW tensor the new first moment
``m_t`` (the sign of ``m_t / (sqrt(v_t) + eps)``).  The mask is read on the weight *before*
this step's decay and update: ``p * u >= 0``, the product taken in float32 (or wider), zero
counting as agreeing, as dion's ``min(sign(X * U) + 1, 1)``.  A decayed element gets the same
bits as decoupled decay would give it, so with every sign agreeing cautious equals decoupled
bitwise.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Union

import torch

WEIGHT_DECAY_MODES = ("decoupled", "l2", "independent", "cautious")


class Cautious(NamedTuple):
    """Decay by ``factor`` only where the weight and the update direction agree in sign."""

    factor: float


Decay = Union[None, float, Cautious]


def decay_of(mode: str, lr, weight_decay: float) -> Decay:
    """What the apply does to the weight before adding the update: None (nothing: no decay,
    or ``l2``, which acts on the gradient), a factor every element is multiplied by, or
    :class:`Cautious`.  ``lr``: the number the step reads now (a tensor lr as torch's AdamW
    reads it)."""
    if not weight_decay or mode == "l2":
        return None
    if torch.is_tensor(lr):  # torch.optim allows a 1-element tensor lr
        lr = lr.item()
    if mode == "independent":
        return 1 - weight_decay
    if mode == "decoupled":
        return 1 - lr * weight_decay
    if mode == "cautious":
        return Cautious(1 - lr * weight_decay)
    raise ValueError(f"weight_decay_mode={mode!r} is unknown; use one of {list(WEIGHT_DECAY_MODES)}")


def decay_(params: List[torch.Tensor], directions: List[torch.Tensor], decay: Decay) -> None:
    """Apply ``decay`` (:func:`decay_of`) to ``params`` in place; ``directions`` (shaped like
    ``params``): the update direction each will move against, read only by cautious decay."""
    if decay is None or not params:
        return
    if not isinstance(decay, Cautious):
        torch._foreach_mul_(params, decay)
        return
    # p * u in float32 (or wider): u copied there first, then multiplied in place (a product of mixed
    # dtypes, fp32 weights by a bf16 result, is several times slower on CPU)
    agree = [torch.empty(p.shape, dtype=torch.promote_types(torch.promote_types(p.dtype, u.dtype), torch.float32),
                         device=p.device).copy_(u) for p, u in zip(params, directions)]
    torch._foreach_mul_(agree, params)
    for a in agree:
        a.ge_(0)  # 1 where p * u >= 0, else 0
    exact = 0.5 <= decay.factor <= 1.0  # (p * factor is then within 2x of p: Sterbenz)
    if exact and all(a.dtype == p.dtype for a, p in zip(agree, params)):
        # fp32/fp64 weights: multiply by 1 + agree * (factor - 1), which is exactly factor (as a multiply
        # of these weights by it rounds it: factor - 1 is exact) or 1; the fastest form on CPU
        factor = torch.tensor(decay.factor, dtype=params[0].dtype).item()
        torch._foreach_mul_(agree, factor - 1.0)
        torch._foreach_add_(agree, 1.0)
        torch._foreach_mul_(params, agree)
        return
    # bf16/fp16 weights: decoupled decay's own multiply (in place, on CPU, it rounds the factor to the
    # weights' dtype; torch's other multiplies do not), then p + agree * (p * factor - p), exact too
    steps = [p.clone() for p in params]
    torch._foreach_mul_(steps, decay.factor)
    if exact:
        torch._foreach_sub_(steps, params)
        torch._foreach_mul_(steps, agree)
        torch._foreach_add_(params, steps)
        return
    for p, a, d in zip(params, agree, steps):  # lr * weight_decay above 0.5: the plain select
        p.copy_(torch.where(a.bool(), d, p))


def adamw_decay_(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                 mode: str, lr, weight_decay: float, beta1: float) -> float:
    """The decay of AdamW tensors under ``mode``; returns the ``weight_decay`` left for torch's
    AdamW (which only knows decoupled decay, ``p * (1 - lr * wd)`` first).

    decoupled and l2: torch's AdamW decays them (``l2`` is Muon's gradient-side decay; an
    AdamW tensor decays decoupled under it, as it always has).  independent and cautious:
    applied here to the weights before AdamW runs with ``weight_decay=0`` (the same order
    as torch's), cautious reading the sign of the new first moment
    ``m_t = lerp(m, g, 1 - beta1)`` (torch's AdamW computes the same ``m_t`` from the same
    values next)."""
    if not weight_decay or mode in ("decoupled", "l2") or not params:
        return weight_decay
    decay = decay_of(mode, lr, weight_decay)
    directions = torch._foreach_lerp(exp_avgs, grads, 1 - beta1) if isinstance(decay, Cautious) else params
    decay_(params, directions, decay)
    return 0.0


def check_mode(mode) -> Optional[str]:
    """None when ``mode`` is a weight decay mode, else the error text."""
    if isinstance(mode, str) and mode in WEIGHT_DECAY_MODES:
        return None
    return f"weight_decay_mode={mode!r} is unknown; use one of {list(WEIGHT_DECAY_MODES)}"
