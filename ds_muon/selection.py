"""Which tensors take Muon: hidden weight matrices.  Everything else takes AdamW.

Embeddings and the output head are matrices too, but Muon's orthogonal update is
wrong for them (their rows are looked up, not mixed), so they go to AdamW along
with norms and biases.  A head is a weight tied to an embedding or one whose
module is named like ``lm_head``/``head``/``output``/``classifier``.  Routers and
expert biases of MoE layers take AdamW too (:func:`ds_muon.experts.takes_adamw`).

The rules read a model (:func:`split_params`) or one original tensor of a model a
stack flattened (:func:`is_muon_param`, FSDP1); :mod:`ds_muon.param_groups` and
the FSDP1 adapter both apply them.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from torch import nn

from .experts import takes_adamw
from .layout import global_shape

HEAD_NAMES: Tuple[str, ...] = ("lm_head", "head", "output", "classifier")
EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)


def split_params(
    model: nn.Module, head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw"
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
        head_ids.update(id(p) for n, p in direct if takes_adamw(mod, n, routers))  # routers, expert biases
    muon, adam = [], []
    for name, p in model.named_parameters():  # a tied weight appears once
        if not p.requires_grad:
            continue
        if len(global_shape(p)) >= 2 and id(p) not in embedding_ids and id(p) not in head_ids:
            muon.append((name, p))
        else:
            adam.append((name, p))
    return muon, adam


def is_muon_param(name: str, shape: Sequence[int], module_name: str, module: nn.Module,
                  head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw") -> bool:
    """The same rule for one original tensor (used where parameters are flattened, FSDP1)."""
    return (len(shape) >= 2 and not isinstance(module, EMBEDDING_TYPES)
            and module_name.rsplit(".", 1)[-1] not in head_names and not takes_adamw(module, name, routers))


def stores_in_out(module: nn.Module, pname: str) -> bool:
    """transformers' ``Conv1D`` (GPT-2) stores its weight ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and pname == "weight"
