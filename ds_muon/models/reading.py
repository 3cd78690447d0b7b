"""A model read once: its evidence gathered (:class:`~.evidence.Rules`) and every trainable tensor decided
(:func:`~.decide.decide`): the entry every path calls (:func:`ds_muon.muon_param_groups`, the FSDP1 adapter,
the census).  It reads a model (:func:`read`, :func:`split_params`, :func:`param_reasons`) or one original
tensor of a model a stack flattened (:func:`param_reason`, FSDP1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

from ..tensors.shape import global_shape
from .decide import decide
from .evidence import Rules, rules_of
from .kinds import Decision
from .module_types import unwrap_model
from .names import HEAD_NAMES


@dataclass
class ModelMap:
    """A model read once: each trainable tensor's decision (``id(param) -> (name, Decision)``, a tied tensor once
    under its first name), the module that owns each parameter (``id(param) -> (name in it, module)``), and
    the evidence it was decided from (:class:`~.evidence.Rules`)."""

    decided: Dict[int, Tuple[str, Decision]]
    owners: Dict[int, Tuple[str, nn.Module]]
    rules: Rules


def read(model: nn.Module, rules: Optional[Rules] = None, **options) -> ModelMap:
    """The model map of ``model`` (its evidence read with ``options``, those of :class:`~.evidence.Rules`, unless
    ``rules`` were read already): the entry of :func:`ds_muon.muon_param_groups` and of the FSDP1 adapter."""
    rules = rules if rules is not None else Rules(model, **options)
    owner: Dict[int, Tuple[str, nn.Module, str]] = {}
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            owner.setdefault(id(p), (mod_name, mod, pname))
    out: Dict[int, Tuple[str, Decision]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in out:
            continue
        mod_name, mod, pname = owner[id(p)]
        out[id(p)] = (name, decide(rules, mod_name, mod, pname, global_shape(p), p))
    return ModelMap(out, {i: (pname, mod) for i, (_, mod, pname) in owner.items()}, rules)


def classify(model: nn.Module, rules: Optional[Rules] = None, **options) -> Dict[int, Tuple[str, Decision]]:
    """``id(param) -> (name, decision)`` for every trainable parameter (a tied one once, first name)."""
    return read(model, rules, **options).decided


def model_map(model: nn.Module, **options) -> Dict[str, Decision]:
    """The one table of a model: parameter name -> :class:`Decision` (kind, Muon or not, reason, blocks and
    orientation in ``plan``, ``decided_by``), read through any wrapper (the bare module's decision)."""
    return {name: d for name, d in read(model, Rules(unwrap_model(model), **options)).decided.values()}


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


def param_decision(name: str, shape: Sequence[int], module_name: str, module: nn.Module,
                   head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw", param=None) -> Decision:
    """The decision for one original tensor of ``module`` where a stack flattened the parameters (FSDP1), by the
    rules last read over a model holding it (:func:`~.evidence.rules_of`); ``param``: the tensor itself where it
    still exists (FSDP1 ``use_orig_params=True``), for its tags."""
    return decide(rules_of(module, head_names, routers), module_name, module, name, shape, param)


def param_reason(name: str, shape: Sequence[int], module_name: str, module: nn.Module,
                 head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw", param=None) -> str:
    """:func:`param_reasons` for one original tensor (:func:`param_decision`)."""
    return param_decision(name, shape, module_name, module, head_names, routers, param).reason


def is_muon_param(name: str, shape: Sequence[int], module_name: str, module: nn.Module,
                  head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw") -> bool:
    """The same rule for one original tensor (:func:`param_decision`)."""
    return param_decision(name, shape, module_name, module, head_names, routers).muon
