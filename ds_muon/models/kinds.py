"""What each tensor of a model is, and so which optimizer it takes: the one place that decides.

Muon's orthogonal update is right for a weight its module applies as a linear map of hidden
features, and wrong for everything else (rows that are looked up, the ends of the model, a
router's few logits, per-channel filters, tensors used any other way).  So the decision reads
what the model says about itself, in this order:

1. the module's type: ``nn.Embedding``; ``nn.Linear`` (and subclasses) and transformers'
   ``Conv1D``; ``nn.Conv*d`` (depthwise ones, ``groups == in_channels``, excepted); transformers'
   fused expert stacks; a bare ``nn.Parameter`` of any other module is a *raw parameter*;
2. the model's own API for its ends: everything under ``get_input_embeddings()`` and
   ``get_output_embeddings()``, weights tied to an embedding, and heads outside ``base_model``
   producing ``config.num_labels`` (or the vocabulary);
3. the config: a Linear whose outputs equal the expert count is a router; a conv or linear
   reading the raw input's width (``num_channels``, mel bins, 1) is an input layer; fused
   projections are split in blocks whose sizes the config gives (:mod:`ds_muon.models.fused`);
4. names, only as a fallback: ``head_names`` for models without that API (or when given).

The traced forward (:mod:`.trace`) refines it: lookups are embeddings, a conv reading the input is an input
layer, the final output layer of every model takes AdamW, raw parameters applied as linear maps (per expert,
or through an equation: :mod:`.equations`) take Muon, and the blocks a forward splits an output into are
orthogonalized apart.  Each decision records its evidence (``decided_by``: trace, config, module type, name).

Every path reads it: :func:`ds_muon.muon_param_groups` (plain models, FSDP2, ZeRO-3 ``zero.Init``
through ``ds_shape``, accelerate and the Trainer, which call it) and the FSDP1 adapter, which asks
:meth:`Rules.decide` about each original tensor of a flat parameter.
"""

from __future__ import annotations

import fnmatch
import weakref
from dataclasses import dataclass, replace
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

from ..tensors.shape import global_shape
from ..tensors.tag_keys import BLOCKS, EXPERTS, SPLIT_ROWS, TENSOR_PARALLEL
from .experts import STACK_NAMES, is_fused_experts, is_router, mark_routers, stack_plan
from .fused import FusedPlan, experts_gate_up, from_forward, looks_fused, reader_for
from . import config as cfg
from .adapters import base_layer_of, lora_factors, saved_copies
from .equations import layout
from .trace import Trace, Use, trace as trace_forward
from .wrappers import unwrap_model

# -- the closed list of kinds, and the optimizer each takes ---------------------------------
HIDDEN_LINEAR = "hidden linear"
FUSED_BLOCK = "fused block"
EXPERT = "expert"
CONV = "conv"
INPUT_LAYER = "input layer"
OUTPUT_HEAD = "output head"
ROUTER = "router"
EMBEDDING = "embedding"
VECTOR = "norm/bias/1-D"
RAW = "raw parameter"
DEPTHWISE = "depthwise conv"
KINDS: Dict[str, str] = {  # kind -> default optimizer
    HIDDEN_LINEAR: "Muon", FUSED_BLOCK: "Muon", EXPERT: "Muon", CONV: "Muon",
    INPUT_LAYER: "AdamW", OUTPUT_HEAD: "AdamW", ROUTER: "AdamW", EMBEDDING: "AdamW", VECTOR: "AdamW",
    RAW: "AdamW", DEPTHWISE: "AdamW",
}
MUON_KINDS = frozenset(k for k, o in KINDS.items() if o == "Muon")

HIDDEN_MATRIX = "hidden matrix"  # the reason of a Muon tensor (summary); details follow after ", "
ONE_MATRIX = "one matrix"  # the plan of an N-D tensor an equation applies as one [shape[0], rest] matrix
HEAD_NAMES: Tuple[str, ...] = ("lm_head", "head", "output", "classifier")
EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)
NORM_WORDS = ("norm", "Norm")
HEAD_PROJ_NAMES = ("q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv", "q", "k", "v")


