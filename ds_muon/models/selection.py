"""Which tensors take Muon: weights their modules apply as linear maps of hidden features.
Everything else takes AdamW.

The rules live in :mod:`ds_muon.models.decide` (module types, the model's API for its ends, the config,
the traced forward, names); this module is the entry point every path calls.  It reads a model
(:func:`split_params`, :func:`param_reasons`) or one original tensor of a model a stack
flattened (:func:`param_reason`, FSDP1).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from torch import nn

from .decide import decide
from .evidence import rules_of
from .reading import classify
from .kinds import EMBEDDING, HIDDEN_MATRIX, OUTPUT_HEAD
from .module_types import EMBEDDING_TYPES, stores_in_out  # noqa: F401
from .names import HEAD_NAMES

__all__ = ["HEAD_NAMES", "EMBEDDING_TYPES", "HIDDEN_MATRIX", "EMBEDDING", "OUTPUT_HEAD", "param_reasons",
           "split_params", "param_reason", "is_muon_param", "stores_in_out"]


def param_reasons(model: nn.Module, head_names: Sequence[str] = HEAD_NAMES,
                  routers: str = "adamw", **options) -> Dict[int, str]:
    """Why each trainable parameter (by id) takes Muon (a reason starting :data:`HIDDEN_MATRIX`) or
    AdamW (its kind: ``"embedding"``, ``"output head"``, ``"router"``, ``"raw parameter …"``, …)."""
    return {i: d.reason for i, (_, d) in classify(model, head_names=head_names, routers=routers,
                                                    **options).items()}


def split_params(
    model: nn.Module, head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw", **options
) -> Tuple[List[Tuple[str, nn.Parameter]], List[Tuple[str, nn.Parameter]]]:
    """(muon, adamw) lists of ``(name, parameter)`` in ``model.named_parameters()`` order."""
    decided = classify(model, head_names=head_names, routers=routers, **options)
    muon, adam = [], []
    for name, p in model.named_parameters():  # a tied weight appears once
        if id(p) in decided and decided[id(p)][0] == name:
            (muon if decided[id(p)][1].muon else adam).append((name, p))
    return muon, adam


def param_reason(name: str, shape: Sequence[int], module_name: str, module: nn.Module,
                 head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw", param=None) -> str:
    """:func:`param_reasons` for one original tensor of ``module`` (where parameters are flattened, FSDP1);
    ``param``: the tensor itself where it still exists (FSDP1 ``use_orig_params=True``), for its tags."""
    return decide(rules_of(module, head_names, routers), module_name, module, name, shape, param).reason


def is_muon_param(name: str, shape: Sequence[int], module_name: str, module: nn.Module,
                  head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw") -> bool:
    """The same rule for one original tensor (used where parameters are flattened, FSDP1)."""
    return decide(rules_of(module, head_names, routers), module_name, module, name, shape).muon

