"""The one decision: each tensor's kind, optimizer, blocks and reason, from the evidence in a fixed order.

The evidence modules only report what they saw: :mod:`.module_types` (what each module is; the model's own
API for its ends), :mod:`.config` (sizes), :mod:`.trace` (what the forward does with each tensor),
:mod:`.names` (the fallback).  :func:`decide` walks :data:`PRECEDENCE` once per tensor and the first rule
that applies decides, recording the evidence that did (``decided_by``).  The README's order of precedence
is generated from this list (``tools/rules_table.py``; ``tests/test_map_rules.py`` checks it).

A rule may read a later evidence too: an end, an embedding or a router the forward used is "decided by
trace" (it keeps its kind); a module-type matrix takes the blocks the forward splits its output into where
the config gave none.  That a tensor is *not* used as a matrix never moves one off Muon (a composite op such
as ``F.multi_head_attention_forward`` hides its inner linears).  Every path asks these rules:
:func:`.reading.read` (every stack but FSDP1) and the FSDP1 adapter (:func:`.evidence.rules_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import nn

from ..tensors.shape import global_shape
from ..tensors.tag_keys import EXPERTS
from .blocks import same_partition, traced_plan
from .equations import layout
from .evidence import Rules, TensorView
from .experts import stack_plan
from .fused import FusedPlan, looks_fused
from .kinds import (CONV, DEPTHWISE, EMBEDDING, EXPERT, FUSED_BLOCK, HIDDEN_LINEAR, HIDDEN_MATRIX, INPUT_LAYER,
                    ONE_MATRIX, OUTPUT_HEAD, RAW, ROUTER, VECTOR, Decision)
from .module_types import (EMBEDDING_TYPES, RECURRENT_GATES, STACK_NAMES, base_layer_of, is_attention, is_conv,
                           is_conv1d_transformers, is_depthwise, is_fused_experts, is_linear)
from .names import head_named, norm_named
from .trace import Use

MATRIX_OPS = {"linear", "matmul", "bmm", "mm", "addmm", "baddbmm", "grouped_mm"}


# -- the rules, in order of precedence -------------------------------------------------------------------
def peft_factor(t: TensorView) -> Optional[Decision]:
    """A LoRA factor: the decision of the layer it adapts (one matrix of rank ``r``, never its blocks)."""
    if id(t.module) not in t.facts.modules.lora_factors:
        return None
    layer, which = t.facts.modules.lora_factors[id(t.module)]
    base = base_layer_of(layer)
    weight = getattr(base, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return Decision(RAW, False, f"{RAW}, LoRA {which} of a {type(base).__name__} without a weight")
    shape = global_shape(weight)
    if isinstance(base, nn.Linear) and len(shape) != 2:  # a quantized base stores its weight packed
        shape = (base.out_features, base.in_features)
    path = t.facts.modules.path.get(id(base), t.module_name)
    d = decide(t.facts, path, base, "weight", shape, weight)
    if d.muon:
        kind = CONV if d.kind == CONV else HIDDEN_LINEAR
        return Decision(kind, True, f"{HIDDEN_MATRIX}, LoRA {which} of a {d.kind} ({path}), one matrix",
                        decided_by=d.decided_by)
    return Decision(d.kind, False, f"{d.reason}; LoRA {which} of it ({path})", decided_by=d.decided_by)


def peft_saved_copy(t: TensorView) -> Optional[Decision]:
    """A ``modules_to_save`` copy: an end of the model when the module it copies is one (the original is not
    run by the traced forward, the copy is: either saying "end" decides)."""
    original = t.facts.modules.saved_copies.get(id(t.module))
    if original is None:
        return None
    pname = t.pname
    d = _first(t, PRECEDENCE.index(SAVED_COPY) + 1)
    weight = getattr(original, pname, None)
    if not d.muon or not isinstance(weight, torch.Tensor):
        return d
    path = t.facts.modules.path.get(id(original), "")
    od = decide(t.facts, path, original, pname, global_shape(weight), weight)
    if od.muon:
        return d
    return Decision(od.kind, False, f"{od.reason}; modules_to_save copy of {path}", decided_by=od.decided_by)


def parametrized(t: TensorView) -> Optional[Decision]:
    """torch's parametrizations: ``original0`` of ``weight_norm`` is a gain; ``original`` (and ``original1``)
    is the layer's tensor, decided as the layer's own."""
    layer = t.facts.modules.parametrized(t.module)
    if layer is None:
        return None
    if t.pname == "original0":
        return t.confirmed(Decision(VECTOR, False, "weight-norm gain"))
    inner = TensorView(t.facts, t.facts.modules.path.get(id(layer[0]), ""), layer[0], layer[1], t.shape, t.param, t.use)
    return _first(inner, PRECEDENCE.index(PARAMETRIZED) + 1)


def embedding(t: TensorView) -> Optional[Decision]:
    """An embedding's table, or a weight tied to one: rows are looked up."""
    if isinstance(t.module, EMBEDDING_TYPES):
        return t.confirmed(Decision(EMBEDDING, False, EMBEDDING))
    if t.param is not None and id(t.param) in t.facts.modules.embedding_params:
        return t.confirmed(Decision(EMBEDDING, False, f"{EMBEDDING}, {OUTPUT_HEAD}"))
    return None


