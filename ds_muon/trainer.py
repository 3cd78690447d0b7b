"""``ds_muon.trainer.MuonTrainer``: ``transformers.Trainer`` that trains with ds_muon.

    from ds_muon.trainer import MuonTrainer

    trainer = MuonTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                          muon_settings=dict(lr=0.02, adam_lr=3e-4))
    trainer.train()                                  # resume_from_checkpoint=... resumes bitwise

The Trainer builds the optimizer itself under DeepSpeed and FSDP (it refuses one passed as
``optimizers=``), so the subclass does it in ``create_optimizer``: a :class:`ds_muon.Muon` over
:func:`ds_muon.muon_param_groups` of the model the Trainer hands it (under FSDP2 the sharded
one).  Under DeepSpeed (``TrainingArguments(deepspeed=...)``) the config's ``"type": "DsMuon"``
entry gives the settings (``muon_settings`` override them) and leaves the config, and the Muon
is bound to the engine the Trainer builds before the first step.  Without a GPU, FSDP2
(``fsdp="full_shard", fsdp_config={"fsdp_version": 2}``) runs accelerate's real FSDP2 path,
which accelerate itself only allows on accelerators.

Evaluate before training with ``TrainingArguments(eval_on_start=True)``: ``trainer.evaluate()``
before ``trainer.train()`` in a multi-process run prepares the model for inference only (no DDP,
no DeepSpeed optimizer), so this class refuses it on every rank with that advice.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch
from transformers import Trainer, TrainerCallback

from .optimizer import Muon
from .setup.accelerate_fsdp2 import no_gpu, use_fsdp2
from .setup.build import build_deepspeed_muon, build_muon
from .setup.deepspeed_bind import bind
from .setup.dsmuon_entry import take_dsmuon_entry
from .unwrap import find_muon

__all__ = ["MuonTrainer"]


def _check_world(num_processes: int) -> None:
    """The launcher's world is the Trainer's: on a machine without a GPU, accelerate joins the processes
    only with ``use_cpu=True``; without it each runs alone (DDP averages nothing; DeepSpeed, which starts
    its own process group, trains, and evaluation then fails in gloo's allgather)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and num_processes == 1 and no_gpu():
        raise RuntimeError(
            f"MuonTrainer: the launcher started {launched} processes but the Trainer runs each one alone: without a "
            "GPU, accelerate joins them only with TrainingArguments(use_cpu=True); pass use_cpu=True "
            "(e.g. use_cpu=not torch.cuda.is_available())")


class _BindToEngine(TrainerCallback):
    """Binds the Muon to the DeepSpeed engine once the Trainer has built it (before any step)."""

    def __init__(self, trainer: "MuonTrainer"):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._bind_engine()


class MuonTrainer(Trainer):
    """``transformers.Trainer`` with a ds_muon optimizer for DDP, FSDP2 and DeepSpeed ZeRO 0-3.

    ``muon_settings``: :func:`ds_muon.muon_param_groups` and :class:`ds_muon.Muon` keywords
    (``lr``, ``adam_lr``, ``weight_decay``, ``ns_dtype``, ...).  ``trainer.muon`` is the optimizer
    once training has started.  ``TrainingArguments.learning_rate`` is not used: the Trainer's
    LR schedule scales each group's own ``lr``, so Muon's and AdamW's keep their ratio.
    """

    def __init__(self, *args, muon_settings: Optional[Dict[str, Any]] = None, **kwargs):
        optimizers = kwargs.get("optimizers") or (None, None)
        if optimizers[0] is not None:
            raise TypeError("MuonTrainer builds its ds_muon.Muon itself (the Trainer refuses a prebuilt optimizer "
                            "under DeepSpeed and FSDP); pass its settings as muon_settings=dict(lr=..., ...)")
        self.muon_settings = dict(muon_settings or {})
        self.muon: Optional[Muon] = None
        self._deepspeed_params: Optional[Dict[str, Any]] = None
        super().__init__(*args, **kwargs)
        self.add_callback(_BindToEngine(self))

    # -- set-up ---------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        _check_world(self.accelerator.num_processes)
        if self.args.fsdp_plugin_args is not None and not self.is_fsdp_enabled and no_gpu():
            # accelerate dropped the FSDP plugin on CPU: run its FSDP2 path anyway (ds_muon.setup.accelerate_fsdp2)
            from accelerate.utils import FullyShardedDataParallelPlugin

            use_fsdp2(self.accelerator, FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
            self.is_fsdp_enabled = True
        elif self.is_fsdp_enabled:
            use_fsdp2(self.accelerator)  # FSDP1 raises: accelerate builds its optimizer differently
        if self.is_deepspeed_enabled:
            hf_config = self.accelerator.state.deepspeed_plugin.hf_ds_config
            self._deepspeed_params = take_dsmuon_entry(hf_config.config, self.muon_settings)  # the dict DeepSpeed gets
            # the Trainer compared the entry's lr with TrainingArguments.learning_rate, which ds_muon does not use
            hf_config.mismatches = [m for m in getattr(hf_config, "mismatches", []) if "ds optimizer." not in m]

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """A :class:`ds_muon.Muon` over ``muon_param_groups`` of the model the Trainer trains."""
        if self.optimizer is None:
            model = model if model is not None else self.model
            if self._deepspeed_params is not None:
                self.muon = build_deepspeed_muon(model, self._deepspeed_params)
            else:
                self.muon = build_muon(model, self.muon_settings)
            self.optimizer = self.muon
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer calls this right after ``accelerator.prepare`` built the DeepSpeed engine and
        before ``resume_from_checkpoint`` loads into it: bind there, so the load is ds_muon's (ZeRO-3's
        universal loader reads every group's keys; DeepSpeed's own fails on a Muon group)."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        wrapped = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        if self.is_deepspeed_enabled and self.muon is not None and wrapped is not None:
            self._bind_engine(wrapped.engine)
        return scheduler

    def _bind_engine(self, engine=None) -> None:
        if self.is_deepspeed_enabled:
            engine = engine if engine is not None else self.model_wrapped
            if find_muon(getattr(engine, "optimizer", None), required=False) is not self.muon:
                raise RuntimeError("MuonTrainer: the DeepSpeed engine does not step this trainer's ds_muon.Muon")
            if self.muon.adapter is None or getattr(self.muon.adapter, "engine", None) is not engine:
                bind(engine, self.muon)

    def compute_loss(self, model, inputs, *args, **kwargs):
        """The Trainer's loss; under DeepSpeed a tensor of its own, not the model output's.

        The Trainer hands the loss to the engine with ``scale_wrt_gas=False`` (it has scaled it for
        accumulation).  DeepSpeed 0.19's engine also hooks the forward's output tensors to divide their
        gradient by ``gradient_accumulation_steps`` unless the engine's own hook on the loss has fired
        first; on the output's own loss tensor (ZeRO-0, where no loss scaler makes a new one) the output
        hook fired first and accumulation averaged over m**2.  A clone puts the engine's hook first."""
        out = super().compute_loss(model, inputs, *args, **kwargs)
        if not self.is_deepspeed_enabled:
            return out
        if isinstance(out, tuple):
            return (out[0].clone(),) + tuple(out[1:])
        return out.clone()

    # -- the evaluate() ordering trap -------------------------------------------------------------
    def evaluate(self, *args, **kwargs):
        if not self.is_in_train and self.optimizer is None and self.args.world_size > 1:
            raise RuntimeError(
                "MuonTrainer: evaluate() before train() in a multi-process run prepares the model for inference "
                "only (no DDP wrapper, no DeepSpeed optimizer), and training after it would not average gradients "
                "or step ds_muon. Evaluate first with TrainingArguments(eval_on_start=True) instead")
        return super().evaluate(*args, **kwargs)
