"""Param groups for :class:`ds_muon.Muon`: one Muon group, one AdamW group, by the rules of
:mod:`ds_muon.selection` (hidden weight matrices take Muon, everything else AdamW).

Also tags what a module declares (split row blocks, ``[in, out]`` storage, fused
expert stacks) and refuses models whose shapes a stack has hidden.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from torch import nn

from .experts import check_matrix_dims, check_routers, param_modules, tag_fused_experts
from .integrations.fsdp1 import fsdp1_param_groups, is_fsdp1_model
from .layout import global_shape
from .selection import HEAD_NAMES, param_reasons, split_params, stores_in_out
from .tags import shape_tags, split_rows, transposed

def muon_param_groups(
    model: nn.Module,
    lr: float = 0.02,
    adam_lr: float = 3e-4,
    weight_decay: float = 0.0,
    adam_weight_decay: float = 0.0,
    head_names: Sequence[str] = HEAD_NAMES,
    split_attention: Optional[str] = None,
    routers: str = "adamw",
    **muon_options,
) -> List[dict]:
    """Param groups for :class:`ds_muon.Muon`: one Muon group, one AdamW group.

    Groups record ``param_names`` so errors and reports can name tensors, and
    ``param_reasons`` (why each took Muon or AdamW) for :meth:`ds_muon.Muon.summary`.  An
    FSDP1-wrapped model is read through its flat parameters' metadata.
    ``head_names`` overrides which module names count as output heads; extra
    keyword arguments go into the Muon group (e.g. ``ns_steps=6``).

    Split blocks (:func:`ds_muon.split_rows`): a module that declares
    ``ds_muon_row_blocks = {param_name: sizes}`` (``sizes`` a list or a dict
    ``{label: rows}``; names relative to the module) has those tensors tagged.
    ``split_attention="qkv"`` also splits every ``nn.MultiheadAttention``'s fused
    ``in_proj_weight`` into q, k, v; ``"heads"`` into one block per head of each.
    Weights of transformers' ``Conv1D`` (GPT-2), stored ``[in, out]``, are tagged
    :func:`ds_muon.transposed` so their scale factor reads ``[out, in]``.

    MoE (:mod:`ds_muon.experts`): transformers' fused expert stacks are one matrix
    per expert, ``gate_up_proj`` split into gate and up; expert biases take AdamW;
    routers take AdamW unless ``routers="muon"``.  Any other Muon tensor of 3+ dims
    that is not a conv weight raises (tag it :func:`ds_muon.expert_weight`, or build
    the groups yourself).
    """
    check_routers(routers)
    tag_row_blocks(model, split_attention)

    if is_fsdp1_model(model):  # FSDP1 hides original shapes: read them from its flat parameters
        return fsdp1_param_groups(model, lr, adam_lr, weight_decay, adam_weight_decay, head_names, routers=routers,
                                 **muon_options)
    check_shapes_are_known(model)
    muon, adam = split_params_checked(model, head_names, routers)
    why = param_reasons(model, head_names, routers)  # what Muon.summary() shows
    if not muon and not adam:
        raise ValueError("muon_param_groups: the model has no trainable parameters")
    if not muon:
        raise ValueError(
            f"muon_param_groups: no hidden weight matrix found among {len(adam)} trainable tensors (every one is an "
            f"embedding, an output head ({list(head_names)}), or has fewer than 2 dimensions), so Muon would train "
            "nothing and everything would silently run AdamW. Use AdamW itself for such a model, or pass "
            "head_names= if a hidden layer is named like a head")
    groups = [{"params": [p for _, p in muon], "param_names": [n for n, _ in muon], "use_muon": True,
               "param_tags": [shape_tags(p) for _, p in muon],  # restored if a stack swaps the tensors
               "param_reasons": [why[id(p)] for _, p in muon],
               "lr": lr, "weight_decay": weight_decay, **muon_options}]
    if adam:
        groups.append({"params": [p for _, p in adam], "param_names": [n for n, _ in adam], "use_muon": False,
                       "param_reasons": [why[id(p)] for _, p in adam], "lr": adam_lr,
                       "weight_decay": adam_weight_decay})
    return groups


def split_params_checked(model: nn.Module, head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw"):
    """:func:`split_params` after tagging fused expert stacks, with every 3+-D Muon tensor checked
    to be a conv weight or an expert stack (so none is silently one wide matrix)."""
    tag_fused_experts(model)
    muon, adam = split_params(model, head_names, routers)
    owners = param_modules(model)
    for name, p in muon:
        check_matrix_dims(name, global_shape(p), owners.get(id(p), (None, None))[1], p)
    return muon, adam


def check_shapes_are_known(model: nn.Module) -> None:
    """Refuse a model whose parameters a stack ds_muon does not know has partitioned away: most of
    them 1-D and empty without ZeRO-3's ``ds_shape``, so matrices would land in AdamW unseen.  (A
    single empty tensor, e.g. the bias of ``nn.Linear(8, 0)``, is a real shape and steps.)"""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [n for n, p in trainable if p.ndim == 1 and p.numel() == 0 and getattr(p, "ds_shape", None) is None]
    if hidden and 2 * len(hidden) >= len(trainable):
        raise ValueError(
            f"muon_param_groups: {hidden[:5]}{' and more' if len(hidden) > 5 else ''} ({len(hidden)} in all) have "
            "no elements and no recorded shape (ZeRO-3 keeps it in ds_shape), so ds_muon cannot tell matrices "
            "from vectors. Build the groups before the model is partitioned, or with the stack that partitioned it "
            "(deepspeed.zero.Init and FSDP are read through their own metadata)")


SPLIT_ATTENTION = (None, "qkv", "heads")


def tag_row_blocks(model: nn.Module, split_attention: Optional[str] = None) -> None:
    """Tag the split blocks modules declare (``ds_muon_row_blocks``) and, with
    ``split_attention``, the fused ``in_proj_weight`` of ``nn.MultiheadAttention``."""
    if split_attention not in SPLIT_ATTENTION:
        raise ValueError(f"muon_param_groups: split_attention={split_attention!r} is unknown; use one of "
                         f"{list(SPLIT_ATTENTION)}")
    for mod_name, mod in model.named_modules():
        declared = getattr(mod, "ds_muon_row_blocks", None)
        if declared:
            for pname, sizes in dict(declared).items():
                try:
                    p = mod.get_parameter(pname)
                except AttributeError:
                    raise ValueError(f"muon_param_groups: {type(mod).__name__} {mod_name or '(root)'} declares row "
                                     f"blocks for {pname!r}, which is not one of its parameters (FSDP1 with use_orig_params=False "
                                     "hides them: split blocks need use_orig_params=True)") from None
                try:
                    split_rows(p, sizes)
                except ValueError as e:
                    raise ValueError(f"muon_param_groups: {mod_name + '.' if mod_name else ''}{pname}: {e}") from None
        if stores_in_out(mod, "weight") and getattr(mod, "weight", None) is not None and len(global_shape(mod.weight)) == 2:
            transposed(mod.weight)
        if split_attention and isinstance(mod, nn.MultiheadAttention) and mod.in_proj_weight is not None:
            e, h = mod.embed_dim, mod.num_heads
            if split_attention == "qkv":
                split_rows(mod.in_proj_weight, {"q": e, "k": e, "v": e})
            else:
                split_rows(mod.in_proj_weight, {f"{w}{i}": e // h for w in "qkv" for i in range(h)})
