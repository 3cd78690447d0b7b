"""``ds_muon.peft``: Muon for PEFT models (LoRA, QLoRA-style frozen bases, ``modules_to_save``).

    model = get_peft_model(base, LoraConfig(r=8, target_modules=[...], modules_to_save=["score"]))
    optimizer = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=0.02, adam_lr=3e-4))

:func:`ds_muon.muon_param_groups` reads a PEFT model as the bare model would be read
(:mod:`ds_muon.models.module_types`): a LoRA factor takes its base layer's decision (a hidden linear's
``lora_A``/``lora_B``: Muon, each one matrix, any rank; an embedding's or a head's: AdamW), a
``modules_to_save`` copy of an end of the model is that end (AdamW), frozen tensors are in no group.
:func:`lora_param_groups` stays as its alias, which also checks that the model is a PEFT model.
"""

from __future__ import annotations

from typing import Any, Dict, List

from torch import nn

from .param_groups import muon_param_groups

__all__ = ["lora_param_groups", "peft_model_of"]

_WRAPPED = ("module", "_fsdp_wrapped_module", "_forward_module", "_orig_mod")


def _is_peft(model) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def peft_model_of(model: nn.Module) -> nn.Module:
    """The PEFT model ``model`` is or wraps (DDP, FSDP1, a DeepSpeed engine, Fabric, ``torch.compile``)."""
    seen = model
    for _ in range(6):
        if _is_peft(model):
            return model
        inner = next((getattr(model, a) for a in _WRAPPED if isinstance(getattr(model, a, None), nn.Module)), None)
        if inner is None:
            break
        model = inner
    raise TypeError(f"ds_muon.peft.lora_param_groups: {type(seen).__name__} is no PEFT model (peft.get_peft_model's "
                    "result) and wraps none; for other models use ds_muon.muon_param_groups(model)")


def lora_param_groups(model: nn.Module, **kwargs: Any) -> List[Dict[str, Any]]:
    """:func:`ds_muon.muon_param_groups` (same keywords, same groups), after checking ``model`` is or wraps a
    PEFT model.  Kept for scripts written against it; new code can call ``muon_param_groups`` directly."""
    peft_model_of(model)
    return muon_param_groups(model, **kwargs)
