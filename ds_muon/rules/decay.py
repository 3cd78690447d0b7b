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
this step's decay and update, ``p * u >= 0`` in the product's dtype (zero counts as
agreeing; the product in float32, or wider), as dion's ``min(sign(X * U) + 1, 1)``.  A decayed
element gets the same bits as decoupled decay would give it (the same multiply), so with every
sign agreeing cautious equals decoupled bitwise.
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
    signs = [torch.empty(p.shape, dtype=torch.promote_types(torch.promote_types(p.dtype, u.dtype), torch.float32),
                         device=p.device).copy_(u) for p, u in zip(params, directions)]
    torch._foreach_mul_(signs, params)
    dtypes = {p.dtype for p in params}
    # the value decoupled decay's multiply uses: torch._foreach_mul_ (in place) rounds its scalar to the
    # weights' dtype (bf16: 0.998 -> 0.99609375; torch's out-of-place multiplies keep it in float32)
    factor = torch.tensor(decay.factor, dtype=dtypes.pop()).item() if len(dtypes) == 1 else None
    if factor is not None and 0.5 <= factor <= 1.0:
        # the multiplier 1 + agree * (factor - 1) is exactly factor or 1 (factor - 1 is exact: Sterbenz),
        # so a decayed element gets the bits decoupled decay gives it; cheaper than torch.where on CPU
        for s in signs:
            s.ge_(0)
        torch._foreach_mul_(signs, factor - 1.0)
        torch._foreach_add_(signs, 1.0)
        torch._foreach_mul_(params, signs)
        return
    decayed = [p.clone() for p in params]  # lr * weight_decay above 0.5: the plain select
    torch._foreach_mul_(decayed, decay.factor)  # (in place: torch's out-of-place form rounds bf16 otherwise)
    for p, s, d in zip(params, signs, decayed):
        p.copy_(torch.where(s >= 0, d, p))


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
