"""Mixture of experts: expert weights live in their own (expert data-parallel) domain.

Dense tensors are replicated or sharded over the data-parallel group; an expert's
tensors only over the ranks that hold that expert (the expert data-parallel
group).  Each tensor is tagged with its domain (:func:`ds_muon.domain`); the
optimizer then builds one Layout, plan and fused exchange per domain (two
``all_to_all`` per domain per step, all domains issued before any is waited on),
and checks gradient agreement inside each domain.

* Plain PyTorch MoE (``torch.distributed`` groups): :func:`tag_experts` on the
  expert modules or parameters, with the expert data-parallel group.  3-D
  ``[E, out, in]`` weights are tagged :func:`ds_muon.expert_weight` (E matrices).
* DeepSpeed MoE (``deepspeed.moe.layer.MoE``): expert parameters carry
  ``allreduce=False`` and ``group_name``; :func:`tag_deepspeed_moe` maps each to
  DeepSpeed's expert data-parallel group (``ds_muon.deepspeed.bind``
  calls it).  For ZeRO, DeepSpeed wants MoE parameters in their own param groups:
  :func:`split_moe_groups` does that to ``muon_param_groups`` output (keeping
  ``param_names`` aligned).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Union

import torch
from torch import nn

from ..tensors.shape import global_shape
from ..models.experts import tag_fused_experts
from ..models.tags import domain, expert_weight


def _params(modules_or_params) -> List[torch.Tensor]:
    if isinstance(modules_or_params, (nn.Module, torch.Tensor)):
        modules_or_params = [modules_or_params]
    out, seen = [], set()
    for x in modules_or_params:
        for p in (x.parameters() if isinstance(x, nn.Module) else [x]):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def tag_experts(modules_or_params: Union[nn.Module, torch.Tensor, Iterable], expert_dp_group,
                stacked: bool = True) -> List[torch.Tensor]:
    """Tag every parameter of the given expert modules (or the parameters themselves)
    with the expert data-parallel domain ``expert_dp_group``.

    With ``stacked=True`` (default) a parameter of ``ndim >= 3`` is a stack of
    expert matrices ``[E, out, in]`` and is tagged :func:`ds_muon.expert_weight`;
    the stacks of a transformers experts module get the tags
    :func:`ds_muon.muon_param_groups` gives them (gate and up apart), which
    ``muon_param_groups`` then keeps.  Returns the tagged parameters.
    """
    if not isinstance(modules_or_params, (nn.Module, torch.Tensor)):
        modules_or_params = list(modules_or_params)  # read twice below
    params = _params(modules_or_params)
    if not params:
        raise ValueError("ds_muon.tag_experts: no parameters given")
    if stacked:
        _tag_fused_stacks(modules_or_params)
    for p in params:
        if stacked and len(global_shape(p)) >= 3:
            expert_weight(p, expert_dp_group)
        else:
            domain(p, expert_dp_group)
    return params


def _tag_fused_stacks(modules_or_params) -> None:
    """Per-expert (and gate/up) tags for the fused stacks of transformers experts modules given."""
    mods = [modules_or_params] if isinstance(modules_or_params, nn.Module) else (
        [] if isinstance(modules_or_params, torch.Tensor) else [m for m in modules_or_params if isinstance(m, nn.Module)])
    for m in mods:
        tag_fused_experts(m)


def is_deepspeed_expert(p: torch.Tensor) -> bool:
    return getattr(p, "allreduce", True) is False and hasattr(p, "group_name")


def tag_deepspeed_moe(model: nn.Module) -> int:
    """Tag DeepSpeed MoE expert parameters with their expert data-parallel group; returns how many.

    Needs DeepSpeed's parallel groups to exist (after ``deepspeed.initialize``).
    """
    experts = [p for p in model.parameters() if is_deepspeed_expert(p)]
    if not experts:
        return 0
    from deepspeed.utils import groups

    for p in experts:
        try:
            g = groups._get_expert_data_parallel_group(p.group_name)
        except (KeyError, AssertionError) as e:
            raise RuntimeError(
                f"ds_muon: DeepSpeed expert parameter of shape {tuple(p.shape)} names expert group {p.group_name!r}, "
                f"which DeepSpeed has not created ({e}); call this after deepspeed.initialize") from None
        domain(p, g)
    return len(experts)


PER_TENSOR = ("param_names", "param_tags", "param_reasons", "param_evidence")  # group keys with one entry per tensor


def split_moe_groups(groups: List[dict]) -> List[dict]:
    """Split each param group into its dense and its expert parameters (DeepSpeed ZeRO wants
    expert parameters in groups marked ``moe=True`` with ``name`` = their expert group name).

    ``param_names`` (and the other per-tensor lists: ``param_tags``, ``param_reasons``) stay
    aligned with ``params``.  Groups without expert parameters are returned as they are.
    """
    out = []
    for g in groups:
        per_tensor = [k for k in PER_TENSOR if isinstance(g.get(k), list) and len(g[k]) == len(g["params"])]
        dense: List[int] = []
        experts: Dict[str, List[int]] = {}
        for i, p in enumerate(g["params"]):
            if is_deepspeed_expert(p):
                experts.setdefault(p.group_name, []).append(i)
            else:
                dense.append(i)
        if not experts:
            out.append(g)
            continue
        for name, idx in [(None, dense)] + sorted(experts.items()):
            if not idx:
                continue
            ng = {k: v for k, v in g.items() if k != "params" and k not in per_tensor}
            ng["params"] = [g["params"][i] for i in idx]
            for k in per_tensor:
                ng[k] = [g[k][i] for i in idx]
            if name is not None:
                ng.update(moe=True, name=name)
            out.append(ng)
    return out
