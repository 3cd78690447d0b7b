"""A small stand-in of ``ds_muon.models.attention_logits.LogitRecorder`` (the interface in the issue's rules),
for the QK-clip tests until the real recorder lands: it wraps transformers' eager attention through the
attention-function registry and keeps, per attention module, each query head's largest pre-softmax logit
(masked positions excluded) since the last ``reset()``."""

from __future__ import annotations

from typing import Dict

import torch

NAME = "ds_muon_qk_standin"
PROJECTIONS = ("q_proj", "q_b_proj", "qkv_proj", "query_key_value", "c_attn")  # an attention module has one


class StandInRecorder:
    def __init__(self, model):
        from transformers import AttentionInterface

        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()
                      if type(m).__name__.endswith("Attention") and hasattr(m, "scaling")
                      and any(getattr(m, a, None) is not None for a in PROJECTIONS)}
        self._max: Dict[str, torch.Tensor] = {}
        AttentionInterface.register(NAME, _attend)
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = NAME
        for m in model.modules():
            if id(m) in self.names:
                m._ds_muon_standin = self

    def _record(self, module, m: torch.Tensor) -> None:
        name = self.names[id(module)]
        prev = self._max.get(name)
        self._max[name] = m if prev is None else torch.maximum(prev, m)

    def heads(self, name):
        m = self.model.get_submodule(name)
        cfg = m.config
        nh = cfg.num_attention_heads
        hd = getattr(m, "head_dim", None) or getattr(m, "qk_head_dim", None) or m.head_size
        return nh, getattr(cfg, "num_key_value_heads", None) or nh, hd

    def maxima(self):
        return {n: self._max.get(n, torch.full((self.heads(n)[0],), float("-inf"))).clone()
                for n in self.names.values()}

    def reset(self):
        self._max.clear()

    def remove(self):
        pass


def _attend(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    import sys

    from transformers.models.llama.modeling_llama import repeat_kv

    eager_attention_forward = sys.modules[type(module).__module__].eager_attention_forward  # the module's own

    rec = getattr(module, "_ds_muon_standin", None)
    if rec is not None:
        with torch.no_grad():
            k = repeat_kv(key, getattr(module, "num_key_value_groups", 1))
            logits = torch.matmul(query, k.transpose(2, 3)).float() * scaling
            if attention_mask is not None:
                logits = logits.masked_fill(attention_mask[..., : k.shape[-2]] != 0, float("-inf"))
            elif logits.shape[-1] == logits.shape[-2]:
                logits = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool).triu(1), float("-inf"))
            rec._record(module, logits.amax(dim=(0, 2, 3)))
    return eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kw)


def install() -> None:
    """Make ``ds_muon.models.attention_logits.LogitRecorder`` this stand-in while the real one has not landed
    (so ``ds_muon.QKClip(model)`` and the front doors' ``qk_clip`` settings run); the real one once it has."""
    import importlib
    import sys
    import types

    try:
        importlib.import_module("ds_muon.models.attention_logits")
    except ImportError:
        import ds_muon.models

        mod = types.ModuleType("ds_muon.models.attention_logits")
        mod.LogitRecorder = StandInRecorder
        sys.modules[mod.__name__] = mod
        ds_muon.models.attention_logits = mod
