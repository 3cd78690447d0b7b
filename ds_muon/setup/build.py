"""A :class:`ds_muon.Muon` over :func:`ds_muon.muon_param_groups` of a model, from settings.

Two spellings of the same settings: a DsMuon entry's JSON ``params`` (:func:`build_optimizer`,
:func:`optimizer_from_config`; under accelerate and the Trainer, updated by keyword settings:
:func:`build_deepspeed_muon`), and the keyword settings of ``prepare`` and ``MuonTrainer`` without
DeepSpeed (:func:`build_muon`).  Under DeepSpeed, MoE experts go in their own groups.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple

import torch

from ..integrations.deepspeed import (allow_client_optimizer_offload, check_no_deepspeed_muon_tags,
                                      check_supported_config)
from ..integrations.deepspeed_cpu_adam import adamw_kernel
from ..integrations.moe import split_moe_groups
from ..optimizer import Muon
from ..param_groups import muon_param_groups
from ..qk_clip import clip_from_settings
from .dsmuon_entry import entry_keywords, is_dsmuon_entry, load_config, parse_params

# -- keyword settings (prepare, MuonTrainer) ---------------------------------------------------------
GROUP_SETTINGS = tuple(k for k in inspect.signature(muon_param_groups).parameters if k not in ("model", "muon_options"))
MUON_SETTINGS = tuple(k for k in inspect.signature(Muon.__init__).parameters if k not in ("self", "params"))


def split_settings(settings: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(muon_param_groups keywords, Muon keywords)``; an unknown key raises, naming the accepted ones."""
    unknown = sorted(k for k in settings if k not in GROUP_SETTINGS and k not in MUON_SETTINGS)
    if unknown:
        raise TypeError(f"ds_muon.accelerate.prepare: unknown setting(s) {unknown}; accepted: "
                        f"{sorted(set(GROUP_SETTINGS) | set(MUON_SETTINGS))}")
    group_kw = {k: v for k, v in settings.items() if k in GROUP_SETTINGS}
    muon_kw = {k: v for k, v in settings.items() if k not in GROUP_SETTINGS}
    return group_kw, muon_kw


def build_muon(model: torch.nn.Module, settings: Dict[str, Any]) -> Muon:
    """``Muon(muon_param_groups(model, ...), ...)`` from one dict of settings."""
    group_kw, muon_kw = split_settings(settings)
    if muon_kw.get("qk_clip") is not None:  # {"tau": ..., "alpha": ...}: QK-clip on this model (ds_muon.qk_clip)
        muon_kw["qk_clip"] = clip_from_settings(model, muon_kw["qk_clip"], "prepare(qk_clip=...)")
    return Muon(muon_param_groups(model, **group_kw), **muon_kw)


# -- a DsMuon entry's params ---------------------------------------------------------------------
def build_optimizer(model: torch.nn.Module, entry_params: Optional[Dict[str, Any]]) -> Muon:
    """``Muon`` over ``muon_param_groups(model)`` from a DsMuon entry's ``params``.

    ``"adam_kernel": "deepspeed_cpu"`` steps the AdamW tensors held on the host with
    DeepSpeed's CPU Adam (:mod:`ds_muon.integrations.deepspeed_cpu_adam`: faster, not bitwise torch's AdamW);
    the default ``"torch"`` keeps an offloaded run bitwise the run without."""
    entry_params = dict(entry_params or {})
    kernel = adamw_kernel(str(entry_params.pop("adam_kernel", "torch")))
    muon_kw, group_kw = parse_params(entry_params)
    if muon_kw.get("qk_clip") is not None:  # "qk_clip": {"tau": 100.0, "alpha": 0.5}: QK-clip on this model
        muon_kw["qk_clip"] = clip_from_settings(model, muon_kw["qk_clip"], '"optimizer.params.qk_clip"')
    groups = muon_param_groups(model, **group_kw)
    muon = Muon(split_moe_groups(groups), **muon_kw)  # DeepSpeed MoE: experts in their own groups
    if kernel is not None:
        muon.adamw_kernel = kernel
    return muon


def optimizer_from_config(model: torch.nn.Module, config) -> Tuple[Dict[str, Any], Optional[Muon]]:
    """``(config for DeepSpeed, Muon or None)`` from a config with or without a DsMuon entry.

    For callers that hand the optimizer to ``deepspeed.initialize`` themselves (accelerate):
    the returned config has the entry removed, ``zero_allow_untested_optimizer`` set (and, with
    ``offload_optimizer`` on the host, ``zero_force_ds_cpu_optimizer`` false); pass
    the Muon as ``optimizer=`` and call ``ds_muon.deepspeed.bind(engine)`` after.
    """
    cfg = load_config(config)
    if not is_dsmuon_entry(cfg):
        return cfg, None
    entry = cfg.pop("optimizer")
    extra = sorted(set(entry) - {"type", "params"})
    if extra:
        raise ValueError(f'ds_muon: unknown key(s) {extra} in the "optimizer" entry; it takes "type" and "params"')
    check_supported_config(cfg)
    check_no_deepspeed_muon_tags(list(model.parameters()), {p: n for n, p in model.named_parameters()})
    muon = build_optimizer(model, entry.get("params"))
    cfg["zero_allow_untested_optimizer"] = True
    return allow_client_optimizer_offload(cfg), muon


def build_deepspeed_muon(model: torch.nn.Module, params: Dict[str, Any]) -> Muon:
    """The Muon a DsMuon entry with these ``params`` builds (MoE experts in their own groups, as
    ``ds_muon.deepspeed.initialize`` builds them)."""
    check_no_deepspeed_muon_tags(list(model.parameters()), {p: n for n, p in model.named_parameters()})
    muon_kw, group_kw = entry_keywords(params)
    if muon_kw.get("qk_clip") is not None:  # QK-clip on the engine's model (ds_muon.qk_clip)
        muon_kw["qk_clip"] = clip_from_settings(model, muon_kw["qk_clip"], "qk_clip")
    return Muon(split_moe_groups(muon_param_groups(model, **group_kw)), **muon_kw)
