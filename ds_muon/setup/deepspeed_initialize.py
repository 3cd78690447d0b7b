"""``deepspeed.initialize`` with ds_muon: the Muon built from the config's DsMuon entry (or passed in),
the config made fit for a client optimizer, and the Muon bound to the engine it returns."""

from __future__ import annotations

import copy
from typing import Optional

import torch

from ..integrations.deepspeed import (allow_client_optimizer_offload, check_no_deepspeed_muon_tags,
                                      check_supported_config)
from ..optimizer import Muon
from .build import optimizer_from_config
from .deepspeed_bind import bind
from .dsmuon_entry import OPTIMIZER_TYPE, is_dsmuon_entry, load_config


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
