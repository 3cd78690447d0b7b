"""One small module per training stack; each only *describes* where shards live.

A binder maps one tensor the optimizer steps to a :class:`~ds_muon.layout.ParamBinding`.
:func:`default_binder` picks the right one from the tensor itself; stacks that own
their tensors (DeepSpeed) install their own binder on the optimizer.
"""

from __future__ import annotations

from ..layout import ParamBinding
from .fsdp import fsdp_binder
from .local import bind_replicated


def default_binder(optimizer, param, name: str) -> ParamBinding:
    """FSDP2 for DTensors, FSDP1 for FlatParameters and the original parameters FSDP1
    flattened (``use_orig_params=True``, needs ``optimizer.model``), else replicated."""
    binding = fsdp_binder(optimizer, param, name)
    if binding is not None:
        return binding
    return bind_replicated(param, name, optimizer.process_group)