@dataclass(frozen=True)
class Decision:
    """What a tensor is (``kind``, one of :data:`KINDS`), whether it takes Muon, why (what
    :meth:`ds_muon.Muon.summary` shows), and the blocks of a fused projection (``plan``)."""

    kind: str
    muon: bool
    reason: str
    plan: Optional[FusedPlan] = None
    decided_by: str = "module type"  # the evidence: "trace" (what the forward does), "config" (the config and the
    # model's own API for its ends), "module type", or "name" (the fallback)


def is_conv1d_transformers(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2 and kin): a linear layer stored ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d_transformers(module)


def is_depthwise(module: nn.Module) -> bool:
    return isinstance(module, _ConvNd) and module.groups > 1 and module.groups == module.in_channels


def _is_pretrained(model: nn.Module) -> bool:
    return hasattr(model, "get_input_embeddings") and hasattr(model, "base_model") and hasattr(model, "config")


def _subtree_ids(module: Optional[nn.Module]) -> Set[int]:
    return {id(m) for m in module.modules()} if isinstance(module, nn.Module) else set()


def _call(model, name):
    try:
        return getattr(model, name)()
    except (NotImplementedError, AttributeError, TypeError, ValueError):
        return None


class Rules:
    """The facts of one model (its ends, config, owners of fused projections) and :meth:`decide`."""

    def __init__(self, model: nn.Module, head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw",
                 split_fused: bool = True, split_attention: Optional[str] = None, trace=True, example_inputs=None):
        model = unwrap_model(model)
        self.head_names = tuple(head_names)
        self.routers = routers
        self.split_fused = split_fused
        self.split_attention = split_attention
        self.hf = _is_pretrained(model)
        self.names_given = self.head_names != HEAD_NAMES
        self.names_rule = not self.hf or self.names_given
        configs = cfg.configs_of(model)
        self.config = configs[0] if configs else None
        self.experts = cfg.expert_counts(configs)
        self.labels = cfg.label_counts(configs)
        self.vocab = cfg.vocab_sizes(configs)
        self.widths = cfg.input_widths(configs)
        self.input_ids = _subtree_ids(_call(model, "get_input_embeddings")) if self.hf else set()
        out = _call(model, "get_output_embeddings")
        self.output_ids = _subtree_ids(out) if self.hf else set()
        if hasattr(model, "get_output_embeddings") and not self.hf:
            self.output_ids = _subtree_ids(out)
        base = getattr(model, "base_model", model) if self.hf else model
        self.head_region = (_subtree_ids(model) - _subtree_ids(base)) if base is not model else set()
        self.parent: Dict[int, Tuple[nn.Module, str]] = {}
        self.path: Dict[int, str] = {}
        for name, m in model.named_modules():
            self.path[id(m)] = name
            for cname, c in m.named_children():
                self.parent.setdefault(id(c), (m, cname))
        self.embedding_params: Set[int] = set()
        for m in model.modules():
            if isinstance(m, EMBEDDING_TYPES):
                self.embedding_params.update(id(p) for p in m.parameters(recurse=False))
        self.lora_factors = lora_factors(model)  # PEFT: a factor takes its base layer's decision
        self.saved_copies = saved_copies(model)  # PEFT: a modules_to_save copy, the original's
        mark_routers(model)
        if isinstance(trace, Trace):
            self.trace = trace
        elif trace:
            self.trace = trace_forward(model, example_inputs)
        else:
            self.trace = Trace(error="trace=False")
        self.uses = {clean_name(n): u for n, u in self.trace.uses.items()}
        self.disagreements: List[str] = []  # a fused plan of the rules the forward does not split alike
        for m in model.modules():  # so the FSDP1 adapter, seeing one module, asks the same rules
            _RULES_OF[m] = self

    def use_of(self, module: nn.Module, pname: str) -> Optional[Use]:
        """What the traced forward did with ``module``'s ``pname`` (None: not traced, or not used)."""
        path = self.path.get(id(module))
        if path is None or not self.uses:
            return None
        return self.uses.get(clean_name(f"{path}.{pname}" if path else pname))

    def untraced_why(self) -> str:
        return self.trace.error or "not used by the traced forward"

    def options(self) -> tuple:
        return (self.head_names, self.routers, self.split_fused, self.split_attention)

    # -- one tensor ---------------------------------------------------------------------------
    def decide(self, module_name: str, module: nn.Module, pname: str, shape: Sequence[int],
               param: Optional[torch.Tensor] = None, config=None) -> Decision:
        """The rules' decision (module types, config, names) refined by what the traced forward does."""
        shape = tuple(int(s) for s in shape)
        if id(module) in self.lora_factors:
            return self._lora_factor(module_name, *self.lora_factors[id(module)])
        use = self.use_of(module, pname)
        try:
            d = self._rules(module_name, module, pname, shape, param, config)
        except NotImplementedError:
            if use is None or not use.blocks:
                raise
            d = Decision(HIDDEN_LINEAR, True, HIDDEN_MATRIX)  # the forward says how it is fused
        if d.decided_by == "name" and not self.names_given and use is not None and use.matrix and not use.head:
            # the forward shows a hidden layer named like a default head name: the trace decides (head_names the
            # user gave stay the user's word)
            self.names_rule = False
            try:
                d = self._rules(module_name, module, pname, shape, param, config)
            finally:
                self.names_rule = True
        d = self._refine(d, use, module_name, module, pname, shape, param)
        original = self.saved_copies.get(id(module))
        if original is not None and d.muon:
            return self._saved_copy(d, original, pname)
        return d

    def _lora_factor(self, module_name: str, layer: nn.Module, which: str) -> Decision:
        """A LoRA factor: the decision of the layer it adapts (one matrix of rank ``r``, never its blocks)."""
        base = base_layer_of(layer)
        weight = getattr(base, "weight", None)
        if not isinstance(weight, torch.Tensor):
            return Decision(RAW, False, f"{RAW}, LoRA {which} of a {type(base).__name__} without a weight")
        shape = global_shape(weight)
        if isinstance(base, nn.Linear) and len(shape) != 2:  # a quantized base stores its weight packed
            shape = (base.out_features, base.in_features)
        path = self.path.get(id(base), module_name)
        d = self.decide(path, base, "weight", shape, weight)
        if d.muon:
            kind = CONV if d.kind == CONV else HIDDEN_LINEAR
            return Decision(kind, True, f"{HIDDEN_MATRIX}, LoRA {which} of a {d.kind} ({path}), one matrix",
                            decided_by=d.decided_by)
        return Decision(d.kind, False, f"{d.reason}; LoRA {which} of it ({path})", decided_by=d.decided_by)

    def _saved_copy(self, d: Decision, original: nn.Module, pname: str) -> Decision:
        """A ``modules_to_save`` copy: an end of the model when the module it copies is one (the original is
        not run by the traced forward, the copy is: either saying "end" decides)."""
        weight = getattr(original, pname, None)
        if not isinstance(weight, torch.Tensor):
            return d
        path = self.path.get(id(original), "")
        od = self.decide(path, original, pname, global_shape(weight), weight)
        if od.muon:
            return d
        return Decision(od.kind, False, f"{od.reason}; modules_to_save copy of {path}", decided_by=od.decided_by)

    def _refine(self, d: Decision, use: Optional[Use], module_name, module, pname, shape, param) -> Decision:
        """What the trace changes: lookups are embeddings; a matrix reading the model's input is an input
        layer, one whose output is the model's output a head; a bare stack applied as a linear map (per
        expert) takes Muon; the blocks the forward splits a Muon weight's output into are its blocks.
        Evidence that a tensor is *not* used as a matrix never moves one off Muon (a composite op such as
        ``F.multi_head_attention_forward`` hides its inner linears)."""
        if use is None:
            return d
        if len(shape) < 2:
            return d  # its shape decided
        traced = replace(d, decided_by="trace")
        if d.kind in (VECTOR, DEPTHWISE, ROUTER):
            return traced
        if "embedding" in use.ops and not use.matrix:
            return traced if d.kind == EMBEDDING else Decision(EMBEDDING, False, f"{EMBEDDING} (looked up: traced)",
                                                               decided_by="trace")
        if not use.matrix or d.kind == EMBEDDING:
            return traced if not d.muon or use.ops - {"index", "elementwise"} else d
        if use.input_layer and (d.muon or d.kind == RAW) and (self.hf or "conv" in use.ops):
            # a conv reading the input is a stem (pixels, audio); a Linear reading a config-less model's
            # input may read features the user's pipeline made, and stays a hidden map
            return Decision(INPUT_LAYER, False, "input layer (reads the model's input: traced)", decided_by="trace")
        if use.head and (d.muon or d.kind == RAW):
            # the final output layer (Muon's own rule: input embedding and final layer on AdamW): the weight
            # whose output reaches the model's output with no other weight after it, for every model
            return Decision(OUTPUT_HEAD, False, f"{OUTPUT_HEAD} (its output is the model's output: traced)",
                            decided_by="trace")
        if d.kind == RAW and (use.applied is not None or use.applied_unread):
            return self._applied(use, shape)
        tagged = param is not None and any(getattr(param, a, None) for a in (EXPERTS, SPLIT_ROWS, BLOCKS,
                                                                             TENSOR_PARALLEL))
        if d.kind == RAW and use.ops & {"linear", "matmul", "bmm", "mm", "addmm", "baddbmm", "grouped_mm"}:
            stack = len(shape) >= 3
            plan = self._traced_plan(use, shape, stack, module_name, pname) if not tagged else None
            if stack:
                plan = plan or FusedPlan({}, "experts", transposed=bool(use.stored_in_out), experts=True)
                return Decision(EXPERT, True, f"{HIDDEN_MATRIX}, {plan.what} apart (a stack applied per expert: traced)",
                                plan, decided_by="trace")
            if plan is not None:
                return Decision(FUSED_BLOCK, True, f"{HIDDEN_MATRIX}, {plan.what} apart (traced)", plan, "trace")
            if use.stored_in_out:  # x @ W: stored [in, out], its scale read from [out, in]
                return Decision(HIDDEN_LINEAR, True, f"{HIDDEN_MATRIX}, stored [in, out] (applied as a linear map: "
                                "traced)", FusedPlan({}, ONE_MATRIX, transposed=True), "trace")
            return Decision(HIDDEN_LINEAR, True, f"{HIDDEN_MATRIX} (applied as a linear map: traced)", None, "trace")
        if not d.muon or not use.blocks or d.kind == CONV or not self.split_fused or tagged:
            return traced
        if d.plan is None and is_fused_experts(module) and pname in STACK_NAMES:  # tagged by tag_fused_experts
            try:
                stacked = stack_plan(module, pname, shape, pname)
            except NotImplementedError:
                stacked = None
            if stacked is not None and stacked.blocks:
                rows = {k: ((sum(list(stacked.blocks.values())[:i]), n), None)
                        for i, (k, n) in enumerate(stacked.blocks.items())}
                d = replace(d, plan=None)
                if not _same_partition(FusedPlan(rows, "gate|up", False, True), use, shape):
                    self.disagreements.append(f"{module_name}.{pname}: rules gate|up, forward {len(use.blocks)} blocks")
            return traced
        if d.plan is not None:
            if self.split_attention is None and not _same_partition(d.plan, use, shape):
                self.disagreements.append(f"{module_name}.{pname}: rules {d.plan.what}, forward "
                                          f"{len(use.blocks)} blocks")
            return traced
        plan = self._traced_plan(use, shape, len(shape) >= 3, module_name, pname)
        if plan is None:
            return traced
        kind = EXPERT if plan.experts else FUSED_BLOCK
        return Decision(kind, True, f"{HIDDEN_MATRIX}, {plan.what} apart (traced)", plan, decided_by="trace")

    def _applied(self, use: Use, shape) -> Decision:
        """A raw parameter applied through an equation (``einsum``, ``tensordot``, a reshaped view): Muon on
        the ``[out, in]`` matrix the equation applies, per stack member (:mod:`ds_muon.models.equations`),
        where the engine's ``[shape[0], rest]`` layout holds it; AdamW, saying why, where not."""
        a = use.applied
        if use.applied_unread or a is None:
            return Decision(RAW, False, f"{RAW} ({use.applied_unread}: traced)", decided_by="trace")
        lay = layout(a)
        if lay is None:
            return Decision(RAW, False, f"{RAW} ({a.equation!r} applies it as {a.describe(shape)}, which a "
                                        f"{tuple(shape)} tensor held as [shape[0], rest] cannot be: traced)",
                            decided_by="trace")
        plan = None
        if lay.experts or lay.transposed:
            plan = FusedPlan({}, "experts" if lay.experts else ONE_MATRIX, transposed=lay.transposed,
                             experts=lay.experts)
        elif len(shape) > 2:
            plan = FusedPlan({}, ONE_MATRIX)
        stored = ", stored [in, out]" if lay.transposed else ""
        return Decision(EXPERT if lay.experts else HIDDEN_LINEAR, True,
                        f"{HIDDEN_MATRIX}, {a.describe(shape)} applied by {a.equation!r}{stored} (traced)", plan,
                        decided_by="trace")

    def _traced_plan(self, use: Use, shape, stack: bool, module_name: str, pname: str) -> Optional[FusedPlan]:
        """The blocks the forward split the output into, as a :class:`FusedPlan` (rows of an ``[out, in]``
        weight, columns of an ``[in, out]`` one; per expert for a stack).  Raises for blocks that are not
        runs ``(start, length, count, period)``, naming the tensor."""
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

    def _rules(self, module_name: str, module: nn.Module, pname: str, shape: Sequence[int],
               param: Optional[torch.Tensor] = None, config=None) -> Decision:
        tagged = param is not None and any(getattr(param, a, None) for a in (EXPERTS, SPLIT_ROWS, BLOCKS,
                                                                             TENSOR_PARALLEL))
        if isinstance(module, EMBEDDING_TYPES):
            return Decision(EMBEDDING, False, EMBEDDING)
        if param is not None and id(param) in self.embedding_params:  # tied to an embedding
            return Decision(EMBEDDING, False, f"{EMBEDDING}, {OUTPUT_HEAD}")
        if is_fused_experts(module) and pname.endswith("bias"):
            return Decision(VECTOR, False, "expert bias")
        layer = self._parametrized(module)
        if layer is not None:  # torch's parametrizations: original0/1 of weight_norm, original of any other
            if pname == "original0":
                return Decision(VECTOR, False, "weight-norm gain")
            return self._rules(self.path.get(id(layer[0]), ""), layer[0], layer[1], shape, param, config)
        if pname == "weight_g" and hasattr(module, "weight_v"):  # nn.utils.weight_norm (the old one)
            return Decision(VECTOR, False, "weight-norm gain")
        if pname == "weight_v" and (is_linear(module) or isinstance(module, _ConvNd)):
            pname = "weight"  # the direction of a weight-normed layer: its matrix
        if len(shape) < 2:
            return Decision(VECTOR, False, f"{len(shape)}-D")
        mid = id(module)
        if mid in self.output_ids:
            return Decision(OUTPUT_HEAD, False, OUTPUT_HEAD, decided_by="config")
        if mid in self.input_ids:
            return Decision(INPUT_LAYER, False, "input layer (under get_input_embeddings())", decided_by="config")
        if self.names_rule and module_name.rsplit(".", 1)[-1] in self.head_names:
            return Decision(OUTPUT_HEAD, False, OUTPUT_HEAD, decided_by="name")
        linear = is_linear(module) and pname == "weight"
        if linear or (isinstance(module, _ConvNd) and pname == "weight"):
            outs = int(module.nf if is_conv1d_transformers(module) else shape[0])
            if mid in self.head_region and (outs in self.labels or outs in self.vocab):
                return Decision(OUTPUT_HEAD, False, f"{OUTPUT_HEAD} ({outs} outputs: num_labels / vocab)",
                                decided_by="config")
        if is_router(module) or (isinstance(module, nn.Linear) and pname == "weight" and shape[0] in self.experts):
            by = "module type" if is_router(module) else "config"
            if self.routers == "adamw":
                return Decision(ROUTER, False, ROUTER, decided_by=by)
            return Decision(HIDDEN_LINEAR, True, HIDDEN_MATRIX, decided_by=by)
        if isinstance(module, nn.RNNBase) and pname.startswith("weight_"):
            return self._recurrent(module, pname, shape)
        plan = self._fused(module, pname, shape, param)
        if plan is not None:
            kind = EXPERT if plan.experts or plan.what == "experts" else FUSED_BLOCK
            return Decision(kind, True, f"{HIDDEN_MATRIX}, {plan.what} apart", plan, decided_by="config")
        if is_fused_experts(module) and pname in STACK_NAMES:
            return Decision(EXPERT, True, HIDDEN_MATRIX)
        if linear:
            ins = int(shape[0] if is_conv1d_transformers(module) else shape[1])
            if ins in self.widths and ins <= 4:
                return Decision(INPUT_LAYER, False, f"input layer (reads {ins} input channels)", decided_by="config")
            if self.split_fused and not tagged and self.config is not None:
                owner, cname = self.parent.get(mid, (None, ""))
                what = (looks_fused(owner, module, self.config, cname) if owner is not None and _attention(owner)
                        else None)
                if what is not None:
                    raise NotImplementedError(
                        f"muon_param_groups: {module_name}.{pname} {shape} ({type(module).__name__} of "
                        f"{type(owner).__name__}) looks like a fused {what} projection, and ds_muon does not know "
                        "how this family lays its blocks out. Tag it before building the groups: "
                        "ds_muon.split_rows(p, {'q': .., 'k': .., 'v': ..}) for contiguous rows, ds_muon.fused_blocks"
                        "(p, ...) for interleaved ones; or pass split_fused=False to orthogonalize it whole")
            return Decision(HIDDEN_LINEAR, True, HIDDEN_MATRIX)
        if isinstance(module, _ConvNd) and pname == "weight":
            if module.in_channels in self.widths and module.in_channels <= 4:
                return Decision(INPUT_LAYER, False, f"input layer (reads {module.in_channels} input channels)",
                                decided_by="config")
            if is_depthwise(module):
                return Decision(DEPTHWISE, False, "depthwise conv (one filter per channel, not a map of features)")
            return Decision(CONV, True, f"{HIDDEN_MATRIX}, conv")
        if isinstance(module, nn.MultiheadAttention) and pname.endswith("proj_weight"):  # q/k/v_proj_weight
            return Decision(HIDDEN_LINEAR, True, HIDDEN_MATRIX)
        if param is not None and getattr(param, EXPERTS, False):  # the user tagged a stack
            return Decision(EXPERT, True, f"{HIDDEN_MATRIX}, tagged expert_weight")
        if tagged:
            return Decision(HIDDEN_LINEAR, True, f"{HIDDEN_MATRIX}, tagged")
        if any(w in type(module).__name__ for w in NORM_WORDS):
            return Decision(VECTOR, False, "norm")
        return Decision(RAW, False, f"{RAW} of {type(module).__name__} (not a linear map it applies)")

    def _recurrent(self, module, pname, shape) -> Decision:
        """nn.LSTM / nn.GRU weights ``[gates·hidden, in]``: one matrix per gate (i, f, g, o / r, z, n)."""
        gates = {"LSTM": "ifgo", "GRU": "rzn"}.get(module.mode, "")
        if not pname.startswith(("weight_ih", "weight_hh")) or not gates or not self.split_fused:
            return Decision(HIDDEN_LINEAR, True, HIDDEN_MATRIX)
        n = int(shape[0]) // len(gates)
        plan = FusedPlan({g: ((i * n, n), None) for i, g in enumerate(gates)}, "|".join(gates))
        return Decision(FUSED_BLOCK, True, f"{HIDDEN_MATRIX}, gates {plan.what} apart", plan)

    def _parametrized(self, module):
        """``(layer, tensor name)`` when ``module`` is a ``ParametrizationList`` of ``layer``."""
        if type(module).__name__ != "ParametrizationList" or id(module) not in self.parent:
            return None
        holder, name = self.parent[id(module)]
        if id(holder) not in self.parent:
            return None
        return self.parent[id(holder)][0], name

    def _fused(self, module, pname, shape, param) -> Optional[FusedPlan]:
        """The fused plan of this tensor (None: not fused, split_fused off, or the user tagged it)."""
        if param is not None and getattr(param, TENSOR_PARALLEL, None) is not None:
            return None
        per_head = self.split_attention == "heads"
        reader, owner = None, module
        if id(module) in self.parent:  # the parent knows its children's fusion (JetMoE's input_linear)
            owner, cname = self.parent[id(module)]
            reader = reader_for(owner, f"{cname}.{pname}")
        if reader is None:
            reader, owner = reader_for(module, pname), module
        if reader is None and is_fused_experts(module) and pname == "gate_up_proj" and module.has_gate and (
                module.is_transposed or not module.is_concatenated) and len(shape) == 3:
            reader = experts_gate_up
        if reader is None and is_linear(module) and pname == "weight" and id(module) in self.parent:
            owner, cname = self.parent[id(module)]
            if _attention(owner) and looks_fused(owner, module, self.config, cname) == "q|k|v" \
                    and int(shape[1] if is_conv1d_transformers(module) else shape[0]) % 3 == 0:
                reader = from_forward(owner, cname)
                if reader is not None and not is_conv1d_transformers(module):
                    owner = module if reader.__name__.startswith("_qkv") else owner
                else:
                    reader = None
        if reader is None:
            if per_head and is_linear(module) and pname == "weight" and id(module) in self.parent:
                owner, cname = self.parent[id(module)]
                if cname in HEAD_PROJ_NAMES and _attention(owner):
                    return _per_head_rows(owner, module, shape, self.config)
            return None
        plan = reader(owner, pname, shape, getattr(owner, "config", None) or self.config, per_head)
        if not self.split_fused and plan.what != "experts":
            return None
        return plan


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