def not_a_matrix(t: TensorView) -> Optional[Decision]:
    """An expert bias, a weight-norm gain, anything of fewer than 2 dims (``weight_v`` reads as the weight)."""
    if is_fused_experts(t.module) and t.pname.endswith("bias"):
        return t.confirmed(Decision(VECTOR, False, "expert bias"))
    if t.pname == "weight_g" and hasattr(t.module, "weight_v"):  # nn.utils.weight_norm (the old one)
        return t.confirmed(Decision(VECTOR, False, "weight-norm gain"))
    if t.pname == "weight_v" and (is_linear(t.module) or is_conv(t.module)):
        t.pname = "weight"  # the direction of a weight-normed layer: its matrix
    if len(t.shape) < 2:
        return Decision(VECTOR, False, f"{len(t.shape)}-D")
    return None


def looked_up(t: TensorView) -> Optional[Decision]:
    """The forward looks it up (and applies it as no matrix): an embedding, whatever its module says (a
    router, a depthwise conv or a norm's tensor keep their kind)."""
    u = t.seen
    if u is None or "embedding" not in u.ops or u.matrix:
        return None
    if t.router() and t.facts.routers == "adamw":
        return None
    if is_depthwise(t.module) and t.weight and not t.input_width() and t.plan() is None and not t.plan_error:
        return None
    if not t.matrix_type() and norm_named(t.module):
        return None
    return Decision(EMBEDDING, False, f"{EMBEDDING} (looked up: traced)", decided_by="trace")


def model_ends(t: TensorView) -> Optional[Decision]:
    """Under ``get_output_embeddings()`` / ``get_input_embeddings()`` (the model's own API for its ends)."""
    if id(t.module) in t.facts.modules.output_ids:
        return t.confirmed(Decision(OUTPUT_HEAD, False, OUTPUT_HEAD, decided_by="config"))
    if id(t.module) in t.facts.modules.input_ids:
        return t.confirmed(Decision(INPUT_LAYER, False, "input layer (under get_input_embeddings())",
                                    decided_by="config"))
    return None


def head_name(t: TensorView) -> Optional[Decision]:
    """``head_names`` (given, or by default for a model without transformers' API for its ends), unless the
    forward shows a hidden layer so named (names the user gave stay the user's word)."""
    f = t.facts
    if not f.names_rule or not head_named(t.module_name, f.head_names):
        return None
    u = t.use
    if not f.names_given and u is not None and u.matrix and not u.head:
        return None
    return t.confirmed(Decision(OUTPUT_HEAD, False, OUTPUT_HEAD, decided_by="name"))


def labelled_head(t: TensorView) -> Optional[Decision]:
    """A linear or conv outside ``base_model`` producing ``config.num_labels`` (or the vocabulary)."""
    m = t.module
    if not ((is_linear(m) or is_conv(m)) and t.weight) or id(m) not in t.facts.modules.head_region:
        return None
    outs = int(m.nf if is_conv1d_transformers(m) else t.shape[0])
    if outs in t.facts.configs.labels or outs in t.facts.configs.vocab:
        return t.confirmed(Decision(OUTPUT_HEAD, False, f"{OUTPUT_HEAD} ({outs} outputs: num_labels / vocab)",
                              decided_by="config"))
    return None


def router(t: TensorView) -> Optional[Decision]:
    """A MoE router (``routers="muon"``: a hidden matrix, decided with the module types below)."""
    by = t.router()
    if by is None or t.facts.routers != "adamw":
        return None
    return t.confirmed(Decision(ROUTER, False, ROUTER, decided_by=by))


