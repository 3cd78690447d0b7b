"""The blocks a matrix is orthogonalized in: read from the config (a fused projection's plan, by the readers of
:mod:`.fused`; per head with ``split_attention="heads"``) or from the traced forward (the blocks it splits the
output into).  Reports only: :mod:`.decide` chooses between them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..tensors.tag_keys import TENSOR_PARALLEL
from .fused import FusedPlan, experts_gate_up, from_forward, looks_fused, reader_for
from .module_types import is_attention, is_conv1d_transformers, is_fused_experts, is_linear
from .names import HEAD_PROJ_NAMES
from .trace import Use


def config_plan(facts, module, pname, shape, param) -> Optional[FusedPlan]:
    """The config's fused plan of this tensor (None: not fused, split_fused off, or the user tagged it)."""
    if param is not None and getattr(param, TENSOR_PARALLEL, None) is not None:
        return None
    per_head = facts.split_attention == "heads"
    parent, config = facts.modules.parent, facts.configs.config
    reader, owner = None, module
    if id(module) in parent:  # the parent knows its children's fusion (JetMoE's input_linear)
        owner, cname = parent[id(module)]
        reader = reader_for(owner, f"{cname}.{pname}")
    if reader is None:
        reader, owner = reader_for(module, pname), module
    if reader is None and is_fused_experts(module) and pname == "gate_up_proj" and module.has_gate and (
            module.is_transposed or not module.is_concatenated) and len(shape) == 3:
        reader = experts_gate_up
    if reader is None and is_linear(module) and pname == "weight" and id(module) in parent:
        owner, cname = parent[id(module)]
        if is_attention(owner) and looks_fused(owner, module, config, cname) == "q|k|v" \
                and int(shape[1] if is_conv1d_transformers(module) else shape[0]) % 3 == 0:
            reader = from_forward(owner, cname)
            if reader is not None and not is_conv1d_transformers(module):
                owner = module if reader.__name__.startswith("_qkv") else owner
            else:
                reader = None
    if reader is None:
        if per_head and is_linear(module) and pname == "weight" and id(module) in parent:
            owner, cname = parent[id(module)]
            if cname in HEAD_PROJ_NAMES and is_attention(owner):
                return per_head_rows(owner, shape)
        return None
    plan = reader(owner, pname, shape, getattr(owner, "config", None) or config, per_head)
    if not facts.split_fused and plan.what != "experts":
        return None
    return plan


def per_head_rows(owner, shape) -> Optional[FusedPlan]:
    hd = getattr(owner, "head_dim", None)
    if not hd or shape[0] % int(hd) or shape[0] == int(hd):
        return None
    hd = int(hd)
    return FusedPlan({str(h): ((h * hd, hd), None) for h in range(shape[0] // hd)}, "heads")


def traced_plan(use: Use, shape, stack: bool, module_name: str, pname: str) -> Optional[FusedPlan]:
    """The blocks the forward split the output into, as a :class:`FusedPlan` (rows of an ``[out, in]`` weight,
    columns of an ``[in, out]`` one; per expert for a stack).  Raises for blocks that are not runs
    ``(start, length, count, period)``, naming the tensor."""
    if not use.blocks:
        return None
    in_out = bool(use.stored_in_out)
    extent = int(shape[-1] if in_out else shape[-2 if stack else 0])
    if stack and not in_out:
        extent = int(shape[1])
    if sum(len(b) for b in use.blocks) != extent:
        return None  # the forward applied a reshaped view: its features are not this matrix's rows/cols
    blocks = {}
    for k, feats in enumerate(use.blocks):
        run = runs_of(feats)
        if run is None:
            raise NotImplementedError(
                f"muon_param_groups: {module_name}.{pname} {tuple(shape)}: the forward splits its output into "
                f"blocks that are not evenly spaced runs (block {k}: {feats[:8]}...), which no stack can shard "
                "as blocks. Tag it yourself (ds_muon.fused_blocks), or pass split_fused=False")
        blocks[str(k)] = (None, run) if in_out else (run, None)
    what = "blocks " + "|".join(str(len(b)) for b in use.blocks)
    return FusedPlan(blocks, what, transposed=in_out, experts=stack)


def runs_of(feats: Sequence[int]) -> Optional[tuple]:
    """``(start, length, count, period)`` of sorted indices made of ``count`` equal runs ``period`` apart
    (``(start, length)`` for one run); None when they are not."""
    feats = sorted(int(f) for f in feats)
    start, n = feats[0], len(feats)
    length = 1
    while length < n and feats[length] == start + length:
        length += 1
    if n % length:
        return None
    count = n // length
    if count == 1:
        return (start, length)
    period = feats[length] - start
    want = [start + i * period + j for i in range(count) for j in range(length)]
    return (start, length, count, period) if want == feats else None


def same_partition(plan: FusedPlan, use: Use, shape) -> bool:
    """Whether the rules' blocks split the output features as the forward does (per-head plans are finer)."""
    try:
        from .tags import _mask, _run

        axis_in_out = bool(plan.transposed)
        extent = int(shape[-1] if axis_in_out else shape[1 if plan.experts else 0])
        sets = []
        for r, c in plan.blocks.values():
            spec = c if axis_in_out else r
            m = _mask(_run(spec, extent, "", ""), extent)
            sets.append(tuple(int(i) for i in torch.nonzero(m).flatten().tolist()))
        return sorted(sets) == sorted(tuple(b) for b in use.blocks)
    except Exception:  # noqa: BLE001 - not comparable
        return False
