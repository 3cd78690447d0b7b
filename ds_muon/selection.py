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

from typing import Dict, List, Sequence, Tuple

from torch import nn

from .experts import adamw_role
from .layout import global_shape

HEAD_NAMES: Tuple[str, ...] = ("lm_head", "head", "output", "classifier")
EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)


HIDDEN_MATRIX = "hidden matrix"  # the reason a tensor takes Muon; every other reason means AdamW
EMBEDDING, OUTPUT_HEAD = "embedding", "output head"


def _role(module_name: str, module: nn.Module, pname: str, head_names: Sequence[str], routers: str):
    """The module role that sends a tensor to AdamW whatever its shape (None: none does)."""
    if isinstance(module, EMBEDDING_TYPES):
        return EMBEDDING
    if module_name.rsplit(".", 1)[-1] in head_names:
        return OUTPUT_HEAD
    return adamw_role(module, pname, routers)  # routers, expert biases


def param_reasons(model: nn.Module, head_names: Sequence[str] = HEAD_NAMES,
                  routers: str = "adamw") -> Dict[int, str]:
    """Why each trainable parameter (by id) takes Muon (:data:`HIDDEN_MATRIX`) or AdamW: the rules
    of this module, the one place they are decided.  AdamW reasons are the roles of the modules that
    own it (``"embedding"``, ``"output head"``, ``"router"``, ``"expert bias"``; a tied weight may
    have two, joined by ", "), else ``"1-D"`` (``"0-D"``) for tensors that are not matrices."""
    roles: Dict[int, List[str]] = {}
    for mod_name, mod in model.named_modules():
        for n, p in mod.named_parameters(recurse=False):
            role = _role(mod_name, mod, n, head_names, routers)
            if role is not None and role not in roles.setdefault(id(p), []):
                roles[id(p)].append(role)
    out: Dict[int, str] = {}
    for _, p in model.named_parameters():  # a tied weight appears once
        if p.requires_grad:
            out[id(p)] = ", ".join(roles.get(id(p), [])) or _by_shape(global_shape(p))
    return out


def _by_shape(shape: Sequence[int]) -> str:
    return HIDDEN_MATRIX if len(shape) >= 2 else f"{len(shape)}-D"


def split_params(
    model: nn.Module, head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw"
) -> Tuple[List[Tuple[str, nn.Parameter]], List[Tuple[str, nn.Parameter]]]:
    """(muon, adamw) lists of ``(name, parameter)`` in ``model.named_parameters()`` order."""
    reasons = param_reasons(model, head_names, routers)
    muon, adam = [], []
    for name, p in model.named_parameters():  # a tied weight appears once
        if id(p) in reasons:
            (muon if reasons[id(p)] == HIDDEN_MATRIX else adam).append((name, p))
    return muon, adam


def param_reason(name: str, shape: Sequence[int], module_name: str, module: nn.Module,
                 head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw") -> str:
    """:func:`param_reasons` for one original tensor of ``module`` (where parameters are flattened, FSDP1)."""
    return _role(module_name, module, name, head_names, routers) or _by_shape(shape)


def is_muon_param(name: str, shape: Sequence[int], module_name: str, module: nn.Module,
                  head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw") -> bool:
    """The same rule for one original tensor (used where parameters are flattened, FSDP1)."""
    return param_reason(name, shape, module_name, module, head_names, routers) == HIDDEN_MATRIX


def stores_in_out(module: nn.Module, pname: str) -> bool:
    """transformers' ``Conv1D`` (GPT-2) stores its weight ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and pname == "weight"