def config_input(t: TensorView) -> Optional[Decision]:
    """A linear or conv reading the config's raw input width (pixel channels, mel bins; at most 4)."""
    if isinstance(t.module, nn.RNNBase) or t.router() or t.plan() is not None or t.plan_error \
            or t.input_width() is None:
        return None
    return t.confirmed(Decision(INPUT_LAYER, False, f"input layer (reads {t.input_width()} input channels)",
                          decided_by="config"))


def depthwise(t: TensorView) -> Optional[Decision]:
    """A depthwise conv (``groups == in_channels``): one filter per channel, not a map of features."""
    if not (is_depthwise(t.module) and t.weight) or t.plan() is not None or t.plan_error:
        return None
    return t.confirmed(Decision(DEPTHWISE, False, "depthwise conv (one filter per channel, not a map of features)"))


def norm(t: TensorView) -> Optional[Decision]:
    """A raw tensor of a module whose class is a norm."""
    if t.matrix_type() or not norm_named(t.module):
        return None
    return t.confirmed(Decision(VECTOR, False, "norm"))


def traced_input(t: TensorView) -> Optional[Decision]:
    """The forward applies it to the model's input, or to a function of it with no weight between (a stem, a
    patch embedding, a ``Linear`` on patchified latents or observations): an input layer whatever module
    computes it (Muon's rule: the input layer on AdamW; ``include=`` opts one in)."""
    u = t.seen
    if u is None or not u.matrix or not u.input_layer:
        return None
    return Decision(INPUT_LAYER, False, "input layer (reads the model's input: traced)", decided_by="trace")


def traced_head(t: TensorView) -> Optional[Decision]:
    """The final output layer, for every model: its output reaches the model's output or a loss's prediction
    with no other weight after it (Muon's rule: the input embedding and the final layer on AdamW)."""
    u = t.seen
    if u is None or not u.matrix or not u.head:
        return None
    return Decision(OUTPUT_HEAD, False, f"{OUTPUT_HEAD} (its output is the model's output: traced)",
                    decided_by="trace")


def traced_map(t: TensorView) -> Optional[Decision]:
    """A raw tensor the forward applies as a linear map: through an equation (``einsum``, ``tensordot``, a
    reshaped view: :mod:`.equations`), per expert (a stack), or as ``x @ W`` (stored ``[in, out]``)."""
    u = t.seen
    if u is None or not u.matrix or t.matrix_type():
        return None
    if u.applied is not None or u.applied_unread:
        return _applied(u, t.shape)
    if not u.ops & MATRIX_OPS:
        return None
    stack = len(t.shape) >= 3
    plan = traced_plan(u, t.shape, stack, t.module_name, t.pname)
    if stack:
        plan = plan or FusedPlan({}, "experts", transposed=bool(u.stored_in_out), experts=True)
        return Decision(EXPERT, True, f"{HIDDEN_MATRIX}, {plan.what} apart (a stack applied per expert: traced)",
                        plan, decided_by="trace")
    if plan is not None:
        return Decision(FUSED_BLOCK, True, f"{HIDDEN_MATRIX}, {plan.what} apart (traced)", plan, "trace")
    if u.stored_in_out:  # x @ W: stored [in, out], its scale read from [out, in]
        return Decision(HIDDEN_LINEAR, True, f"{HIDDEN_MATRIX}, stored [in, out] (applied as a linear map: "
                        "traced)", FusedPlan({}, ONE_MATRIX, transposed=True), "trace")
    return Decision(HIDDEN_LINEAR, True, f"{HIDDEN_MATRIX} (applied as a linear map: traced)", None, "trace")


def module_matrix(t: TensorView) -> Optional[Decision]:
    """A matrix its module applies (linear, conv, recurrent gates, fused projections and expert stacks with the
    config's blocks, attention projections, a router with ``routers="muon"``, a tagged tensor), in the
    blocks the forward splits its output into where the config gives none."""
    d = _module_matrix(t)
    return None if d is None else _traced_blocks(d, t)


def raw(t: TensorView) -> Decision:
    """Anything else: a bare ``nn.Parameter`` of a module that is not a linear map (``A_log``, position
    tables, tokens)."""
    return t.confirmed(Decision(RAW, False, f"{RAW} of {type(t.module).__name__} (not a linear map it applies)"))


