"""The adapter a :class:`~ds_muon.Muon` uses unless it is given one: picks the stack per tensor.

Stacks may swap tensors after the optimizer is built (FSDP2's ``fully_shard``,
accelerate), so the choice is made from each tensor when it is bound, not once:
a DTensor is FSDP2's, a ``FlatParameter`` (or a tensor FSDP1 flattened into one)
FSDP1's, anything else is held whole or is a tensor-parallel shard
(:class:`~ds_muon.integrations.local.LocalAdapter`).  DeepSpeed replaces the
tensors with flat partitions only it can describe: it needs
``ds_muon.deepspeed.bind(engine)``, and a 1-D tensor in a Muon group
that no stack flattened is refused here rather than orthogonalized as a vector.
"""

from __future__ import annotations

import torch

from ..engine.exchange.layout import ParamBinding, global_shape
from ..tensors.tag_keys import TENSOR_PARALLEL
from .base import FLAT_PARTITION, HOW_TO_BIND, BindContext
from .fsdp1 import Fsdp1Adapter, is_flattened_by_fsdp1
from .fsdp2 import Fsdp2Adapter, is_dtensor, place_grads
from .local import LocalAdapter


class DefaultAdapter:
    """FSDP2 for DTensors, FSDP1 for FlatParameters and the tensors FSDP1 flattened
    (``use_orig_params=True``, needs ``Muon(..., model=)``), else whole or tensor-parallel."""

    applies_in_step = False
    data_parallel_group = None

    def __init__(self):
        self.local, self.fsdp1, self.fsdp2 = LocalAdapter(), Fsdp1Adapter(), Fsdp2Adapter()

    def bind(self, param: torch.Tensor, name: str, context: BindContext) -> ParamBinding:
        if len(global_shape(param)) < 2 and not _holds_flat_matrices(param):
            raise RuntimeError(unbound_message(name, param))
        return self._adapter_for(param, name).bind(param, name, context)

    def grad_final_at_hook(self, param: torch.Tensor, context: BindContext) -> bool:
        return self._adapter_for(param, "a tensor").grad_final_at_hook(param, context)

    def place_grads(self, items, name) -> None:
        """DTensor gradients laid out like their parameters (:func:`~ds_muon.integrations.fsdp2.place_grads`)."""
        place_grads(items, name)

    def check_loaded(self, groups, state_dict, name, model) -> None:
        """The stacks' refusals of a loaded state dict (FSDP1's: keys torch's CPU offload overwrote)."""
        self.fsdp1.check_loaded(groups, state_dict, name, model)

    def _adapter_for(self, param: torch.Tensor, name: str):
        if getattr(param, TENSOR_PARALLEL, None) is not None:
            if is_dtensor(param) or is_flattened_by_fsdp1(param):
                raise NotImplementedError(
                    f"ds_muon: {name} is tagged tensor_parallel but is also sharded by FSDP/DTensor; ds_muon supports "
                    "tensor-parallel shards that are plain tensors (replicated over data parallelism or DDP)")
            return self.local
        if is_dtensor(param):
            return self.fsdp2
        if is_flattened_by_fsdp1(param):
            return self.fsdp1
        return self.local


def default_adapter() -> DefaultAdapter:
    """A fresh :class:`DefaultAdapter` (it caches what it read of an FSDP1 model)."""
    return DefaultAdapter()


def _holds_flat_matrices(p: torch.Tensor) -> bool:
    """Flat shards that hold matrices although they are 1-D (FSDP1 FlatParameter and views, ZeRO partitions).
    A ZeRO-3 parameter is not one: its real shape is ``ds_shape`` (:func:`~ds_muon.engine.exchange.layout.global_shape`)."""
    return hasattr(p, "_fqns") or getattr(p, FLAT_PARTITION, False) or getattr(p, "_fsdp_flattened", False)


def unbound_message(name: str, p: torch.Tensor) -> str:
    """A 1-D tensor in a Muon group that no adapter described: a stack swapped it in."""
    return (
        f"ds_muon: a Muon group holds a 1-D tensor of {p.numel()} elements where {name} was: a training stack "
        "replaced the parameters with flat partitions ds_muon was not told about, and running Muon on them would "
        "orthogonalize the wrong thing. With DeepSpeed: " + HOW_TO_BIND
    )