def _same_partition(plan: FusedPlan, use: Use, shape) -> bool:
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


_WRAP_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter name without the prefixes FSDP1, activation checkpointing and torch.compile insert."""
    for p in _WRAP_PREFIXES:
        name = name.replace(p, "")
    return name


def _attention(module: nn.Module) -> bool:
    return hasattr(module, "head_dim") or "Attention" in type(module).__name__


def _per_head_rows(owner, module, shape, config) -> Optional[FusedPlan]:
    hd = getattr(owner, "head_dim", None)
    if not hd or shape[0] % int(hd) or shape[0] == int(hd):
        return None
    hd = int(hd)
    return FusedPlan({str(h): ((h * hd, hd), None) for h in range(shape[0] // hd)}, "heads")


_RULES_OF: "weakref.WeakKeyDictionary[nn.Module, Rules]" = weakref.WeakKeyDictionary()


def rules_of(module: nn.Module, head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw") -> Rules:
    """The rules last built over a model containing ``module`` (FSDP1 binds one flat parameter at a
    time, long after :func:`ds_muon.muon_param_groups` read the whole model); rules of ``module``
    alone when none was built, or with other options."""
    rules = _RULES_OF.get(module)
    if rules is not None and rules.head_names == tuple(head_names) and rules.routers == routers:
        return rules
    return Rules(module, head_names, routers, trace=False)  # a module alone: its input is not the model's


# -- a whole model ------------------------------------------------------------------------------
def classify(model: nn.Module, rules: Optional[Rules] = None, **options) -> Dict[int, Tuple[str, Decision]]:
    """``id(param) -> (name, decision)`` for every trainable parameter (a tied one once, first name)."""
    rules = rules if rules is not None else Rules(model, **options)
    owner: Dict[int, Tuple[str, nn.Module, str]] = {}
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            owner.setdefault(id(p), (mod_name, mod, pname))
    out: Dict[int, Tuple[str, Decision]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in out:
            continue
        mod_name, mod, pname = owner[id(p)]
        out[id(p)] = (name, rules.decide(mod_name, mod, pname, global_shape(p), p))
    return out


def matches(name: str, patterns: Iterable[str]) -> Optional[str]:
    """The first of ``patterns`` (exact names or globs) that ``name`` matches."""
    for pat in patterns:
        if name == pat or fnmatch.fnmatchcase(name, pat):
            return pat
    return None


def raw_matrices(decisions: Dict[int, Tuple[str, Decision]], shapes: Dict[int, Tuple[int, ...]]) -> List[str]:
    """Names of raw parameters with 2+ dims (what the one warning lists)."""
    return [n for i, (n, d) in decisions.items() if d.kind == RAW and len(shapes[i]) >= 2]


def model_map(model: nn.Module, **options) -> Dict[str, Decision]:
    """The one table of a model: parameter name -> :class:`Decision` (kind, Muon or not, reason, blocks and
    orientation in ``plan``, ``decided_by``), read through any wrapper (the bare module's decision)."""
    rules = Rules(unwrap_model(model), **options)
    return {name: d for name, d in classify(model, rules).values()}