@dataclass(frozen=True)
class Rule:
    """One entry of :data:`PRECEDENCE`: the evidence it reads, the kinds it gives, and the rule itself."""

    evidence: str
    kinds: Tuple[str, ...]
    rule: Callable[[TensorView], Optional[Decision]]


SAVED_COPY = Rule("module type (PEFT)", (), peft_saved_copy)
PARAMETRIZED = Rule("module type", (), parametrized)
PRECEDENCE: Tuple[Rule, ...] = (
    Rule("module type (PEFT)", (), peft_factor),
    SAVED_COPY,
    PARAMETRIZED,
    Rule("module type", (EMBEDDING,), embedding),
    Rule("module type", (VECTOR,), not_a_matrix),
    Rule("trace", (EMBEDDING,), looked_up),
    Rule("config", (OUTPUT_HEAD, INPUT_LAYER), model_ends),
    Rule("name", (OUTPUT_HEAD,), head_name),
    Rule("config", (OUTPUT_HEAD,), labelled_head),
    Rule("module type, config", (ROUTER,), router),
    Rule("config", (INPUT_LAYER,), config_input),
    Rule("module type", (DEPTHWISE,), depthwise),
    Rule("module type, name", (VECTOR,), norm),
    Rule("trace", (INPUT_LAYER,), traced_input),
    Rule("trace", (OUTPUT_HEAD,), traced_head),
    Rule("trace", (HIDDEN_LINEAR, FUSED_BLOCK, EXPERT, RAW), traced_map),
    Rule("module type, config, trace", (HIDDEN_LINEAR, FUSED_BLOCK, EXPERT, CONV), module_matrix),
    Rule("module type", (RAW,), raw),
)


def _first(t: TensorView, start: int = 0) -> Decision:
    for entry in PRECEDENCE[start:]:
        d = entry.rule(t)
        if d is not None:
            return d
    raise AssertionError("the last rule always decides")


# -- what the module-type rule reads ------------------------------------------------------------------
def _module_matrix(t: TensorView) -> Optional[Decision]:
    """What the module's type (and the config's blocks) make of a matrix it applies; None for anything else."""
    m, pname, shape, f = t.module, t.pname, t.shape, t.facts
    if t.router():  # routers="muon"
        return Decision(HIDDEN_LINEAR, True, HIDDEN_MATRIX, decided_by=t.router())
    if isinstance(m, nn.RNNBase) and pname.startswith("weight_"):
        gates = RECURRENT_GATES.get(m.mode, "")
        if not pname.startswith(("weight_ih", "weight_hh")) or not gates or not f.split_fused:
            return Decision(HIDDEN_LINEAR, True, HIDDEN_MATRIX)
        n = int(shape[0]) // len(gates)
        plan = FusedPlan({g: ((i * n, n), None) for i, g in enumerate(gates)}, "|".join(gates))
        return Decision(FUSED_BLOCK, True, f"{HIDDEN_MATRIX}, gates {plan.what} apart", plan)
    plan = t.plan()
    if t.plan_error is not None:
        if t.use is None or not t.use.blocks:
            raise t.plan_error
        return Decision(HIDDEN_LINEAR, True, HIDDEN_MATRIX)  # the forward says how it is fused
    if plan is not None:
        kind = EXPERT if plan.experts or plan.what == "experts" else FUSED_BLOCK
        return Decision(kind, True, f"{HIDDEN_MATRIX}, {plan.what} apart", plan, decided_by="config")
    if is_fused_experts(m) and pname in STACK_NAMES:
        return Decision(EXPERT, True, HIDDEN_MATRIX)
    if is_linear(m) and t.weight:
        if f.split_fused and not t.tagged and f.configs.config is not None:
            owner, cname = f.modules.parent.get(id(m), (None, ""))
            what = looks_fused(owner, m, f.configs.config, cname) if owner is not None and is_attention(owner) else None
            if what is not None and not (t.use is not None and t.use.blocks):  # the forward says how it is fused
                raise NotImplementedError(
                    f"muon_param_groups: {t.module_name}.{pname} {shape} ({type(m).__name__} of "
                    f"{type(owner).__name__}) looks like a fused {what} projection, and ds_muon does not know "
                    "how this family lays its blocks out. Tag it before building the groups: "
                    "ds_muon.split_rows(p, {'q': .., 'k': .., 'v': ..}) for contiguous rows, ds_muon.fused_blocks"
                    "(p, ...) for interleaved ones; or pass split_fused=False to orthogonalize it whole")
        return Decision(HIDDEN_LINEAR, True, HIDDEN_MATRIX)
    if is_conv(m) and t.weight:
        return Decision(CONV, True, f"{HIDDEN_MATRIX}, conv")
    if isinstance(m, nn.MultiheadAttention) and pname.endswith("proj_weight"):  # q/k/v_proj_weight
        return Decision(HIDDEN_LINEAR, True, HIDDEN_MATRIX)
    if t.param is not None and getattr(t.param, EXPERTS, False):  # the user tagged a stack
        return Decision(EXPERT, True, f"{HIDDEN_MATRIX}, tagged expert_weight")
    if t.tagged:
        return Decision(HIDDEN_LINEAR, True, f"{HIDDEN_MATRIX}, tagged")
    return None


