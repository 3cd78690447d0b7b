"""One small module per training stack; each only *describes* where shards live.

A binder maps one tensor the optimizer steps to a :class:`~ds_muon.layout.ParamBinding`.
:func:`default_binder` picks the right one from the tensor itself; stacks that own
their tensors (DeepSpeed) install their own binder on the optimizer.
"""

from __future__ import annotations

from ..layout import ParamBinding
from ..tagging import TENSOR_PARALLEL
from .fsdp import fsdp_binder, is_dtensor, is_flat_param
from .local import bind_replicated, bind_tensor_parallel


def default_binder(optimizer, param, name: str) -> ParamBinding:
    """FSDP2 for DTensors, FSDP1 for FlatParameters and the original parameters FSDP1
    flattened (``use_orig_params=True``, needs ``optimizer.model``), else replicated."""
    if getattr(param, TENSOR_PARALLEL, None) is not None:
        if not is_plain_tensor(param):
            raise NotImplementedError(
                f"ds_muon: {name} is tagged tensor_parallel but is also sharded by FSDP/DTensor; ds_muon supports "
                "tensor-parallel shards that are plain tensors (replicated over data parallelism or DDP)")
        return bind_tensor_parallel(param, name, optimizer.process_group)
    binding = fsdp_binder(optimizer, param, name)
    if binding is not None:
        return binding
    return bind_replicated(param, name, optimizer.process_group)


def is_plain_tensor(param) -> bool:
    return not (is_dtensor(param) or is_flat_param(param) or getattr(param, "_fsdp_flattened", False))
