"""Which FSDP unit holds each parameter: the one place the overlap hooks learn it."""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import nn


def _fsdp_units() -> tuple:
    """Every FSDP unit type (FSDP2's FSDPModule, FSDP1); empty where torch has no FSDP."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:  # pragma: no cover
        return ()
    return FSDPModule, FSDP1


def _walk(model: nn.Module) -> Iterator[Tuple[torch.Tensor, Optional[nn.Module], nn.Module]]:
    """Every (parameter, innermost FSDP unit above it or None, module that owns it directly),
    in module order; a parameter shared by several modules appears once per module."""
    units = _fsdp_units()

    def visit(mod: nn.Module, unit: Optional[nn.Module]):
        if units and isinstance(mod, units):
            unit = mod
        for p in mod.parameters(recurse=False):
            yield p, unit, mod
        for child in mod.children():
            yield from visit(child, unit)

    yield from visit(model, None)


def hook_owner(model: nn.Module) -> Dict[int, nn.Module]:
    """For each parameter (by id), the module whose forward first needs it up to date:
    the innermost FSDP unit that holds it (FSDP gathers shards in that unit's pre-forward),
    else the module that owns it directly."""
    owner: Dict[int, nn.Module] = {}
    for p, unit, mod in _walk(model):
        owner.setdefault(id(p), unit if unit is not None else mod)
    return owner
