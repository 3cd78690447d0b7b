"""``ds_muon.accelerate``: ds_muon under ``accelerate`` in one call.

    from ds_muon.accelerate import Accelerator, prepare

    accelerator = Accelerator()                      # accelerate's, with the CPU quirks handled
    model, optimizer, loader = prepare(accelerator, model, loader, lr=0.02, adam_lr=3e-4)
    ...
    accelerator.save_state("ckpt")                   # and accelerator.load_state("ckpt")

:func:`prepare` builds a :class:`ds_muon.Muon` over :func:`ds_muon.muon_param_groups`
(or takes yours as ``optimizer=``) and runs ``accelerator.prepare`` the way each
distributed type needs it:

* DeepSpeed ZeRO 0-3: the launch config's ``"type": "DsMuon"`` entry becomes the Muon
  (keyword settings override its ``params``) and leaves the config accelerate hands
  to DeepSpeed, which refuses an optimizer both there and in ``prepare``; the Muon
  is then bound to the engine (:func:`ds_muon.deepspeed.bind`).
* FSDP2: the Muon is built on the plain model and ``prepare`` shards the model and
  swaps the Muon's parameters for the DTensors.  accelerate refuses FSDP on CPU (it
  falls back to DDP); there the accelerator's state is switched to accelerate's own
  FSDP2 path, so the model really is sharded and ``save_state`` writes a sharded
  (DCP) checkpoint.
* DDP and one process: plain ``prepare``.

:class:`Accelerator` is ``accelerate.Accelerator`` (same arguments) that, with no GPU,
starts gloo process groups: ``cpu=True`` for DDP/FSDP launches, and a gloo backend
for DeepSpeed launches, whose CPU path otherwise asks DeepSpeed's accelerator.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Dict, Optional, Tuple

import torch

from .optimizer import Muon
from .param_groups import muon_param_groups
from .qk_clip import clip_from_settings
from .unwrap import find_muon as _find_muon

__all__ = ["Accelerator", "prepare", "find_muon", "split_settings"]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def no_gpu() -> bool:
    return not torch.cuda.is_available()


def _accelerate():
    try:
        import accelerate
    except ImportError as e:  # pragma: no cover - only without accelerate
        raise ImportError("ds_muon.accelerate needs the accelerate package: pip install accelerate") from e
    return accelerate


class Accelerator(_accelerate().Accelerator):
    """``accelerate.Accelerator`` that also starts distributed training on CPU-only machines.

    With a GPU it is exactly accelerate's.  Without one, accelerate takes its multi-process
    path only with ``cpu=True`` (gloo), and its DeepSpeed path only with ``cpu=False``; this
    class picks whichever the launch asks for, with the gloo backend, also for an FSDP launch of
    one rank (a W=1 resume of an FSDP2 checkpoint).  Arguments you pass win.
    """

    def __init__(self, *args, **kwargs):
        if no_gpu() and (int(os.environ.get("WORLD_SIZE", "1")) > 1 or _fsdp_one_launched_rank()):
            if _env_flag("ACCELERATE_USE_DEEPSPEED"):
                from accelerate.utils import InitProcessGroupKwargs

                handlers = list(kwargs.get("kwargs_handlers") or [])
                if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
                    handlers.append(InitProcessGroupKwargs(backend="gloo"))
                kwargs["kwargs_handlers"] = handlers
            else:
                kwargs.setdefault("cpu", True)
        super().__init__(*args, **kwargs)


def _fsdp_one_launched_rank() -> bool:
    """An FSDP launch of one rank by a launcher (``LOCAL_RANK`` set, as torchrun sets it): FSDP2 shards
    over a one-rank mesh, so it needs the gloo process group that ``cpu=True`` starts (a W=1 resume of
    a W=2 FSDP2 checkpoint); without it accelerate picks one plain process."""
    return _env_flag("ACCELERATE_USE_FSDP") and int(os.environ.get("LOCAL_RANK", "-1")) != -1


# -- settings ---------------------------------------------------------------------------------------
_GROUP_KEYS = tuple(k for k in inspect.signature(muon_param_groups).parameters if k not in ("model", "muon_options"))
_MUON_KEYS = tuple(k for k in inspect.signature(Muon.__init__).parameters if k not in ("self", "params"))


def split_settings(settings: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(muon_param_groups keywords, Muon keywords)``; an unknown key raises, naming the accepted ones."""
    unknown = sorted(k for k in settings if k not in _GROUP_KEYS and k not in _MUON_KEYS)
    if unknown:
        raise TypeError(f"ds_muon.accelerate.prepare: unknown setting(s) {unknown}; accepted: "
                        f"{sorted(set(_GROUP_KEYS) | set(_MUON_KEYS))}")
    group_kw = {k: v for k, v in settings.items() if k in _GROUP_KEYS}
    muon_kw = {k: v for k, v in settings.items() if k not in _GROUP_KEYS}
    return group_kw, muon_kw


