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

import os
from typing import Optional

import torch

from .optimizer import Muon
from .setup.accelerate_fsdp2 import env_flag, no_gpu, use_fsdp2
from .setup.build import build_deepspeed_muon, build_muon, split_settings
from .setup.deepspeed_bind import bind
from .setup.dsmuon_entry import take_dsmuon_entry
from .unwrap import find_muon as _find_muon

__all__ = ["Accelerator", "prepare", "find_muon", "split_settings"]


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
            if env_flag("ACCELERATE_USE_DEEPSPEED"):
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
    return env_flag("ACCELERATE_USE_FSDP") and int(os.environ.get("LOCAL_RANK", "-1")) != -1


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
    if env_flag("ACCELERATE_USE_FSDP") or accelerator.distributed_type == DistributedType.FSDP:
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


def _prepare_deepspeed(accelerator, model, objects, optimizer, settings):
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
    bind(engine, muon)
    _check_wrapped(opt, muon)
    return (engine, opt, *rest)


def _check_wrapped(opt, muon: Muon) -> None:
    if find_muon(opt) is not muon:
        raise RuntimeError(f"ds_muon.accelerate.prepare: accelerate returned {type(opt).__name__} without the "
                           "ds_muon.Muon inside")
