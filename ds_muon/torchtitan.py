"""``ds_muon.torchtitan``: ds_muon as torchtitan's optimizer (FSDP2 x TP meshes, DCP checkpoints).

torchtitan builds its optimizer after parallelizing the model, from the job config, as a container
over the model parts (one part per pipeline stage a rank holds) that its trainer steps and its
checkpointer saves through DCP.  Both of torchtitan's hooks are here:

* torchtitan 0.3 (``Configurable`` configs): ``optimizer=ds_muon.torchtitan.MuonOptimizers.Config(
  lr=0.02, adam_lr=3e-4)`` in the trainer's config; the trainer calls ``.build(model_parts=...)``.
* torchtitan 0.1/0.2 (``TrainSpec``): ``build_optimizers_fn=ds_muon.torchtitan.build_optimizers``; it reads
  the job's ``[optimizer]`` section (``lr`` is AdamW's, see :func:`build_optimizers`).

The container steps one :class:`ds_muon.Muon` over :func:`ds_muon.muon_param_groups` per model part
(the parts' parameters are the DTensors ``fully_shard`` and ``parallelize_module`` made; ds_muon reads
their meshes itself), and its ``state_dict``/``load_state_dict`` are DCP's flattened
``get_optimizer_state_dict``/``set_optimizer_state_dict`` (keys by parameter name), as torchtitan's own
container had them before 0.3: sharded save and load, also to another mesh.

Not supported: more than one model part per rank (pipeline schedules with several stages per rank)
and torchft (``ft_manager``): both raise.  This module does not import torchtitan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn

from .optimizer import Muon
from .param_groups import muon_param_groups

__all__ = ["MuonOptimizers", "build_optimizers"]

_GROUP_KEYS = ("adam_lr", "adam_weight_decay", "weight_decay", "lr", "head_names", "exclude", "include", "routers",
               "split_fused", "split_attention")


class MuonOptimizers(torch.optim.Optimizer):
    """torchtitan's optimizers container with a :class:`ds_muon.Muon` per model part.

    What torchtitan's trainer, LR schedulers and checkpointer use: ``step()``, ``zero_grad()``,
    iteration over the optimizers (``LRSchedulersContainer`` makes one ``LambdaLR`` per Muon, so
    Muon's and AdamW's ``lr`` keep their ratio), ``optimizers``, ``model_parts``, step hooks
    (``register_step_pre_hook``, MoE load balancing), ``state_dict()``/``load_state_dict()``.
    """

    @dataclass
    class Config:
        """The job config's optimizer entry: group settings and any other :class:`ds_muon.Muon` keyword."""

        lr: float = 0.02
        adam_lr: float = 3e-4
        weight_decay: float = 0.0
        adam_weight_decay: float = 0.0
        muon: Dict[str, Any] = field(default_factory=dict)  # e.g. {"ns_dtype": "bfloat16", "overlap": True}

        def build(self, *, model_parts: List[nn.Module]) -> "MuonOptimizers":
            return MuonOptimizers(self, model_parts=model_parts)

        def to_dict(self) -> dict:
            return dataclasses.asdict(self)

    def __init__(self, config: "MuonOptimizers.Config", *, model_parts: List[nn.Module]) -> None:
        self.model_parts = list(model_parts)
        if len(self.model_parts) != 1:
            raise NotImplementedError(
                f"ds_muon.torchtitan: {len(self.model_parts)} model parts on one rank (a pipeline schedule with "
                "several stages per rank); ds_muon steps one part per rank. Use one stage per rank")
        settings = dict(config.muon)
        for key in ("ns_dtype", "comm_dtype"):
            if isinstance(settings.get(key), str) and settings[key] != "auto":  # a TOML/CLI string such as "bfloat16"
                settings[key] = getattr(torch, settings[key])
        group_kw = {k: settings.pop(k) for k in _GROUP_KEYS if k in settings}
        group_kw.update(lr=config.lr, adam_lr=config.adam_lr, weight_decay=config.weight_decay,
                        adam_weight_decay=config.adam_weight_decay)
        self.optimizers: List[Muon] = [Muon(muon_param_groups(part, **group_kw), **settings)
                                       for part in self.model_parts]
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        torch.optim.Optimizer.__init__(self, params, {})  # hooks and param_groups, as torchtitan's container

    def __iter__(self) -> Iterator[Muon]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ds_muon.torchtitan: the container steps without a closure (torchtitan's never passes one)")
        for opt in self.optimizers:
            opt.step()  # (a DTensor gradient placed unlike its parameter: Muon redistributes it, fsdp2.place_grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        """DCP's flattened optimizer state of every part (keys by parameter name)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        return {k: v for part, opt in zip(self.model_parts, self.optimizers)
                for k, v in get_optimizer_state_dict(part, opt, options=options).items()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        for part, opt in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(part, opt, optim_state_dict=state_dict, options=options)


def build_optimizers(model_parts: List[nn.Module], optimizer_config: Optional[Any] = None, parallel_dims=None,
                     ft_manager=None, **settings: Any) -> MuonOptimizers:
    """torchtitan's ``build_optimizers_fn`` (TrainSpec, torchtitan 0.1/0.2): a :class:`MuonOptimizers`.

    From the job's ``[optimizer]`` section: ``lr`` is the AdamW group's (torchtitan's values are
    AdamW-scale), ``weight_decay``, ``eps`` and ``beta1``/``beta2`` too; Muon's own settings come from
    ``settings`` (``lr`` = Muon's, default 0.02; any :class:`ds_muon.Muon` keyword), e.g. through
    ``functools.partial(build_optimizers, lr=0.02, ns_dtype=torch.bfloat16)``.  The older signature
    ``build_optimizers(model_parts, job_config)`` is read too (its ``.optimizer`` section).
    """
    if ft_manager is not None and getattr(ft_manager, "enabled", True):
        raise NotImplementedError("ds_muon.torchtitan: torchft (ft_manager) is not supported")
    section = getattr(optimizer_config, "optimizer", optimizer_config)  # a job config or its optimizer section
    muon = dict(settings)
    cfg = MuonOptimizers.Config(lr=muon.pop("lr", 0.02))
    if section is not None:
        cfg.adam_lr = float(getattr(section, "lr", cfg.adam_lr))
        cfg.adam_weight_decay = float(getattr(section, "weight_decay", cfg.adam_weight_decay))
        if hasattr(section, "eps"):
            muon.setdefault("adam_eps", float(section.eps))
        if hasattr(section, "beta1") and hasattr(section, "beta2"):
            muon.setdefault("adam_betas", (float(section.beta1), float(section.beta2)))
    cfg.weight_decay = float(muon.pop("weight_decay", cfg.weight_decay))
    cfg.adam_lr = float(muon.pop("adam_lr", cfg.adam_lr))
    cfg.muon = muon
    return cfg.build(model_parts=model_parts)
