"""Fused expert stacks and routers of Hugging Face MoE models: what :func:`ds_muon.muon_param_groups` does with them.

transformers 5 keeps a MoE layer's experts fused on one module: ``gate_up_proj``
``[E, 2·ff, d]`` and ``down_proj`` ``[E, d, ff]`` (``up_proj`` without a gate).
Untagged, Muon would orthogonalize each stack as one ``[E, 2·ff·d]`` matrix.  The
module is recognised by the flags transformers' ``@use_experts_implementation``
sets on every instance (``is_concatenated``, ``is_transposed``, ``has_gate``), not
by class name, so every family it decorates is covered.  By default:

* each expert is its own matrix (:func:`ds_muon.expert_weight`), and the gate and
  up halves of ``gate_up_proj`` are separate row blocks (:func:`ds_muon.split_rows`);
  stacks stored ``[E, in, out]`` (``is_transposed``) are also tagged
  :func:`ds_muon.transposed` so their scale factor reads ``[out, in]``;
* expert biases (``*_bias``, ``[E, out]``) take AdamW;
* routers take AdamW (``routers="adamw"``): modules whose class name contains
  ``Router``, and gate-named siblings of an experts module (Qwen2-MoE's
  ``shared_expert_gate``).  ``routers="muon"`` leaves their weights to Muon.

A ``gate_up_proj`` stored ``[E, in, 2·ff]`` or interleaved (GPT-OSS) has no gate
and up row blocks: it raises unless the user tags it first (``expert_weight``
alone orthogonalizes each expert's ``[gate | up]`` jointly) or puts it in AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple  # noqa: F401

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

from ..tensors.shape import global_shape
from ..tensors.tag_keys import EXPERTS
from .module_types import STACK_NAMES, is_fused_experts, is_router, mark_routers
from .tags import expert_weight, split_rows, transposed

ROUTERS = ("adamw", "muon")


@dataclass(frozen=True)
class StackPlan:
    """How one fused stack is orthogonalized: per expert, in ``blocks`` rows (None: whole), scale read
    from ``[out, in]`` when stored ``[in, out]`` (``transposed``)."""

    blocks: Optional[Dict[str, int]]
    transposed: bool


def check_routers(routers: str) -> None:
    if routers not in ROUTERS:
        raise ValueError(f"muon_param_groups: routers={routers!r} is unknown; use one of {list(ROUTERS)}")


def stack_plan(module: nn.Module, pname: str, shape: Sequence[int], name: str) -> Optional[StackPlan]:
    """The plan for parameter ``pname`` (global ``shape``) of ``module``; None when it is not a fused
    expert stack.  Raises for a gate_up stack whose gate and up are not row blocks."""
    if not is_fused_experts(module) or pname not in STACK_NAMES or len(shape) < 3:
        return None
    stored_transposed = bool(module.is_transposed)
    if pname != "gate_up_proj" or not module.has_gate:
        return StackPlan(None, stored_transposed)
    if stored_transposed or not module.is_concatenated:
        layout = " and ".join(w for w, on in (("as [E, in, 2*ff] (is_transposed)", stored_transposed),
                                              ("interleaved (is_concatenated=False)", not module.is_concatenated)) if on)
        raise NotImplementedError(
            f"muon_param_groups: {name} {tuple(shape)} of {type(module).__name__} stores gate and up {layout}, "
            "so they are not row blocks ds_muon can orthogonalize apart. Tag it before building the groups: "
            f"ds_muon.expert_weight(p){' and ds_muon.transposed(p)' if stored_transposed else ''} orthogonalizes "
            "each expert's [gate | up] jointly; or build the groups yourself with it in an AdamW group "
            "(use_muon=False)")
    rows = int(shape[1])
    if rows % 2:
        raise ValueError(f"muon_param_groups: {name} {tuple(shape)}: gate_up_proj has an odd number of rows "
                         f"({rows}); it cannot hold equal gate and up halves")
    return StackPlan({"gate": rows // 2, "up": rows // 2}, False)


def apply_plan(param: torch.Tensor, plan: StackPlan) -> torch.Tensor:
    """Tag ``param`` as the plan says (one matrix per expert; gate/up blocks; [in, out] storage)."""
    expert_weight(param)
    if plan.transposed:
        transposed(param)
    if plan.blocks:
        split_rows(param, plan.blocks)
    return param


def adamw_role(module: nn.Module, pname: str, routers: str = "adamw") -> Optional[str]:
    """Why a MoE tensor takes AdamW whatever its shape: ``"router"`` (unless ``routers="muon"``)
    or ``"expert bias"``; None when no MoE rule applies (the reason :meth:`ds_muon.Muon.summary` shows)."""
    if routers == "adamw" and is_router(module):
        return "router"
    if is_fused_experts(module) and pname.endswith("bias"):
        return "expert bias"
    return None


def takes_adamw(module: nn.Module, pname: str, routers: str = "adamw") -> bool:
    """Router weights (unless ``routers="muon"``) and expert biases take AdamW whatever their shape."""
    return adamw_role(module, pname, routers) is not None


def tag_fused_experts(model: nn.Module, shape_of: Callable[[torch.Tensor], Tuple[int, ...]] = global_shape) -> None:
    """Tag every fused expert stack of ``model`` by :func:`stack_plan` and mark routers.

    A stack the user tagged :func:`ds_muon.expert_weight` already keeps the user's tags.
    ``shape_of`` gives a parameter's shape in the model.
    """
    mark_routers(model)
    for mod_name, mod in model.named_modules():
        tag_stacks(mod_name, mod, shape_of)


def tag_stacks(mod_name: str, mod: nn.Module, shape_of: Callable[[torch.Tensor], Tuple[int, ...]] = global_shape):
    """Tag the fused expert stacks of one experts module (none for any other module)."""
    if not is_fused_experts(mod):
        return
    for pname in STACK_NAMES:
        p = mod._parameters.get(pname)
        if p is None or not p.requires_grad or getattr(p, EXPERTS, False):
            continue
        plan = stack_plan(mod, pname, shape_of(p), f"{mod_name}.{pname}" if mod_name else pname)
        if plan is not None:
            apply_plan(p, plan)


def check_matrix_dims(name: str, shape: Sequence[int], module: Optional[nn.Module],
                      param: Optional[torch.Tensor] = None) -> None:
    """A Muon tensor of 3+ dims must be a conv weight (one ``[out, in·k…]`` matrix) or a tagged
    expert stack; anything else would be orthogonalized as one wide matrix, silently."""
    if len(shape) < 3 or isinstance(module, _ConvNd) or (param is not None and getattr(param, EXPERTS, False)):
        return
    raise ValueError(
        f"muon_param_groups: {name} has shape {tuple(shape)} ({type(module).__name__ if module is not None else '?'}"
        f"); Muon would orthogonalize it as one [{shape[0]}, {' x '.join(str(s) for s in shape[1:])}] matrix. If dim "
        "0 indexes matrices (a stack of experts [E, out, in]), tag it ds_muon.expert_weight(p) before building the "
        "groups; otherwise build the groups yourself with it in an AdamW group (use_muon=False) or as one matrix")
