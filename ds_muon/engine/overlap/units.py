"""Which FSDP unit holds each parameter: the one place the overlap hooks learn it."""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

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


def hook_owners(model: nn.Module) -> Dict[int, List[nn.Module]]:
    """For each parameter (by id), every module whose pre-forward may be the first to need it
    up to date: the innermost FSDP unit (else the module) above *each* module that owns it
    (a tied weight has several, run in any order), and under FSDP2 the unit whose parameter
    group all-gathers it (a weight shared by two units is managed by a common ancestor)."""
    owners: Dict[int, List[nn.Module]] = {}

    def add(pid: int, mod: nn.Module) -> None:
        lst = owners.setdefault(pid, [])
        if all(m is not mod for m in lst):
            lst.append(mod)

    for p, unit, mod in _walk(model):
        add(id(p), unit if unit is not None else mod)
    for unit in fsdp_units(model):
        if _is_fsdp2(unit):
            group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)
            for fp in getattr(group, "fsdp_params", ()) if group is not None else ():
                add(id(fp.sharded_param), unit)
    return owners


def fsdp_units(model: nn.Module) -> List[nn.Module]:
    """Every FSDP unit in ``model`` (FSDP2 modules and FSDP1 wrappers), in module order."""
    units = _fsdp_units()
    return [m for m in model.modules() if units and isinstance(m, units)]


def _is_fsdp2(mod: nn.Module) -> bool:
    return hasattr(mod, "_get_fsdp_state")


def gathered_in_pre_forward(unit: nn.Module, fsdp1_by_handle: Dict[int, nn.Module]) -> List[nn.Module]:
    """The units whose shards FSDP all-gathers in ``unit``'s pre-forward, ``unit`` included:

    * FSDP2: every module of a grouped ``fully_shard([a, b])`` (one all-gather for all), and
      the units named by ``set_modules_to_forward_prefetch`` (with their groups);
    * FSDP1: with ``forward_prefetch=True``, the unit of the handle FSDP picks from the
      forward order it recorded in the first iteration (``fsdp1_by_handle``: id(handle) -> unit).

    Read at every call: prefetch lists may be set, and FSDP1's order is recorded, after the
    hooks are placed.  Gathering may be skipped (already gathered); landing early is harmless."""
    if _is_fsdp2(unit):
        state = unit._get_fsdp_state()
        out = list(state._modules)
        for target in state._states_to_forward_prefetch:
            out.extend(target._modules)
        return out
    out = [unit]
    handle = getattr(unit, "_handle", None)
    if handle is not None and getattr(unit, "forward_prefetch", False):
        target = unit._exec_order_data.get_handle_to_forward_prefetch(handle)
        if target is not None and id(target) in fsdp1_by_handle:
            out.append(fsdp1_by_handle[id(target)])
    return out


def fsdp1_units_by_handle(model: nn.Module) -> Dict[int, nn.Module]:
    """id(FlatParamHandle) -> the FSDP1 unit that owns it (FSDP1's prefetch names handles)."""
    return {id(u._handle): u for u in fsdp_units(model) if not _is_fsdp2(u) and getattr(u, "_handle", None)}


def all_gather_streams(unit: nn.Module) -> list:
    """The streams FSDP reads ``unit``'s shards on when it all-gathers them (set up at FSDP's
    lazy init; none before): FSDP2's copy-in and all-gather streams, FSDP1's pre-unshard and
    unshard streams."""
    if _is_fsdp2(unit):
        ctx = unit._get_fsdp_state()._comm_ctx
        names, owner = ("all_gather_copy_in_stream", "all_gather_stream"), ctx
    else:
        names, owner = ("_pre_unshard_stream", "_unshard_stream"), unit
    return [s for s in (getattr(owner, n, None) for n in names) if hasattr(s, "wait_event")]
