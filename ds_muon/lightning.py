"""``ds_muon.lightning``: ds_muon under PyTorch Lightning (``lightning.Fabric`` and ``lightning.Trainer``).

DDP and FSDP2 (Lightning's ``ModelParallelStrategy``) need nothing from here: return
``ds_muon.Muon(ds_muon.muon_param_groups(self))`` from ``configure_optimizers`` (Fabric: pass it
to ``fabric.setup``/``setup_optimizers``), since those strategies keep the model's own parameters
(DDP) or swap in DTensors ds_muon reads by itself (FSDP2).

DeepSpeed is the one strategy that needs a change: it replaces the optimizer's parameters with
flat ZeRO partitions, and only the engine knows where each matrix went.  Lightning's
``DeepSpeedStrategy`` builds the engine inside ``fit``/``setup`` where no user code runs, so a
Muon passed through it is unbound and refuses to step (on every rank, naming this module).
:class:`DeepSpeedStrategy` (Trainer) and :class:`FabricDeepSpeedStrategy` (Fabric) are Lightning's
own strategies whose engine is built by :func:`ds_muon.deepspeed.initialize`: the Muon from
``configure_optimizers`` (or from a ``"type": "DsMuon"`` entry in the strategy's ``config``) is
bound to the engine before anything steps or a checkpoint loads.

Two more differences from Lightning's own strategies, each found against one process (tests/door_matrix.py):
the Trainer's loss is divided once for accumulation (Lightning's divides it twice), and Fabric at ZeRO-0
clips by the config's ``gradient_clipping`` (Lightning's skips it there).

Lightning refuses DeepSpeed without CUDA; with DeepSpeed's CPU accelerator
(``DS_ACCELERATOR=cpu``) these two run it on CPU/gloo, as ``ds_muon.deepspeed.initialize`` does.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .setup.deepspeed_initialize import initialize
from .setup.dsmuon_entry import is_dsmuon_entry
from .unwrap import find_muon

try:
    from lightning.fabric.strategies import DeepSpeedStrategy as _FabricDeepSpeed
    from lightning.pytorch.strategies import DeepSpeedStrategy as _TrainerDeepSpeed
except ImportError as e:  # pragma: no cover - only without lightning
    raise ImportError("ds_muon.lightning needs the lightning package: pip install 'lightning>=2.5'") from e

__all__ = ["DeepSpeedStrategy", "FabricDeepSpeedStrategy"]


def _deepspeed_on_cpu() -> bool:
    """DeepSpeed's accelerator is the CPU one (``DS_ACCELERATOR=cpu``, or no GPU)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


@contextlib.contextmanager
def _cpu_device_indices(strategy):
    """Lightning's DeepSpeed set-up checks each device's index against the local ranks; a CPU device has none.
    For that check only, the CPU devices carry the local ranks as indices."""
    devices = strategy.parallel_devices
    if devices and all(d.type == "cpu" and d.index is None for d in devices):
        strategy.parallel_devices = [torch.device("cpu", i) for i in range(len(devices))]
    try:
        yield
    finally:
        strategy.parallel_devices = devices


def _initialize(strategy, model, optimizer, scheduler):
    """``deepspeed.initialize`` as Lightning calls it, through ds_muon's (which binds the Muon)."""
    import argparse

    config = strategy.config
    if optimizer is None and not is_dsmuon_entry(config):
        raise ValueError("ds_muon.lightning: no optimizer reached the DeepSpeed strategy; return "
                         "ds_muon.Muon(ds_muon.muon_param_groups(self)) from configure_optimizers (Fabric: pass it to "
                         'fabric.setup), or put "optimizer": {"type": "DsMuon", ...} in the strategy\'s config')
    if optimizer is not None and find_muon(optimizer, required=False) is None:
        raise TypeError(f"ds_muon.lightning: the optimizer is a {type(optimizer).__name__}, not a ds_muon.Muon; use "
                        "Lightning's own DeepSpeedStrategy for other optimizers")
    model_parameters = None if is_dsmuon_entry(config) else [
        p for p in model.parameters() if p.requires_grad]
    index = strategy.root_device.index  # None on CPU, where DeepSpeed reads LOCAL_RANK itself
    return initialize(
        args=None if index is None else argparse.Namespace(device_rank=index), config=config, model=model,
        model_parameters=model_parameters, optimizer=optimizer, lr_scheduler=scheduler, dist_init_required=False)


class DeepSpeedStrategy(_TrainerDeepSpeed):
    """``lightning.pytorch.strategies.DeepSpeedStrategy`` (same arguments) whose engine steps a bound ds_muon.Muon.

    ``Trainer(strategy=ds_muon.lightning.DeepSpeedStrategy(stage=2))`` in place of
    ``strategy="deepspeed_stage_2"``; ``configure_optimizers`` returns the Muon, or the
    ``config=`` dict carries a ``"type": "DsMuon"`` entry (then, Lightning's rule for an optimizer in the
    config, ``configure_optimizers`` is not asked).
    """

    def setup_environment(self) -> None:
        if _deepspeed_on_cpu() and self.accelerator is not None and self.root_device.type == "cpu":
            super(_TrainerDeepSpeed, self).setup_environment()  # Lightning's DDP set-up, without the CUDA check
            return
        super().setup_environment()

    def setup_distributed(self) -> None:
        with _cpu_device_indices(self):
            super().setup_distributed()

    def _setup_model_and_optimizer(self, model, optimizer: Optional[object], lr_scheduler=None):
        engine, ds_optimizer, _, _ = _initialize(self, model, optimizer, lr_scheduler)
        return engine, ds_optimizer

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        """The loss once divided by ``accumulate_grad_batches``: Lightning's loop has divided it, so the engine
        must not divide it by its ``gradient_accumulation_steps`` (the same number) again, as Lightning's own
        strategy lets it (the Trainer's accumulation then averaged the micro-batches' gradients over m**2)."""
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)


class FabricDeepSpeedStrategy(_FabricDeepSpeed):
    """``lightning.fabric.strategies.DeepSpeedStrategy`` (same arguments) whose engine steps a bound ds_muon.Muon.

    ``Fabric(strategy=ds_muon.lightning.FabricDeepSpeedStrategy(stage=2))``, then
    ``model, optimizer = fabric.setup(model, ds_muon.Muon(ds_muon.muon_param_groups(model)))``.
    """

    def setup_environment(self) -> None:
        if _deepspeed_on_cpu() and self.root_device.type == "cpu":
            super(_FabricDeepSpeed, self).setup_environment()
            return
        super().setup_environment()

    def _setup_distributed(self) -> None:
        with _cpu_device_indices(self):
            super()._setup_distributed()

    def _initialize_engine(self, model, optimizer=None, scheduler=None):
        engine, ds_optimizer, _, ds_scheduler = _initialize(self, model, optimizer, scheduler)
        return engine, ds_optimizer, ds_scheduler

    def optimizer_step(self, optimizer, **kwargs):
        """Fabric steps the engine's optimizer, not the engine; at ZeRO-0 in fp32 that optimizer is the Muon
        itself and the config's ``gradient_clipping`` lives in ``engine.step()``, so it was silently skipped.
        Clip there as the engine does (ZeRO-1-3 and fp16/bf16 wrappers clip inside their own step)."""
        engine = self._deepspeed_engine
        if (engine is not None and optimizer is engine.optimizer and engine.gradient_clipping() > 0.0
                and not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization())):
            engine.clip_fp32_gradients()
        return super().optimizer_step(optimizer, **kwargs)
