"""Which FSDP unit holds each parameter: the one place the overlap hooks learn it."""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import nn


def _fsdp_types() -> Tuple[tuple, tuple]:
    """(FSDP2 unit types, every FSDP unit type); empty where torch has no FSDP."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:  # pragma: no cover
        return (), ()
    return (FSDPModule,), (FSDPModule, FSDP1)


def _walk(model: nn.Module) -> Iterator[Tuple[torch.Tensor, Optional[nn.Module], nn.Module]]:
    """Every (parameter, innermost FSDP unit above it or None, module that owns it directly),
    in module order; a parameter shared by several modules appears once per module."""
    _, units = _fsdp_types()

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


def final_grad_params(model: nn.Module) -> set:
    """Ids of parameters whose post-accumulate-grad hook sees the final gradient:
    those of FSDP2 units (the hook runs after the reduce-scatter)."""
    fsdp2, _ = _fsdp_types()
    return {id(p) for p, unit, _ in _walk(model) if fsdp2 and isinstance(unit, fsdp2)}