def build_muon(model: torch.nn.Module, settings: Dict[str, Any]) -> Muon:
    """``Muon(muon_param_groups(model, ...), ...)`` from one dict of settings."""
    group_kw, muon_kw = split_settings(settings)
    if muon_kw.get("qk_clip") is not None:  # {"tau": ..., "alpha": ...}: QK-clip on this model (ds_muon.qk_clip)
        muon_kw["qk_clip"] = clip_from_settings(model, muon_kw["qk_clip"], "prepare(qk_clip=...)")
    return Muon(muon_param_groups(model, **group_kw), **muon_kw)


def find_muon(optimizer) -> Optional[Muon]:
    """The :class:`ds_muon.Muon` inside accelerate's / DeepSpeed's optimizer wrappers (or None);
    :func:`ds_muon.find_muon` is the same search, raising when there is none."""
    return _find_muon(optimizer, required=False)


# -- the call ---------------------------------------------------------------------------------------
def prepare(accelerator, model: torch.nn.Module, *objects, optimizer: Optional[Muon] = None, **settings):
    """``accelerator.prepare`` with a ds_muon optimizer: returns ``(model, optimizer, *objects)``.

    ``settings`` are :func:`ds_muon.muon_param_groups` keywords (``lr``, ``adam_lr``,
    ``weight_decay``, ...) and :class:`ds_muon.Muon` keywords (``ns_dtype``, ``overlap``, ...);
    or pass your own ``optimizer=ds_muon.Muon(...)`` built on the plain model.  ``objects``
    are what else you would give ``accelerator.prepare`` (data loaders, schedulers).  The
    returned optimizer is accelerate's wrapper; the Muon inside is :func:`find_muon` of it.
    """
    from accelerate.utils import DistributedType

    if optimizer is not None and not isinstance(optimizer, Muon):
        raise TypeError(f"ds_muon.accelerate.prepare: optimizer must be a ds_muon.Muon, got {type(optimizer).__name__}")
    if optimizer is not None and settings:
        raise TypeError(f"ds_muon.accelerate.prepare: pass settings {sorted(settings)} or optimizer=, not both "
                        "(the settings would be ignored)")
    _check_distributed(accelerator)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return _prepare_deepspeed(accelerator, model, objects, optimizer, settings)
    if _env_flag("ACCELERATE_USE_FSDP") or accelerator.distributed_type == DistributedType.FSDP:
        use_fsdp2(accelerator)
    muon = optimizer if optimizer is not None else build_muon(model, settings)
    model, opt, *rest = accelerator.prepare(model, muon, *objects)
    _check_wrapped(opt, muon)
    return (model, opt, *rest)


def _check_distributed(accelerator) -> None:
    """A launch with several processes whose accelerator did not start distributed training."""
    from accelerate.utils import DistributedType

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and accelerator.distributed_type == DistributedType.NO:
        raise RuntimeError(
            f"ds_muon.accelerate.prepare: launched with WORLD_SIZE={world} but the Accelerator runs one process "
            "(accelerate does that on CPU-only machines without cpu=True); build it with "
            "ds_muon.accelerate.Accelerator(...), which handles CPU launches")