def _traced_blocks(d: Decision, t: TensorView) -> Decision:
    """A module-type matrix as the forward applies it: the blocks it splits the output into (where the config
    gave none and split_fused is on); a difference from the config's blocks is recorded."""
    u, f, shape = t.seen, t.facts, t.shape
    if u is None:
        return d
    traced = replace(d, decided_by="trace")
    if not u.matrix:
        return traced if u.ops - {"index", "elementwise"} else d
    if not u.blocks or d.kind == CONV or not f.split_fused or t.tagged:
        return traced
    if d.plan is None and is_fused_experts(t.module) and t.pname in STACK_NAMES:  # tagged by tag_fused_experts
        try:
            stacked = stack_plan(t.module, t.pname, shape, t.pname)
        except NotImplementedError:
            stacked = None
        if stacked is not None and stacked.blocks:
            rows = {k: ((sum(list(stacked.blocks.values())[:i]), n), None)
                    for i, (k, n) in enumerate(stacked.blocks.items())}
            if not same_partition(FusedPlan(rows, "gate|up", False, True), u, shape):
                f.disagreements.append(f"{t.module_name}.{t.pname}: rules gate|up, forward {len(u.blocks)} blocks")
        return traced
    if d.plan is not None:
        if f.split_attention is None and not same_partition(d.plan, u, shape):
            f.disagreements.append(f"{t.module_name}.{t.pname}: rules {d.plan.what}, forward {len(u.blocks)} blocks")
        return traced
    plan = traced_plan(u, shape, len(shape) >= 3, t.module_name, t.pname)
    if plan is None:
        return traced
    kind = EXPERT if plan.experts else FUSED_BLOCK
    return Decision(kind, True, f"{HIDDEN_MATRIX}, {plan.what} apart (traced)", plan, decided_by="trace")


def _applied(use: Use, shape) -> Decision:
    """A raw parameter applied through an equation: Muon on the ``[out, in]`` matrix it applies, per stack member
    (:mod:`.equations`), where a ``[prod(shape[:k]), rest]`` view holds it; AdamW, saying why, where not."""
    a = use.applied
    if use.applied_unread or a is None:
        return Decision(RAW, False, f"{RAW} ({use.applied_unread}: traced)", decided_by="trace")
    lay = layout(a)
    if lay is None:
        return Decision(RAW, False, f"{RAW} ({a.equation!r} applies it as {a.describe(shape)}, which no "
                                    f"[rows, columns] view of a {tuple(shape)} tensor's leading and trailing axes "
                                    "is: traced)", decided_by="trace")
    plan = None
    if lay.experts or lay.transposed or lay.row_axes != 1:
        plan = FusedPlan({}, "experts" if lay.experts else ONE_MATRIX, transposed=lay.transposed, experts=lay.experts,
                         row_axes=lay.row_axes)
    elif len(shape) > 2:
        plan = FusedPlan({}, ONE_MATRIX)
    stored = ", stored [in, out]" if lay.transposed else ""
    return Decision(EXPERT if lay.experts else HIDDEN_LINEAR, True,
                    f"{HIDDEN_MATRIX}, {a.describe(shape)} applied by {a.equation!r}{stored} (traced)", plan,
                    decided_by="trace")


def decide(rules: Rules, module_name: str, module: nn.Module, pname: str, shape: Sequence[int],
           param: Optional[torch.Tensor] = None) -> Decision:
    """The decision for one tensor of the model ``rules`` read: the first rule of :data:`PRECEDENCE` that
    applies."""
    return _first(TensorView(rules, module_name, module, pname, shape, param, rules.use_of(module, pname)))
