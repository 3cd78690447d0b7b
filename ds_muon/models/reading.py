"""A model read once: its evidence gathered (:class:`~.evidence.Rules`) and every trainable tensor decided
(:func:`~.decide.decide`): the entry of :func:`ds_muon.muon_param_groups`, the FSDP1 adapter, the census.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from torch import nn

from ..tensors.shape import global_shape
from .decide import decide
from .evidence import Rules
from .kinds import Decision
from .module_types import unwrap_model


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
