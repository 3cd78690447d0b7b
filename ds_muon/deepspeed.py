"""``ds_muon.deepspeed.initialize``: DeepSpeed with ds_muon, from the same JSON file.

The config entry::

    "optimizer": {"type": "DsMuon",
                  "params": {"lr": 0.02, "momentum": 0.95, "adam_lr": 3e-4, "weight_decay": 0.0}}

``params`` accepts every :class:`ds_muon.Muon` keyword that JSON can express
(dtypes as strings such as ``"bfloat16"``, tuples as lists, ``cost_model`` as an
object of :class:`~ds_muon.engine.plan.cost_model.CostModel` fields) plus ``adam_lr`` and
``adam_weight_decay`` (the AdamW group of :func:`ds_muon.muon_param_groups`).
Everything else in the config goes to DeepSpeed unchanged, with
``zero_allow_untested_optimizer`` set.

Optimizer offload: ``"zero_optimization": {"offload_optimizer": {"device": "cpu",
"pin_memory": true}}`` works as written (``zero_force_ds_cpu_optimizer`` is set to
false for you: Muon, not DeepSpeed's CPU Adam, steps the host partition).  Momentum
and AdamW moments live beside the fp32 partition in host memory; the result is
bitwise the run without offload (docs/DEEPSPEED.md).

Binding: ``ds_muon.deepspeed.bind(engine)`` is the one spelling (after a
``deepspeed.initialize`` you called yourself; :func:`initialize`,
``ds_muon.accelerate.prepare`` and ``ds_muon.trainer.MuonTrainer`` call it).
(It moved here from ``ds_muon.integrations.deepspeed``, the adapter, which describes
partitions and never sees the optimizer.)

Gradient clipping: DeepSpeed's ``gradient_clipping`` (DeepSpeed 0.19.8 defaults it
to 1.0) clips the raw averaged gradient before ``Muon.step``; the orthogonalized
update is never clipped (its scale is set by ``lr`` and ``scale_mode``).
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from typing import Any, Dict, Optional, Tuple

import torch

from .engine.plan.cost_model import CostModel
from .integrations.base import FLAT_PARTITION, HOW_TO_BIND
from .integrations.deepspeed import (DeepSpeedAdapter, allow_client_optimizer_offload, check_no_deepspeed_muon_tags,
                                     check_supported_config)
from .integrations.deepspeed_checkpoint import guard_loads
from .integrations.deepspeed_cpu_adam import adamw_kernel
from .integrations.moe import split_moe_groups, tag_deepspeed_moe
from .optimizer import Muon
from .param_groups import muon_param_groups
from .qk_clip import clip_from_settings
from .unwrap import find_muon

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


def initialize(args=None, model: torch.nn.Module = None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: Optional[int] = None, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """``deepspeed.initialize`` with ds_muon: same arguments, same return value.

    With a ``"type": "DsMuon"`` optimizer entry, builds :class:`ds_muon.Muon` over
    :func:`ds_muon.muon_param_groups` and binds it to the ZeRO optimizer.  With a
    ``ds_muon.Muon`` passed as ``optimizer`` it binds that one.  Anything else is
    plain ``deepspeed.initialize``.
    """
    import deepspeed

    if model is None:
        raise ValueError("ds_muon.deepspeed.initialize requires a model")
    if config is None and config_params is not None:
        config = config_params
    if config is None and getattr(args, "deepspeed_config", None) is not None:
        config = args.deepspeed_config
        args = copy.copy(args)
        args.deepspeed_config = None
    if config is None:
        raise ValueError("ds_muon.deepspeed.initialize needs config= (a dict or a JSON path) or args.deepspeed_config")
    cfg = load_config(config)

    names = {p: n for n, p in model.named_parameters()}
    if is_dsmuon_entry(cfg):
        if optimizer is not None:
            raise ValueError(f'ds_muon: the config names "type": "{OPTIMIZER_TYPE}" and an optimizer was passed too; '
                             "pass one of them")
        if model_parameters is not None:
            raise ValueError(f'ds_muon: "type": "{OPTIMIZER_TYPE}" builds its groups with '
                             "ds_muon.muon_param_groups(model); drop model_parameters, or build "
                             "ds_muon.Muon(your_groups, ...) yourself and pass it as optimizer=")
        cfg, optimizer = optimizer_from_config(model, cfg)
    elif isinstance(optimizer, Muon):
        if "optimizer" in cfg:
            raise ValueError('ds_muon: a ds_muon.Muon was passed and the config has an "optimizer" entry too; '
                             "remove the entry")
        check_supported_config(cfg)
        check_no_deepspeed_muon_tags(list(model.parameters()), names)
        allow_client_optimizer_offload(cfg)
    else:
        kw = {} if distributed_port is None else {"distributed_port": distributed_port}
        return deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                    training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                                    dist_init_required=dist_init_required, collate_fn=collate_fn, config=cfg,
                                    mesh_param=mesh_param, **kw)
    cfg["zero_allow_untested_optimizer"] = True
    kw = {} if distributed_port is None else {"distributed_port": distributed_port}
    out = deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                               training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                               dist_init_required=dist_init_required, collate_fn=collate_fn, config=cfg,
                               mesh_param=mesh_param, **kw)
    bind(out[0], optimizer)
    return out


def bind(engine, optimizer=None):
    """Attach a :class:`~ds_muon.integrations.deepspeed.DeepSpeedAdapter` to the ``ds_muon.Muon`` inside ``engine``; returns the Muon.

    Call once, after ``deepspeed.initialize`` (``ds_muon.deepspeed.initialize`` does it
    for you).  ``engine`` is the DeepSpeedEngine (with accelerate: the prepared model).
    """
    muon = optimizer if optimizer is not None else find_muon(engine, required=False)
    if muon is None:
        raise ValueError(
            f"ds_muon: {type(engine).__name__} holds no ds_muon.Muon (its optimizer is "
            f"{type(getattr(engine, 'optimizer', None)).__name__}); pass the DeepSpeed engine that was built "
            "with a ds_muon.Muon")
    if not hasattr(engine, "optimizer"):
        raise ValueError(f"ds_muon: bind() needs the DeepSpeed engine, got {type(engine).__name__}")
    names = dict(getattr(engine, "param_names", None) or {})
    check_no_deepspeed_muon_tags(list(engine.module.parameters()), names)
    tag_deepspeed_moe(engine.module)  # expert parameters: their expert data-parallel domain
    adapter = DeepSpeedAdapter(engine, wrapped=engine.optimizer is not muon)
    for t in adapter.flat_partitions():
        setattr(t, FLAT_PARTITION, True)  # 1-D flat partitions that hold matrices
    muon.attach(adapter)
    guard_loads(engine, muon)  # checkpoints whose groups differ are refused before anything loads
    return muon


__all__ = ["initialize", "optimizer_from_config", "build_optimizer", "parse_params", "accepted_params", "load_config", "bind", "HOW_TO_BIND"]
