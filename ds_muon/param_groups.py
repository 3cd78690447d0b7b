"""Param groups for :class:`ds_muon.Muon`: one Muon group, one AdamW group, by the rules of
:mod:`ds_muon.models.decide` (hidden weight matrices take Muon, everything else AdamW).

Also tags what a module declares (split row blocks, ``[in, out]`` storage, fused
expert stacks) and refuses models whose shapes a stack has hidden.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

from .integrations.fsdp1 import fsdp1_groups
from .models.decide import decide
from .models.evidence import Rules
from .models.experts import check_matrix_dims, check_routers, stack_plan, tag_stacks
from .models.fused import apply_fused_plan
from .models.kinds import CONV, HIDDEN_MATRIX, ONE_MATRIX, RAW, Decision
from .models.module_types import is_fused_experts, stores_in_out
from .models.names import HEAD_NAMES, matches
from .models.reading import read, split_params
from .models.tags import expert_weight, split_rows, transposed
from .tensors.shape import global_shape
from .tensors.tag_keys import EXPERTS, is_tagged, shape_tags


def muon_param_groups(
    model: nn.Module,
    lr: float = 0.02,
    adam_lr: float = 3e-4,
    weight_decay: float = 0.0,
    adam_weight_decay: float = 0.0,
    head_names: Sequence[str] = HEAD_NAMES,
    split_attention: Optional[str] = None,
    routers: str = "adamw",
    split_fused: bool = True,
    exclude: Sequence[str] = (),
    include: Sequence[str] = (),
    example_inputs=None,
    trace=True,
    **muon_options,
) -> List[dict]:
    """Param groups for :class:`ds_muon.Muon`: one Muon group, one AdamW group.

    Which tensor takes which is decided by :mod:`ds_muon.models.decide` from what each module
    does and what the model's config says (the rules table is in the README).  Groups record
    ``param_names`` so errors and reports can name tensors, ``param_reasons`` (why each took Muon
    or AdamW) and ``param_kinds`` for :meth:`ds_muon.Muon.summary`.  An FSDP1-wrapped model is
    read through its flat parameters' metadata.  ``head_names`` are the module names that count
    as output heads in models without transformers' ``get_output_embeddings()`` (given, they apply
    to every model); extra keyword arguments go into the Muon group (e.g. ``ns_steps=6``).

    Fused projections (``[q | k | v]``, ``[gate | up]``, 2-D expert stacks) are split into their
    blocks, read from the config (:mod:`ds_muon.models.fused`); ``split_fused=False`` keeps each
    whole.  ``split_attention="heads"`` splits q, k and v into one block per head (HF attention and
    ``nn.MultiheadAttention``); ``"qkv"`` also splits ``nn.MultiheadAttention``'s ``in_proj_weight``.
    Modules may declare ``ds_muon_row_blocks = {param_name: sizes}`` (:func:`ds_muon.split_rows`).

    ``exclude`` / ``include``: names or glob patterns (``"*.A_log"``) of tensors sent to AdamW /
    Muon whatever the rules say, applied after them and shown in ``summary()``.

    MoE (:mod:`ds_muon.models.experts`): fused expert stacks are one matrix per expert, ``gate_up_proj``
    split into gate and up; expert biases take AdamW; routers (a ``*Router``, a Linear whose outputs
    equal the config's expert count) take AdamW unless ``routers="muon"``.

    The forward is read once (:mod:`ds_muon.models.trace`, on a meta copy: the model is not touched) with
    ``example_inputs`` (a tensor, a tuple of arguments or a dict of keyword arguments; default: from the
    config, else guessed from the first layer): it says which weights read the model's input (input
    layers) or make its output (heads), which bare stacks are applied as linear maps per expert, and how
    each output is split into blocks.  Where no forward runs (or a tensor is not used by it) the config,
    module types and names decide, and one warning names those tensors; ``trace=False`` skips reading
    (a :class:`ds_muon.models.trace.Trace` already read is used as it is).
    DDP, ``torch.compile``, PEFT and DeepSpeed's engine are unwrapped first (:func:`ds_muon.unwrap.unwrap_model`),
    so the decision is the bare model's.

    Raw parameters (a bare ``nn.Parameter`` of a module that is not a linear map: ``A_log``,
    position tables, cls tokens) take AdamW, with one warning listing those of 2+ dims.  When every
    hidden matrix is frozen, the trainable tensors go to one AdamW group (with one warning).
    """
    check_routers(routers)
    if not isinstance(split_fused, bool):
        raise ValueError(f"muon_param_groups: split_fused={split_fused!r} must be True or False")
    exclude, include = _patterns("exclude", exclude), _patterns("include", include)
    tag_row_blocks(model, split_attention)

    groups = fsdp1_groups(model, exclude, include, split_fused, lr, adam_lr, weight_decay, adam_weight_decay,
                          head_names, routers=routers, example_inputs=example_inputs, **muon_options)
    if groups is not None:  # FSDP1 hides the original shapes: its adapter reads them from its flat parameters
        return groups
    check_shapes_are_known(model)
    read_once = read(model, head_names=head_names, routers=routers, split_fused=split_fused,  # the bare model's
                     split_attention=split_attention, trace=trace, example_inputs=example_inputs)
    rules, decided, owners = read_once.rules, read_once.decided, read_once.owners
    _tag_fused(model, decided, split_fused)
    decided = _untraced(decided, rules, model, trace is not False)
    decided = _override(decided, exclude, include)
    muon = [(n, p) for n, p in model.named_parameters() if id(p) in decided and decided[id(p)][0] == n
            and decided[id(p)][1].muon]
    adam = [(n, p) for n, p in model.named_parameters() if id(p) in decided and decided[id(p)][0] == n
            and not decided[id(p)][1].muon]
    for name, p in muon:
        d = decided[id(p)][1]  # a conv weight is one [out, in·k…] matrix, and so is an N-D one an equation applies
        if d.kind != CONV and not (d.plan is not None and d.plan.what == ONE_MATRIX):
            check_matrix_dims(name, global_shape(p), owners.get(id(p), (None, None))[1], p)
    _warn_raw(decided, model)
    if not muon and not adam:
        raise ValueError("muon_param_groups: the model has no trainable parameters")
    if not muon:
        frozen = _frozen_hidden(model, rules)
        if not frozen:
            raise ValueError(
                f"muon_param_groups: no hidden weight matrix found among {len(adam)} trainable tensors (every one is "
                f"an embedding, an input layer (the first weight the model's input meets), an output head "
                f"({list(head_names)}), or has fewer than 2 dimensions), so Muon would "
                "train nothing and everything would silently run AdamW. Use AdamW itself for such a model, pass "
                "include= for a tensor that is a hidden linear map, or head_names= if a hidden layer is named like a "
                "head")
        _warn_once(f"ds_muon.muon_param_groups: every hidden matrix is frozen ({len(frozen)}, e.g. {frozen[0]}); "
                   f"the {len(adam)} trainable tensors (embeddings, heads, norms) train with AdamW")
    why = {i: d.reason for i, (_, d) in decided.items()}
    kinds = {i: d.kind for i, (_, d) in decided.items()}
    by = {i: d.decided_by for i, (_, d) in decided.items()}  # the evidence that decided (summary's "by")
    groups = []
    if muon:
        groups.append({"params": [p for _, p in muon], "param_names": [n for n, _ in muon], "use_muon": True,
                       "param_tags": [shape_tags(p) for _, p in muon],  # restored if a stack swaps the tensors
                       "param_reasons": [why[id(p)] for _, p in muon],
                       "param_kinds": [kinds[id(p)] for _, p in muon],
                       "param_evidence": [by[id(p)] for _, p in muon],
                       "lr": lr, "weight_decay": weight_decay, **muon_options})
    if adam:
        groups.append({"params": [p for _, p in adam], "param_names": [n for n, _ in adam], "use_muon": False,
                       "param_reasons": [why[id(p)] for _, p in adam],
                       "param_kinds": [kinds[id(p)] for _, p in adam],
                       "param_evidence": [by[id(p)] for _, p in adam], "lr": adam_lr,
                       "weight_decay": adam_weight_decay})
    return groups


def _untraced(decided: Dict[int, Tuple[str, Decision]], rules: Rules, model: nn.Module, asked: bool):
    """Say, in each reason and in one rank-0 warning, which matrices were decided without the trace."""
    shapes = {id(p): global_shape(p) for p in model.parameters()}
    why = rules.untraced_why()
    out, names = dict(decided), []
    for i, (name, d) in decided.items():
        if d.decided_by == "trace" or len(shapes.get(i, ())) < 2:
            continue
        names.append(name)
        out[i] = (name, replace(d, reason=f"{d.reason} (decided by {d.decided_by}, not traced)"))
    if names and asked:
        listed = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        _warn_once(f"ds_muon.muon_param_groups: {len(names)} matrices decided by the config, module types and names, "
                   f"not by the traced forward ({why}): {listed}. Pass example_inputs= (a tensor, tuple or dict for "
                   "one forward) so the forward can be read, or check them in Muon.summary()")
    return out


def _patterns(what: str, value) -> Tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    value = tuple(value)
    if any(not isinstance(v, str) or not v for v in value):
        raise ValueError(f"muon_param_groups: {what}= takes parameter names or glob patterns (strings), got {value!r}")
    return value


def _override(decided: Dict[int, Tuple[str, Decision]], exclude, include):
    """``exclude`` to AdamW, ``include`` to Muon (a name in both raises); unmatched patterns raise."""
    used = set()
    out = dict(decided)
    for i, (name, d) in decided.items():
        ex, inc = matches(name, exclude), matches(name, include)
        if ex and inc:
            raise ValueError(f"muon_param_groups: {name} matches both exclude={ex!r} and include={inc!r}")
        if ex:
            used.add(ex)
            out[i] = (name, Decision(d.kind, False, f"exclude={ex!r} ({d.kind})", decided_by="exclude="))
        elif inc:
            used.add(inc)
            why = f"include={inc!r} ({d.kind})" if d.muon else f"include={inc!r} keeps this {d.kind} on Muon"
            out[i] = (name, Decision(d.kind, True, f"{HIDDEN_MATRIX}, {why}", d.plan, decided_by="include="))
    unused = [p for p in exclude + include if p not in used]
    if unused:
        raise ValueError(f"muon_param_groups: {unused} match no trainable parameter; patterns are full names "
                         "as model.named_parameters() gives them, or globs like '*.A_log'")
    return out


def _tag_fused(model: nn.Module, decided, split_fused: bool) -> None:
    """Tag the fused projections the rules split, then transformers' expert stacks (whole per expert
    with ``split_fused=False``)."""
    for _, p in model.named_parameters():
        entry = decided.get(id(p))
        if entry is None or entry[1].plan is None or is_tagged(p):
            continue
        apply_fused_plan(p, entry[1].plan, entry[0])
    for mod_name, mod in model.named_modules():
        if not is_fused_experts(mod):
            continue
        for pname, p in mod.named_parameters(recurse=False) if not split_fused else ():
            plan = None
            try:
                plan = stack_plan(mod, pname, global_shape(p), pname)
            except NotImplementedError:  # interleaved gate/up: whole per expert is what was asked
                plan = True
            if plan is not None and p.requires_grad and not getattr(p, EXPERTS, False):
                expert_weight(p)
                if bool(mod.is_transposed):
                    transposed(p)
        tag_stacks(mod_name, mod)  # (routers were marked when the model was read)


def _warn_raw(decided, model: nn.Module) -> None:
    shapes = {id(p): global_shape(p) for p in model.parameters()}
    raw = [(n, shapes[i], d) for i, (n, d) in decided.items() if d.kind == RAW and not d.muon and len(shapes[i]) >= 2]
    applied = [(n, s, d) for n, s, d in raw if d.decided_by == "trace"]  # the forward applies it: say how
    raw = [(n, s) for n, s, d in raw if d.decided_by != "trace"]
    if applied:
        listed = "; ".join(f"{n} {tuple(s)}: {d.reason}" for n, s, d in applied[:4]) + \
            (f"; and {len(applied) - 4} more" if len(applied) > 4 else "")
        _warn_once(f"ds_muon.muon_param_groups: {len(applied)} raw parameter(s) the forward applies as linear maps "
                   f"take AdamW, their matrices not read or not held: {listed}. If one is a hidden matrix whose rows are "
                   "its first k axes, tag it ds_muon.row_axes(p, k) (and ds_muon.transposed(p) where the rows are "
                   "inputs) and opt it in: muon_param_groups(model, include=['<name or glob>'])")
    if raw:
        listed = ", ".join(f"{n} {tuple(s)}" for n, s in raw[:8]) + (f" and {len(raw) - 8} more" if len(raw) > 8 else "")
        _warn_once(f"ds_muon.muon_param_groups: {len(raw)} raw parameter(s) of 2+ dims take AdamW: {listed}. They are "
                   "bare nn.Parameters of modules that are not linear maps (state-space A_log, position tables, "
                   "tokens, bias tables). If one is a hidden linear map, opt it in: "
                   "muon_param_groups(model, include=['<name or glob>'])")


def _frozen_hidden(model: nn.Module, rules: Rules) -> List[str]:
    out = []
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if not p.requires_grad and decide(rules, mod_name, mod, pname, global_shape(p), p).muon:
                out.append(f"{mod_name}.{pname}" if mod_name else pname)
    return out


def _warn_once(message: str) -> None:
    """One warning, on rank 0 only (every rank builds the same groups)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    warnings.warn(message, UserWarning, stacklevel=3)


def split_params_checked(model: nn.Module, head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw"):
    """:func:`split_params` after tagging fused projections and expert stacks, with every 3+-D Muon
    tensor checked to be a conv weight or an expert stack (so none is silently one wide matrix)."""
    read_once = read(model, head_names=head_names, routers=routers)
    _tag_fused(model, read_once.decided, True)
    muon, adam = split_params(model, head_names, routers)
    owners = read_once.owners
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
