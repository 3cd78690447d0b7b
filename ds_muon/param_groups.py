"""Which tensors take Muon: hidden weight matrices.  Everything else takes AdamW.

Embeddings and the output head are matrices too, but Muon's orthogonal update is
wrong for them (their rows are looked up, not mixed), so they go to AdamW along
with norms and biases.  A head is a weight tied to an embedding or one whose
module is named like ``lm_head``/``head``/``output``/``classifier``.
"""

from __future__ import annotations

from typing import Iterable, List, Sequence, Tuple

import torch
from torch import nn

HEAD_NAMES: Tuple[str, ...] = ("lm_head", "head", "output", "classifier")
EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)


def split_params(
    model: nn.Module, head_names: Sequence[str] = HEAD_NAMES
) -> Tuple[List[Tuple[str, nn.Parameter]], List[Tuple[str, nn.Parameter]]]:
    """(muon, adamw) lists of ``(name, parameter)`` in ``model.named_parameters()`` order."""
    embedding_ids = set()
    head_ids = set()
    for mod_name, mod in model.named_modules():
        direct = list(mod.named_parameters(recurse=False))
        if isinstance(mod, EMBEDDING_TYPES):
            embedding_ids.update(id(p) for _, p in direct)
        last = mod_name.rsplit(".", 1)[-1]
        if last in head_names:
            head_ids.update(id(p) for _, p in direct)
    muon, adam = [], []
    for name, p in model.named_parameters():  # a tied weight appears once
        if not p.requires_grad:
            continue
        if p.ndim >= 2 and id(p) not in embedding_ids and id(p) not in head_ids:
            muon.append((name, p))
        else:
            adam.append((name, p))
    return muon, adam


def is_muon_param(name: str, shape: Sequence[int], module_name: str, module: nn.Module,
                  head_names: Sequence[str] = HEAD_NAMES) -> bool:
    """The same rule for one original tensor (used where parameters are flattened, FSDP1)."""
    return (len(shape) >= 2 and not isinstance(module, EMBEDDING_TYPES)
            and module_name.rsplit(".", 1)[-1] not in head_names)


def muon_param_groups(
    model: nn.Module,
    lr: float = 0.02,
    adam_lr: float = 3e-4,
    weight_decay: float = 0.0,
    adam_weight_decay: float = 0.0,
    head_names: Sequence[str] = HEAD_NAMES,
    **muon_options,
) -> List[dict]:
    """Param groups for :class:`ds_muon.Muon`: one Muon group, one AdamW group.

    Groups record ``param_names`` so errors and reports can name tensors.  An
    FSDP1-wrapped model is read through its flat parameters' metadata.
    ``head_names`` overrides which module names count as output heads; extra
    keyword arguments go into the Muon group (e.g. ``ns_steps=6``).
    """
    from .integrations.fsdp import is_fsdp1_model

    if is_fsdp1_model(model):  # FSDP1 hides original shapes: read them from its flat parameters
        from .integrations.fsdp import fsdp_param_groups

        return fsdp_param_groups(model, lr, adam_lr, weight_decay, adam_weight_decay, head_names, **muon_options)
    muon, adam = split_params(model, head_names)
    if not muon and not adam:
        raise ValueError("muon_param_groups: the model has no trainable parameters")
    groups = []
    if muon:
        groups.append({"params": [p for _, p in muon], "param_names": [n for n, _ in muon], "use_muon": True,
                       "lr": lr, "weight_decay": weight_decay, **muon_options})
    if adam:
        groups.append({"params": [p for _, p in adam], "param_names": [n for n, _ in adam], "use_muon": False,
                       "lr": adam_lr, "weight_decay": adam_weight_decay})
    return groups
