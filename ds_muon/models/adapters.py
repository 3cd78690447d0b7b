"""PEFT's adapter layers seen as what they stand for, so a PEFT model gets the bare model's decisions.

A LoRA factor (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``, ``lora_embedding_A/B``) is one half of a
low-rank update of its ``base_layer``: it takes that layer's decision (a hidden linear's factors Muon, an
embedding's or a head's AdamW), whatever its rank (a rank-1 ``lora_B`` reads one feature, but it is no
input layer).  A ``modules_to_save`` copy is the module it copies: a copy of an end of the model is that
end.  Decided from PEFT's types (``LoraLayer``, ``ModulesToSaveWrapper``); where peft's types cannot be
imported, from the same structure (``base_layer`` beside ``lora_A``; ``original_module`` beside
``modules_to_save``).
"""

from __future__ import annotations

import sys
from typing import Dict, Tuple

from torch import nn

FACTOR_DICTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def _peft_types():
    """``(LoraLayer, ModulesToSaveWrapper)`` when peft is loaded (a PEFT model means it is), else Nones."""
    if "peft" not in sys.modules:
        return None, None
    try:
        from peft.tuners.lora import LoraLayer
        from peft.utils import ModulesToSaveWrapper
    except ImportError:  # another peft layout: the structural fallback below
        return None, None
    return LoraLayer, ModulesToSaveWrapper


def is_lora_layer(module: nn.Module) -> bool:
    lora, _ = _peft_types()
    if lora is not None and isinstance(module, lora):
        return True
    return isinstance(getattr(module, "base_layer", None), nn.Module) and isinstance(
        getattr(module, "lora_A", None), (nn.ModuleDict, nn.ParameterDict))


def is_modules_to_save(module: nn.Module) -> bool:
    _, wrapper = _peft_types()
    if wrapper is not None and isinstance(module, wrapper):
        return True
    return isinstance(getattr(module, "original_module", None), nn.Module) and isinstance(
        getattr(module, "modules_to_save", None), nn.ModuleDict)


def base_layer_of(layer: nn.Module) -> nn.Module:
    """The layer a LoRA layer adapts (through nested adapters: PEFT's ``get_base_layer()``)."""
    get = getattr(layer, "get_base_layer", None)
    if callable(get):
        return get()
    while isinstance(getattr(layer, "base_layer", None), nn.Module):
        layer = layer.base_layer
    return layer


def lora_factors(model: nn.Module) -> Dict[int, Tuple[nn.Module, str]]:
    """``id(module holding a factor) -> (its LoRA layer, which factor)``: each adapter's ``lora_A``/``lora_B``
    module, and the ``ParameterDict`` of ``lora_embedding_A``/``_B`` (whose tensors it holds itself)."""
    out: Dict[int, Tuple[nn.Module, str]] = {}
    for m in model.modules():
        if not is_lora_layer(m):
            continue
        for which in FACTOR_DICTS:
            holder = getattr(m, which, None)
            if isinstance(holder, nn.ParameterDict):
                out[id(holder)] = (m, which)
            elif isinstance(holder, nn.ModuleDict):
                for factor in holder.values():
                    for sub in factor.modules():
                        out[id(sub)] = (m, which)
    return out


def saved_copies(model: nn.Module) -> Dict[int, nn.Module]:
    """``id(module inside a modules_to_save copy) -> the module of the original it copies``."""
    out: Dict[int, nn.Module] = {}
    for m in model.modules():
        if not is_modules_to_save(m):
            continue
        for copy in m.modules_to_save.values():
            for rel, sub in copy.named_modules():
                try:
                    out[id(sub)] = m.original_module.get_submodule(rel) if rel else m.original_module
                except AttributeError:
                    continue
    return out
