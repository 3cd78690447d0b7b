"""One small module per training stack; each only *describes* where shards live.

A binder maps one tensor the optimizer steps to a :class:`~ds_muon.layout.ParamBinding`.
:func:`default_binder` picks the right one from the tensor itself; stacks that own
their tensors (DeepSpeed) install their own binder on the optimizer.
"""

from __future__ import annotations

from ..layout import ParamBinding
from .local import bind_replicated


def default_binder(optimizer, param, name: str) -> ParamBinding:
    return bind_replicated(param, name, optimizer.process_group)
