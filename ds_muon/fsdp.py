"""PyTorch FSDP, the front door: param groups for a model already wrapped.

The adapters that describe FSDP's shards are :mod:`~ds_muon.integrations.fsdp1`
(``FullyShardedDataParallel``) and :mod:`~ds_muon.integrations.fsdp2`
(``fully_shard``); the optimizer picks them by itself.
"""

from __future__ import annotations

from typing import List, Sequence

from torch import nn

from .integrations.fsdp1 import fsdp1_param_groups, is_fsdp1_model
from .models.names import HEAD_NAMES
from .param_groups import muon_param_groups


def fsdp_param_groups(model: nn.Module, lr: float = 0.02, adam_lr: float = 3e-4, weight_decay: float = 0.0,
                      adam_weight_decay: float = 0.0, head_names: Sequence[str] = HEAD_NAMES,
                      routers: str = "adamw", **muon_options) -> List[dict]:
    """:func:`ds_muon.muon_param_groups` for a model already wrapped by FSDP1 (or FSDP2).

    FSDP1: :func:`~ds_muon.integrations.fsdp1.fsdp1_param_groups` (original tensors split
    by their original shapes, flat parameters in the Muon group).  FSDP2 keeps global
    shapes, so it is plain ``muon_param_groups``.
    """
    if not is_fsdp1_model(model):
        return muon_param_groups(model, lr, adam_lr, weight_decay, adam_weight_decay, head_names, routers=routers,
                                 **muon_options)
    return fsdp1_param_groups(model, lr, adam_lr, weight_decay, adam_weight_decay, head_names, routers=routers,
                              **muon_options)
