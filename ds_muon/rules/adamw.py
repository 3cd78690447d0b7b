"""AdamW, the rule for every tensor Muon does not orthogonalize, on lists of tensors.

torch's own functional AdamW (or an opt-in kernel of the same signature, e.g.
:class:`~ds_muon.integrations.deepspeed_cpu_adam.DeepSpeedCPUAdamKernel`) does the update, so a
tensor steps bitwise as under ``torch.optim.AdamW``; the decay modes torch does not know
(independent, cautious) are applied first (:func:`~ds_muon.rules.decay.adamw_decay_`).  The engine
hands it the tensors it holds: local shards, or the AdamW slices of a mixed flat shard.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch.optim.adamw import adamw as functional_adamw

from .decay import adamw_decay_


def adamw_(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
           exp_avg_sqs: List[torch.Tensor], steps: List[torch.Tensor], *, lr, betas: Tuple[float, float],
           eps: float, weight_decay: float, weight_decay_mode: str = "decoupled", foreach: Optional[bool] = None,
           kernel: Optional[Callable] = None) -> None:
    """One AdamW step in place on ``params`` (their moments and step counts move too).

    ``kernel``: torch's functional ``adamw`` when None.  Nothing to do for empty lists."""
    if not params:
        return
    beta1, beta2 = betas
    decay = adamw_decay_(params, grads, exp_avgs, weight_decay_mode, lr, weight_decay, beta1)  # decoupled: below
    (kernel or functional_adamw)(
        params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=foreach, amsgrad=False, beta1=beta1,
        beta2=beta2, lr=lr, weight_decay=decay, eps=eps, maximize=False,
    )
