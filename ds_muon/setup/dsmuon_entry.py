"""The ``"type": "DsMuon"`` entry of a DeepSpeed config: read, checked, and taken out of the config.

``params`` takes every :class:`ds_muon.Muon` keyword JSON can express plus the keys of
:func:`ds_muon.muon_param_groups` (:func:`accepted_params`); an unknown key is refused naming the accepted
ones, with the spelling ds_muon uses where another Muon spells it differently.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from typing import Any, Dict, Optional, Tuple

from ..engine.plan.cost_model import CostModel
from ..integrations.deepspeed import allow_client_optimizer_offload, check_supported_config
from ..optimizer import Muon

OPTIMIZER_TYPE = "DsMuon"
# Muon keywords that are not settings (objects ds_muon fills in from the engine), or that
# cannot apply under DeepSpeed (its gradients are final only inside its own reduction)
_NOT_FROM_CONFIG = ("self", "params", "process_group", "model", "dispatch_in_backward", "apply_in_forward", "adapter")
_GROUP_KEYS = ("adam_lr", "adam_weight_decay", "routers", "split_fused", "exclude", "include")
_ENTRY_KEYS = ("adam_kernel",)  # entry settings that are neither Muon keywords nor group keys


def accepted_params():
    """The keys ``"params"`` of a DsMuon entry accepts (sorted)."""
    sig = inspect.signature(Muon.__init__)
    keys = [k for k, v in sig.parameters.items()
            if k not in _NOT_FROM_CONFIG and v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)]
    return sorted(set(keys) | set(_GROUP_KEYS) | set(_ENTRY_KEYS))


def load_config(config) -> Dict[str, Any]:
    """A deep copy of ``config`` (a dict, or the path of a JSON file)."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.exists(path):
            raise ValueError(f"ds_muon: DeepSpeed config file {path!r} does not exist")
        with open(path) as f:
            try:
                return json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"ds_muon: DeepSpeed config file {path!r} is not valid JSON: {e}") from None
    raise ValueError(f"ds_muon: config must be a dict or the path of a JSON file, got {type(config).__name__}")


def is_dsmuon_entry(config: Dict[str, Any]) -> bool:
    opt = config.get("optimizer")
    return isinstance(opt, dict) and str(opt.get("type", "")).lower() == OPTIMIZER_TYPE.lower()


def parse_params(params: Optional[Dict[str, Any]]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Split a DsMuon ``params`` dict into (Muon keywords, muon_param_groups keywords).

    Unknown keys raise ValueError listing the accepted ones; JSON lists become the
    tuples Muon expects.
    """
    params = dict(params or {})
    if not isinstance(params, dict):
        raise ValueError(f'ds_muon: "optimizer.params" must be an object, got {type(params).__name__}')
    accepted = accepted_params()
    unknown = sorted(k for k in params if k not in accepted)
    if unknown:
        hint = ""
        if any(k in ("betas", "eps", "muon_lr", "ns_method", "max_grad_norm") for k in unknown):
            hint = (' (DeepSpeed\'s built-in Muon spells some of these differently: use "adam_betas", "adam_eps", '
                    '"lr", "ns_coefficients"; clip with the top-level "gradient_clipping")')
        spelled = {"weight_decay_method": '"weight_decay_mode"', "cautious_wd": '"weight_decay_mode": "cautious"',
                   "muon_beta2": '"normuon_beta2"'}  # Emerging-Optimizers' and dion's names for ours
        hint += "".join(f' (for "{k}" use {v})' for k, v in spelled.items() if k in unknown)
        if "apply_in_forward" in unknown:
            hint += (" (under DeepSpeed every update is applied inside step(): ZeRO copies the partitions into "
                     "the model right after it)")
        if "dispatch_in_backward" in unknown:
            hint += (" (under DeepSpeed no gather can leave from backward: its gradients are final only inside "
                     'its own reduction; "overlap": true still pipelines the waves inside step())')
        raise ValueError(f'ds_muon: unknown key(s) {unknown} in "optimizer": {{"type": "{OPTIMIZER_TYPE}", '
                         f'"params": ...}}{hint}; accepted: {accepted}')
    group_kw = {k: params.pop(k) for k in _GROUP_KEYS if k in params}
    if "lr" in params:
        group_kw["lr"] = params["lr"]
    if "weight_decay" in params:
        group_kw["weight_decay"] = params["weight_decay"]
    if "adam_betas" in params:
        b = params["adam_betas"]
        if not isinstance(b, (list, tuple)) or len(b) != 2:
            raise ValueError(f'ds_muon: "adam_betas" must be a list of two numbers, got {b!r}')
        params["adam_betas"] = tuple(b)
    if isinstance(params.get("ns_coefficients"), list):
        c = params["ns_coefficients"]
        params["ns_coefficients"] = ([tuple(t) if isinstance(t, list) else t for t in c]
                                     if c and isinstance(c[0], (list, tuple)) else tuple(c))
    if isinstance(params.get("cost_model"), dict):
        try:
            params["cost_model"] = CostModel(**params["cost_model"])
        except TypeError as e:
            raise ValueError(f'ds_muon: "cost_model" {params["cost_model"]!r}: {e}') from None
    return params, group_kw


def take_dsmuon_entry(config: Dict[str, Any], settings: Dict[str, Any]) -> Dict[str, Any]:
    """Remove a ``"type": "DsMuon"`` entry from ``config`` (in place: accelerate and the Trainer keep
    that dict) and return its ``params`` updated with ``settings``; set what DeepSpeed needs for a
    client optimizer.  Another optimizer entry raises; a config ds_muon cannot train raises."""
    entry = config.get("optimizer")
    if entry is not None and not is_dsmuon_entry(config):
        raise ValueError(f"ds_muon: the DeepSpeed config names the optimizer {entry.get('type')!r}; "
                         'use "type": "DsMuon" (configs/deepspeed/zero2.json) or remove the entry')
    params = dict(settings)
    if entry is not None:
        extra = sorted(set(entry) - {"type", "params"})
        if extra:
            raise ValueError(f'ds_muon: unknown key(s) {extra} in the "optimizer" entry; it takes "type" and "params"')
        params = {**(entry.get("params") or {}), **settings}
        del config["optimizer"]
    entry_keywords(params)  # unknown keys: the entry's error, naming the accepted ones
    check_supported_config(config)
    allow_client_optimizer_offload(config)
    config["zero_allow_untested_optimizer"] = True
    return params


# muon_param_groups keywords that are Python-only (no DsMuon JSON key), accepted as keyword settings
_PYTHON_GROUP_KEYS = ("head_names", "split_attention")


def entry_keywords(params: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(Muon keywords, muon_param_groups keywords)`` from DsMuon ``params`` plus keyword settings."""
    params = dict(params)
    extra = {k: params.pop(k) for k in _PYTHON_GROUP_KEYS if k in params}
    muon_kw, group_kw = parse_params(params)
    return muon_kw, {**group_kw, **extra}