def use_fsdp2(accelerator, plugin=None) -> None:
    """FSDP launches: only FSDP2; on CPU, switch accelerate's MULTI_CPU fallback to its FSDP2 path.

    ``plugin``: the FSDP plugin to use there (default: from the launch config's ``FSDP_*``
    environment, as accelerate reads it)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if accelerator.distributed_type == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
    else:
        if accelerator.distributed_type != DistributedType.MULTI_CPU:
            raise RuntimeError(f"ds_muon: the launch asks for FSDP but accelerate chose "
                               f"{accelerator.distributed_type}; build the accelerator with "
                               "ds_muon.accelerate.Accelerator(...)")
        plugin = plugin if plugin is not None else FullyShardedDataParallelPlugin()
        if plugin.fsdp_version == 2 and accelerator.mixed_precision != "no":
            raise NotImplementedError(f"ds_muon: mixed_precision={accelerator.mixed_precision!r} "
                                      "with FSDP2 on CPU; use mixed_precision: 'no' on CPU")
        if plugin.fsdp_version == 2 and (_env_flag("FSDP_OFFLOAD_PARAMS") or _offloads(plugin)):
            raise NotImplementedError("ds_muon: fsdp_offload_params has nothing to offload to on CPU; set it to false")
    if plugin.fsdp_version != 2:
        raise NotImplementedError(
            f"ds_muon: the launch config asks for FSDP{plugin.fsdp_version}; accelerate builds "
            "FSDP1 optimizers after wrapping, use fsdp_version: 2 (configs/accelerate/fsdp2.yaml), or wrap with "
            "FSDP1 yourself and build ds_muon.Muon on the wrapped model (docs/FSDP.md)")
    if accelerator.distributed_type != DistributedType.FSDP:
        # accelerate only lets FSDP run on accelerators; its FSDP2 code itself runs on CPU tensors with gloo.
        # Set where accelerate itself records it (every AcceleratorState() copies PartialState's value).
        from accelerate.state import PartialState

        accelerator.state.fsdp_plugin = plugin
        accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP


def _offloads(plugin) -> bool:
    offload = plugin.cpu_offload  # FSDP2: an OffloadPolicy (CPUOffloadPolicy when offloading); FSDP1: CPUOffload
    return type(offload).__name__ == "CPUOffloadPolicy" or bool(getattr(offload, "offload_params", False))


def take_dsmuon_entry(config: Dict[str, Any], settings: Dict[str, Any]) -> Dict[str, Any]:
    """Remove a ``"type": "DsMuon"`` entry from ``config`` (in place: accelerate and the Trainer keep
    that dict) and return its ``params`` updated with ``settings``; set what DeepSpeed needs for a
    client optimizer.  Another optimizer entry raises; a config ds_muon cannot train raises."""
    from . import deepspeed as ds_muon_deepspeed

    entry = config.get("optimizer")
    if entry is not None and not ds_muon_deepspeed.is_dsmuon_entry(config):
        raise ValueError(f"ds_muon: the DeepSpeed config names the optimizer {entry.get('type')!r}; "
                         'use "type": "DsMuon" (configs/deepspeed/zero2.json) or remove the entry')
    params = dict(settings)
    if entry is not None:
        extra = sorted(set(entry) - {"type", "params"})
        if extra:
            raise ValueError(f'ds_muon: unknown key(s) {extra} in the "optimizer" entry; it takes "type" and "params"')
        params = {**(entry.get("params") or {}), **settings}
        del config["optimizer"]
    _deepspeed_kwargs(params)  # unknown keys: the entry's error, naming the accepted ones
    ds_muon_deepspeed.check_supported_config(config)
    ds_muon_deepspeed.allow_client_optimizer_offload(config)
    config["zero_allow_untested_optimizer"] = True
    return params


# muon_param_groups keywords that are Python-only (no DsMuon JSON key), accepted as keyword settings
_PYTHON_GROUP_KEYS = ("head_names", "split_attention")


def _deepspeed_kwargs(params: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(Muon keywords, muon_param_groups keywords)`` from DsMuon ``params`` plus keyword settings."""
    from . import deepspeed as ds_muon_deepspeed

    params = dict(params)
    extra = {k: params.pop(k) for k in _PYTHON_GROUP_KEYS if k in params}
    muon_kw, group_kw = ds_muon_deepspeed.parse_params(params)
    return muon_kw, {**group_kw, **extra}


def build_deepspeed_muon(model: torch.nn.Module, params: Dict[str, Any]) -> Muon:
    """The Muon a DsMuon entry with these ``params`` builds (MoE experts in their own groups, as
    ``ds_muon.deepspeed.initialize`` builds them)."""
    from . import deepspeed as ds_muon_deepspeed
    from .integrations.moe import split_moe_groups

    ds_muon_deepspeed.check_no_deepspeed_muon_tags(list(model.parameters()),
                                                   {p: n for n, p in model.named_parameters()})
    muon_kw, group_kw = _deepspeed_kwargs(params)
    if muon_kw.get("qk_clip") is not None:  # QK-clip on the engine's model (ds_muon.qk_clip)
        muon_kw["qk_clip"] = clip_from_settings(model, muon_kw["qk_clip"], "qk_clip")
    return Muon(split_moe_groups(muon_param_groups(model, **group_kw)), **muon_kw)


def _prepare_deepspeed(accelerator, model, objects, optimizer, settings):
    from . import deepspeed as ds_muon_deepspeed

    cfg = accelerator.state.deepspeed_plugin.deepspeed_config  # the dict accelerate hands to DeepSpeed
    if cfg.get("optimizer") is not None and optimizer is not None:
        raise ValueError('ds_muon.accelerate.prepare: the DeepSpeed config has an "optimizer" entry and optimizer= '
                         "was passed too; pass one of them")
    params = take_dsmuon_entry(cfg, settings)
    muon = optimizer if optimizer is not None else build_deepspeed_muon(model, params)
    loaders = [o for o in objects if isinstance(o, torch.utils.data.DataLoader) and o.batch_size is not None]
    if loaders:  # the data loader decides the micro-batch (accelerate fills "auto" from it)
        cfg["train_micro_batch_size_per_gpu"] = "auto"
        cfg.pop("train_batch_size", None)
    engine, opt, *rest = accelerator.prepare(model, muon, *objects)
    ds_muon_deepspeed.bind(engine, muon)
    _check_wrapped(opt, muon)
    return (engine, opt, *rest)


def _check_wrapped(opt, muon: Muon) -> None:
    if find_muon(opt) is not muon:
        raise RuntimeError(f"ds_muon.accelerate.prepare: accelerate returned {type(opt).__name__} without the "
                           "ds_muon.Muon inside")
