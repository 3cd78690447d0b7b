"""``ds_muon.peft``: Muon for PEFT models (LoRA, QLoRA-style frozen bases, ``modules_to_save``).

    from ds_muon.peft import lora_param_groups

    model = get_peft_model(base, LoraConfig(r=8, target_modules=[...], modules_to_save=["score"]))
    optimizer = ds_muon.Muon(lora_param_groups(model, lr=0.02, adam_lr=3e-4))

:func:`lora_param_groups` is :func:`ds_muon.muon_param_groups` plus what PEFT's wrapping hides from
its rules (the copies ``modules_to_save`` makes of the model's ends):

* ``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``) of a hidden projection are hidden linear
  maps of rank ``r``: Muon, each its own matrix (NS on an ``r``-row matrix is cheap).  Rank 1 is the
  exception today: the rules read a Linear with one input as an input layer, so ``lora_B`` takes AdamW
  (``include=["*.lora_B.*"]`` gives it Muon);
* the trainable copy ``modules_to_save`` makes of a head (``score``, ``classifier``, ``lm_head``) or of
  the embeddings is that head or embedding: AdamW, as in the model without PEFT;
* LoRA on an embedding (``lora_embedding_A/B``) is a raw parameter: AdamW;
* frozen tensors (the whole base, also a bf16 one: QLoRA-style) are in no group: no state, no work.

Asked about the PEFT model, today's rules read PEFT's ``base_model`` (the LoRA tuner, which holds
everything) as the transformers backbone, find no head outside it and give a ``modules_to_save`` head
Muon; this helper finds those copies from PEFT's structure (a ``modules_to_save`` wrapper outside
the transformers backbone, or of its input/output embeddings) and sends them to AdamW.  It accepts the
PEFT model bare or inside DDP / FSDP1 / FSDP2 / a DeepSpeed engine / Fabric (it looks through ``.module``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

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


def _copies_of_ends(peft_model: nn.Module) -> List[str]:
    """Paths (in the transformers model) of the ``modules_to_save`` wrappers that copy an end of the model:
    its input or output embeddings, or a head outside its backbone (``base_model``), e.g. ``score``."""
    inner = peft_model.get_base_model()
    backbone = getattr(inner, "base_model", inner)
    in_backbone = {id(m) for m in backbone.modules()} if backbone is not inner else None
    ends = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            end = getattr(inner, getter)()
        except (AttributeError, NotImplementedError, TypeError, ValueError):
            end = None
        if isinstance(end, nn.Module):
            ends.update(id(m) for m in end.modules())
    paths = []
    for path, m in inner.named_modules():
        original = getattr(m, "original_module", None)
        if isinstance(getattr(m, "modules_to_save", None), nn.ModuleDict) and isinstance(original, nn.Module):
            outside = in_backbone is not None and id(m) not in in_backbone
            if outside or id(m) in ends or id(original) in ends:
                paths.append(path)
    return paths


def lora_param_groups(model: nn.Module, exclude: Sequence[str] = (), **kwargs: Any) -> List[Dict[str, Any]]:
    """:func:`ds_muon.muon_param_groups` (same keywords) over the trainable tensors of a PEFT model.

    ``model`` is what you would pass to ``muon_param_groups``: the PEFT model, or the stack's wrapper
    of it (DDP, the FSDP2-sharded model).  FSDP1: build the groups on the PEFT model before wrapping it
    with ``use_orig_params=True`` (which keeps the tensors), then ``ds_muon.Muon(groups, model=root)``.  The trainable copies ``modules_to_save`` keeps of the model's ends
    are sent to AdamW (``exclude``, shown as such in ``summary()``)."""
    ends = _copies_of_ends(peft_model_of(model))
    # a PEFT model's names all start "base_model.model.", so the copy's path always follows a dot
    patterns = [f"*.{path}.modules_to_save.*" for path in ends]
    return muon_param_groups(model, exclude=list(exclude) + patterns, **kwargs)
