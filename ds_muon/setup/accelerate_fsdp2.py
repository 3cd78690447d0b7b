"""accelerate's FSDP launches as ds_muon runs them: FSDP2 only, and on CPU-only machines too.

accelerate builds an FSDP1 optimizer after wrapping, and refuses FSDP without an accelerator (it falls back
to DDP); its FSDP2 code itself runs on CPU tensors with gloo, so :func:`use_fsdp2` switches the accelerator's
state to it.  ``prepare`` and ``MuonTrainer`` both call it.
"""

from __future__ import annotations

import os

import torch


def env_flag(name: str) -> bool:
    """A launch setting accelerate writes into the environment as ``"true"`` / ``"false"``."""
    return os.environ.get(name, "false").lower() == "true"


def no_gpu() -> bool:
    """No CUDA device: accelerate's CPU fallbacks apply."""
    return not torch.cuda.is_available()


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
        if plugin.fsdp_version == 2 and (env_flag("FSDP_OFFLOAD_PARAMS") or _offloads(plugin)):
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
