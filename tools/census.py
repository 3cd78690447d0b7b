"""The census: every model type the installed transformers builds from a config in code, classified
by ds_muon's rules (:mod:`ds_muon.models.decide`), tensor by tensor.

For each model type of ``MODEL_MAPPING_NAMES`` (a family added by a future transformers release
enters by itself) the most complete class (causal LM, masked LM, seq2seq, classification, …,
else the base model) is built from its config with few layers and small sizes (on the ``meta``
device: no memory, no time), and :func:`ds_muon.muon_param_groups` classifies every trainable
tensor.  A row reports the kinds, the fused projections split, and what failed: the model does
not build (and why), or ds_muon refuses it (and why).  The census is also a proof: the forward is read
(:mod:`ds_muon.models.trace`, on the meta device) and each tensor's decision is checked against it
(:func:`proof`: the splits the forward performs are the splits made, no input layer or head on Muon),
with how many matrices the trace decided and how many the fallback rules did.  ``--step N`` also builds N seeded
families for real and runs one single-process step from random gradients (finite or not).

Beyond transformers (``--beyond diffusers,litgpt``): every model class diffusers exports and every litgpt
named config, built small, with no ``example_inputs`` (found by :mod:`ds_muon.models.inputs`), proven the
same way, and every final layer (:func:`final_layers`: read from the autograd graph, not from the trace) on
AdamW.  :func:`check_finals` runs for the transformers families too.

    python tools/census.py [--only llama,gpt2] [--step 6] [--markdown docs/CENSUS.md]
    python tools/census.py --beyond diffusers,litgpt [--sample 10] [--markdown docs/CENSUS.md]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import random
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

CLASS_ORDER = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
               "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
               "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
               "MODEL_FOR_CTC_MAPPING_NAMES", "MODEL_MAPPING_NAMES")
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_encoder_layers", "num_decoder_layers",
              "encoder_layers", "decoder_layers", "num_blocks")
TINY = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 256, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "max_position_embeddings": 128}


@dataclass
class Row:
    family: str
    cls: str = ""
    built: bool = False
    error: str = ""  # why it did not build, or why ds_muon refused it
    refused: bool = False
    kinds: Dict[str, int] = field(default_factory=collections.Counter)
    muon: int = 0
    tensors: int = 0
    fused: List[str] = field(default_factory=list)
    step: str = ""  # "finite", "not finite: …", "skipped: …", "" (not stepped)
    tiny: bool = False  # built from the small-width config (else from the default one)
    by_trace: int = 0  # matrices (2+ dims) decided from the traced forward
    by_fallback: int = 0  # matrices decided by the config/module/name rules alone
    trace_error: str = ""  # why the forward could not be read ("" where it was)
    trace_ms: float = 0.0
    forward_splits: int = 0  # Muon matrices whose output the forward splits into blocks
    splits_made: int = 0  # of those, split by ds_muon into the same blocks
    disagreements: List[str] = field(default_factory=list)  # the decision against what the forward does
    library: str = "transformers"
    finals: int = 0  # weights whose output reaches the model's output with no weight after it (autograd)
    finals_adamw: int = 0  # of those, on AdamW
    truth_error: str = ""  # why the autograd truth could not be read
    inputs: str = ""  # what the forward was read with (ds_muon.models.inputs: how they were found)


def families() -> List[str]:
    from transformers.models.auto import modeling_auto

    return sorted(modeling_auto.MODEL_MAPPING_NAMES)


def model_class(model_type: str):
    import transformers
    from transformers.models.auto import modeling_auto

    for mapping in CLASS_ORDER:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        if isinstance(name, (list, tuple)):
            name = name[0]
        if name and hasattr(transformers, name):
            return getattr(transformers, name)
    return None


def _shrink(config, tiny: bool, depth: int = 0):
    """Few layers (and, ``tiny``, small widths) everywhere in the config tree."""
    for k, v in list(vars(config).items()):
        if isinstance(v, bool):
            continue
        if k in LAYER_KEYS and isinstance(v, int) and v > 2:
            setattr(config, k, 2)
        elif tiny and k in TINY and isinstance(v, int) and v > TINY[k]:
            setattr(config, k, TINY[k])
        elif hasattr(v, "to_dict") and hasattr(v, "model_type") and depth < 3:
            _shrink(v, tiny, depth + 1)
    vocab = getattr(config, "vocab_size", None)
    for k in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if tiny and isinstance(vocab, int) and isinstance(getattr(config, k, None), int) and getattr(config, k) >= vocab:
            setattr(config, k, 0)
    if tiny and getattr(config, "hidden_size", None) == TINY["hidden_size"]:
        nh = getattr(config, "num_attention_heads", None)
        if isinstance(nh, int) and TINY["hidden_size"] % nh == 0 and hasattr(config, "head_dim"):
            config.head_dim = TINY["hidden_size"] // nh
    return config


def build(model_type: str, tiny: bool, device: str = "meta"):
    from transformers import AutoConfig

    cls = model_class(model_type)
    if cls is None:
        raise LookupError("no model class")
    config = _shrink(AutoConfig.for_model(model_type), tiny)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device(device):
            return cls(config)


def classify_family(model_type: str, read: bool = True) -> Row:
    import ds_muon

    row = Row(model_type)
    model = None
    for tiny in (True, False):
        try:
            model = build(model_type, tiny)
            row.tiny = tiny
            break
        except Exception as e:  # noqa: BLE001 - a census reports every failure
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    if model is None:
        return row
    row.built, row.error, row.cls = True, "", type(model).__name__
    return classify_model(row, model, read=read)


def classify_model(row: Row, model, example_inputs=None, read: bool = True) -> Row:
    """Read ``model``'s forward, build its groups from that reading, and check one against the other
    (``read=False``: the rules alone, no proof)."""
    import ds_muon
    from ds_muon.models.trace import Trace, trace

    row.built, row.cls = True, row.cls or type(model).__name__
    traced = trace(model, example_inputs) if read else Trace(error="not read (sampled out)")
    row.trace_error, row.trace_ms, row.inputs = traced.error, traced.ms, traced.inputs
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            groups = ds_muon.muon_param_groups(model, trace=traced if read else False)
    except Exception as e:  # noqa: BLE001
        row.refused, row.error = True, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return row
    if read:
        proof(row, model, groups, traced)
        check_finals(row, model, groups)
    for g in groups:
        for name, kind, reason, p in zip(g["param_names"], g["param_kinds"], g["param_reasons"], g["params"]):
            row.kinds[kind] += 1
            row.tensors += 1
            row.muon += bool(g["use_muon"])
            if kind == "fused block" or ", " in reason and "apart" in reason:
                what = reason.split(", ")[1].replace(" apart", "").replace("|", "/").split(" (")[0]
                row.fused.append(f"{name.rsplit('.', 2)[-2]}:{what}")
    row.fused = sorted(set(row.fused))
    return row


def proof(row: Row, model, groups, traced) -> None:
    """The traced truth against the decision, tensor by tensor: every Muon matrix whose output the forward
    splits is split into exactly those blocks (and none the forward does not split), every matrix the
    forward reads the input with or makes the output with is on AdamW; who decided each matrix."""
    from ds_muon.tensors.tag_keys import BLOCKS, SPLIT_ROWS
    from ds_muon.models.evidence import _RULES_OF

    rules = _RULES_OF.get(model)
    if rules is not None:
        row.disagreements.extend(rules.disagreements)
    for g in groups:
        for name, p, reason in zip(g["param_names"], g["params"], g["param_reasons"]):
            if p.ndim < 2:
                continue
            if "not traced" in reason:
                row.by_fallback += 1
            else:
                row.by_trace += 1
            use = traced.uses.get(name)
            if use is None or not use.matrix:
                continue
            if g["use_muon"] and (use.head or (use.input_layer and "conv" in use.ops)):
                row.disagreements.append(f"{name}: on Muon, but the forward {'makes the output' if use.head else 'reads the input'}")
            if not g["use_muon"] or "conv" in use.ops:
                continue
            split = getattr(p, SPLIT_ROWS, None) is not None or getattr(p, BLOCKS, None) is not None
            if use.blocks:
                row.forward_splits += 1
                if split and _blocks_equal(p, use):
                    row.splits_made += 1
                else:
                    row.disagreements.append(f"{name}: the forward splits it in {len(use.blocks)} blocks, "
                                             f"ds_muon {'otherwise' if split else 'not'}")
            elif split and not use.experts and not use.unread:
                row.disagreements.append(f"{name}: split by ds_muon, not by the forward")


def _blocks_equal(p, use) -> bool:
    """Whether the blocks ds_muon tagged on ``p`` (per expert) split its outputs as the forward does."""
    from ds_muon.tensors.tag_keys import BLOCKS, SPLIT_ROWS, TRANSPOSED

    def run(spec):
        start, length, count, period = spec
        return [start + i * period + j for i in range(count) for j in range(length)]

    in_out = bool(getattr(p, TRANSPOSED, False))
    sets = set()
    split = getattr(p, SPLIT_ROWS, None)
    if split is not None:
        r = 0
        for _, n in split:
            sets.add(tuple(range(r, r + n)))
            r += n
    for _, rows, cols in getattr(p, BLOCKS, None) or ():
        sets.add(tuple(sorted(run(cols if in_out else rows))))
    return sets == {tuple(b) for b in use.blocks}


# -- the final layers, read from autograd (independent of the trace) ------------------------------
_MATRIX_NODES = ("Mm", "Addmm", "Bmm", "Baddbmm", "Addbmm", "Convolution", "ConvolutionBackward", "Embedding",
                 "EmbeddingBag", "GroupedMm", "Mv", "Addmv", "Dot", "Linear", "SlowConv", "CudnnConvolution",
                 "MkldnnConvolution", "ConvDepthwise", "ConvTranspose")
_VIEW_NODES = ("View", "UnsafeView", "Permute", "Transpose", "T", "Expand", "Reshape", "ReshapeAlias", "Clone",
               "ToCopy", "Unsqueeze", "Squeeze", "AsStrided", "Select", "Slice", "Index", "Alias", "Unbind",
               "Split", "SplitWithSizes", "Narrow", "Contiguous", "Unfold", "Flip", "Repeat")


# pieces side by side: concatenated, stacked, or written into one buffer (``out[k] = t``: CopySlices, IndexPut)
_JOIN_NODES = ("Cat", "Stack", "CopySlices", "IndexPut")


def _node_kind(node) -> str:
    n = node.name().rsplit("::", 1)[-1]  # torch::autograd::CopySlices
    for suffix in ("Backward0", "Backward1", "Backward2"):
        if n.endswith(suffix):
            n = n[: -len(suffix)]
    return n


def _keep_history_mode():
    from ds_muon.models.inputs import _Consumers

    class KeepHistory(_Consumers):
        """The truth's forward: ``detach`` keeps the graph (a view), so a detached weight's output still
        counts as another weight's output where it is mixed in (the rule reads the forward's data flow, not
        where gradients stop)."""

        def __init__(self):
            super().__init__({}, set())

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "detach" and args and isinstance(args[0], torch.Tensor) \
                    and args[0].grad_fn is not None:
                return args[0].view_as(args[0])
            return super().__torch_function__(func, types, args, kwargs)

    return KeepHistory


def _KeepHistory():  # noqa: N802 - a mode, made when torch and ds_muon are importable
    return _keep_history_mode()()


def _leaves(out) -> list:
    """Every tensor of a model's output, whatever holds it (tuple, dict, ModelOutput, BaseOutput, dataclass)."""
    import dataclasses

    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "keys") and hasattr(out, "__getitem__"):
        return [t for k in list(out.keys()) for t in _leaves(out[k])]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in _leaves(getattr(out, f.name, None))]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _leaves(v)]
    return []


def final_layers(model, inputs=None):
    """The weights (2+ dims) whose output reaches the model's output with no other weight after it, read
    from the autograd graph of one meta forward (not from ``ds_muon.models.trace``: an independent truth).
    From each output tensor the graph is walked back through every op until a weight is applied (the
    final layer) or two operands that carry different weights meet (a residual sum, attention, a gate: no
    final layer on that path; one weight's output chosen from, as ``where`` does, is still that weight's);
    pieces concatenated or stacked side by side are each followed, and a
    ``detach`` keeps its history (:func:`_keep_history_mode`).  ``(names, error)``."""
    from ds_muon.models.inputs import default_inputs
    from ds_muon.models.meta import all_nonzero
    from ds_muon.models.meta import _to_meta, meta_copy

    try:
        args, kwargs, _ = inputs if inputs is not None else default_inputs(model)
        shadow = meta_copy(model)
        shadow.eval()
        names: Dict[int, List[str]] = collections.defaultdict(list)
        for n, p in shadow.named_parameters(remove_duplicate=False):
            names[id(p)].append(n)
            p.requires_grad_(True)
        with torch.enable_grad(), all_nonzero(), _KeepHistory():
            out = shadow(*_to_meta(tuple(args)), **_to_meta(dict(kwargs)))
    except Exception as e:  # noqa: BLE001 - reported in the row
        return set(), f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"

    def param_of(node):
        seen = 0
        while node is not None and seen < 16:
            if hasattr(node, "variable"):
                v = node.variable
                return v if v.ndim >= 2 else None
            if _node_kind(node) not in _VIEW_NODES:
                return None
            nxt = [c for c, _ in node.next_functions if c is not None]
            if len(nxt) != 1:
                return None
            node, seen = nxt[0], seen + 1
        return None

    def weights(node):
        if _node_kind(node) not in _MATRIX_NODES:
            return []
        return [p for p in (param_of(c) for c, _ in node.next_functions if c is not None) if p is not None]

    # node -> (whether any weight is applied upstream of it, the weights that last produced its output): one
    # iterative, memoized post-order walk; a sum of different weights' outputs (not a join) carries them mixed
    facts: Dict[int, tuple] = {}

    def last_weights(root) -> frozenset:
        stack = [(root, False)]
        while stack:
            node, done = stack.pop()
            if id(node) in facts:
                continue
            kids = [c for c, _ in node.next_functions if c is not None]
            if not done:
                stack.append((node, True))
                stack.extend((c, False) for c in kids if id(c) not in facts)
                continue
            ws = weights(node)
            if ws:
                facts[id(node)] = (True, frozenset(names[id(p)][0] for p in ws))
                continue
            carrying = [facts[id(c)][1] for c in kids if facts[id(c)][0]]  # a mixed one counts, as empty
            mixed = len(set(carrying)) > 1 and _node_kind(node) not in _JOIN_NODES
            facts[id(node)] = (bool(carrying), frozenset() if mixed or not carrying else frozenset().union(*carrying))
        return facts[id(root)][1]

    finals = set()
    for t in _leaves(out):
        if t.grad_fn is not None:  # pieces side by side are not mixed; one weight's output chosen from is not
            finals.update(last_weights(t.grad_fn))
    return finals, ""


def check_finals(row: Row, model, groups, inputs=None) -> None:
    """Every final layer (:func:`final_layers`) on AdamW, unless ``include=`` kept it (not in a census)."""
    finals, row.truth_error = final_layers(model, inputs)
    muon = {n for g in groups if g["use_muon"] for n in g["param_names"]}
    alias = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        alias.setdefault(id(p), []).append(n)
    by_name = {n: ns for ns in alias.values() for n in ns}
    row.finals = len(finals)
    for n in sorted(finals):
        if any(a in muon for a in by_name.get(n, [n])):
            row.disagreements.append(f"{n}: on Muon, but its output reaches the model's output with no weight "
                                     f"after it (a final layer)")
        else:
            row.finals_adamw += 1


# -- beyond transformers: diffusers' model classes and litgpt's named configs ----------------------
DIFFUSERS_TINY = {"num_attention_heads": 2, "attention_head_dim": 16, "cross_attention_dim": 32,
                  "joint_attention_dim": 32, "caption_channels": 32, "pooled_projection_dim": 32,
                  "encoder_hid_dim": 32, "text_embed_dim": 32, "caption_projection_dim": 32}
DIFFUSERS_NONE = {"in_channels": 4, "patch_size": 2, "sample_size": 32}  # where the default None cannot build
DIFFUSERS_DEPTH = ("num_layers", "num_single_layers", "layers_per_block", "transformer_layers_per_block",
                   "num_encoder_layers", "num_decoder_layers", "depth", "num_blocks", "n_layers",
                   "num_refiner_layers", "num_res_blocks")


def diffusers_classes() -> List[str]:
    """Every model class diffusers exports (a ``ModelMixin``), by name: a class added by a future release
    enters by itself."""
    import inspect

    import diffusers
    from diffusers import ModelMixin

    out = []
    for n in dir(diffusers):
        if n.startswith("_"):
            continue
        try:
            c = getattr(diffusers, n)
        except Exception:  # noqa: BLE001 - an optional backend missing
            continue
        if inspect.isclass(c) and issubclass(c, ModelMixin) and c is not ModelMixin:
            out.append(n)
    return sorted(out)


def _diffusers_kwargs(cls, tiny: bool, fill: bool = False) -> dict:
    """Few layers (and, ``tiny``, small widths) from the class's ``__init__`` defaults (``fill``: the
    :data:`DIFFUSERS_NONE` values where the default is None)."""
    import inspect

    kw = {}
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        d = p.default
        if fill and d is None and p.name in DIFFUSERS_NONE:
            kw[p.name] = DIFFUSERS_NONE[p.name]
        if d is inspect.Parameter.empty or isinstance(d, bool):
            continue
        if p.name in DIFFUSERS_DEPTH and isinstance(d, int) and d > 1:
            kw[p.name] = 1
        elif p.name in DIFFUSERS_DEPTH and isinstance(d, tuple) and all(isinstance(v, int) for v in d):
            kw[p.name] = tuple(min(v, 1) for v in d)
        elif tiny and p.name in DIFFUSERS_TINY and isinstance(d, int) and d > DIFFUSERS_TINY[p.name]:
            kw[p.name] = DIFFUSERS_TINY[p.name]
        elif tiny and p.name in ("block_out_channels", "decoder_block_out_channels", "encoder_block_out_channels") \
                and isinstance(d, tuple) and all(isinstance(v, int) for v in d):
            kw[p.name] = tuple(min(v, 64) for v in d)
    return kw


def build_diffusers(name: str, tiny: bool, device: str = "meta"):
    import diffusers

    cls = getattr(diffusers, name)
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device(device):
            try:
                return cls(**_diffusers_kwargs(cls, tiny))
            except Exception:  # noqa: BLE001 - a default of None it cannot build with: fill it
                fill = _diffusers_kwargs(cls, tiny, fill=True)
                if fill == _diffusers_kwargs(cls, tiny):
                    raise
                return cls(**fill)


def litgpt_configs() -> List[str]:
    from litgpt.config import configs

    return sorted({c["name"] for c in configs})


def build_litgpt(name: str, tiny: bool, device: str = "meta"):
    """litgpt's ``GPT`` of a named config with 2 layers (and, ``tiny``, 4 heads of 16, a 256 vocabulary)."""
    from litgpt import GPT, Config

    base = Config.from_name(name)
    over = {"n_layer": min(base.n_layer, 2)}
    if base.sliding_window_indices is not None:
        over["sliding_window_indices"] = list(base.sliding_window_indices)[: over["n_layer"]]
    if getattr(base, "rope_indices", None) is not None:
        over["rope_indices"] = list(base.rope_indices)[: over["n_layer"]]
    if base.first_k_dense_replace:
        over["first_k_dense_replace"] = min(base.first_k_dense_replace, 1)
    if tiny:
        h = 4
        g = h if base.n_query_groups == base.n_head else 1 if base.n_query_groups == 1 else 2
        over.update(n_head=h, n_query_groups=g, head_size=16, n_embd=64, intermediate_size=96, vocab_size=256,
                    padded_vocab_size=256, block_size=64)
        if base.moe_intermediate_size:
            over["moe_intermediate_size"] = 32
        if base.n_expert:
            over.update(n_expert=min(base.n_expert, 4), n_expert_per_token=min(base.n_expert_per_token, 2))
            if base.n_expert_groups:
                over.update(n_expert_groups=1, n_topk_groups=1)
    torch.manual_seed(0)
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        return GPT(Config.from_name(name, **over))


def classify_other(library: str, name: str, read: bool = True) -> Row:
    """One diffusers class or litgpt config: built tiny where it can be (else with few layers at its default
    widths), classified, and (``read``) proven against its traced forward and its autograd final layers."""
    build = build_diffusers if library == "diffusers" else build_litgpt
    row = Row(name, library=library)
    model = None
    for tiny in (True, False):
        try:
            model = build(name, tiny)
            row.tiny = tiny
            if read and tiny:  # the tiny widths must also run the forward (a rope table sized to the width)
                from ds_muon.models.inputs import default_inputs

                args, kwargs, what = default_inputs(model)
                if "guessed from the first layer" in what:
                    raise RuntimeError(what.split("ran: ", 1)[-1])
            break
        except Exception as e:  # noqa: BLE001 - a census reports every failure
            model = None if not tiny else None
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    if model is None:
        return row
    row.built, row.error, row.cls = True, "", type(model).__name__
    return classify_model(row, model, read=read)


def census_beyond(libraries=("diffusers", "litgpt"), only: Optional[List[str]] = None, seed: int = 0,
                  sample: Optional[int] = None, must=()) -> List[Row]:
    """Every diffusers class and litgpt config (or ``sample`` seeded ones of each and ``must``)."""
    rows = []
    for lib in libraries:
        try:
            names = diffusers_classes() if lib == "diffusers" else litgpt_configs()
        except ImportError as e:
            rows.append(Row(lib, library=lib, error=f"not installed: {e}"))
            continue
        names = [n for n in names if only is None or n in only]
        if sample is not None:
            chosen = set(random.Random(seed).sample(names, min(sample, len(names)))) | (set(must) & set(names))
            names = [n for n in names if n in chosen]
        rows += [classify_other(lib, n) for n in names]
    return rows


def step_family(model_type: str) -> str:
    """Build the family for real (tiny) and run one step from seeded random gradients."""
    import ds_muon

    model = build(model_type, True, device="cpu")
    if sum(p.numel() for p in model.parameters()) > 20_000_000:
        return "skipped: too large"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model), ns_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt.step()
    bad = [n for n, p in model.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
    still = [n for n, p in model.named_parameters() if p.requires_grad and torch.equal(p, before[n])]
    if bad:
        return f"not finite: {bad[:3]}"
    if still:
        return f"unchanged: {still[:3]}"
    return "finite"


def census(only: Optional[List[str]] = None, step: int = 0, seed: int = 0, read: Optional[int] = None,
           must_read=()) -> List[Row]:
    """Every family classified; the forward read (and the decision proven against it) for all of them, or
    for ``read`` seeded ones and ``must_read`` (the bounded CI run)."""
    names = only or families()
    chosen = set(names) if read is None else set(random.Random(seed).sample(names, min(read, len(names))))
    chosen |= set(must_read)
    rows = [classify_family(f, read=f in chosen) for f in names]
    if step:
        fine = [r for r in rows if r.built and not r.refused]
        for r in random.Random(seed).sample(fine, min(step, len(fine))):
            if not r.tiny:
                r.step = "skipped: builds only at its default (large) widths"
                continue
            try:
                r.step = step_family(r.family)
            except Exception as e:  # noqa: BLE001
                r.step = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    return rows


def table(rows: List[Row]) -> str:
    """The census as a markdown table, totals first."""
    built = [r for r in rows if r.built]
    ok = [r for r in built if not r.refused]
    tensors = sum(r.tensors for r in ok)
    kinds = collections.Counter()
    for r in ok:
        kinds.update(r.kinds)
    import transformers

    lines = ["# Census: every transformers model type, classified by ds_muon", "",
             f"`python tools/census.py --step 6 --markdown docs/CENSUS.md` (transformers {transformers.__version__}). "
             "Each model type is built from its config with 2 layers and small widths; every trainable tensor gets "
             "a kind from the README's rules table; `fused split` lists what was split apart; `decided by trace / "
             "by fallback` counts the family's matrices decided from its forward, read on the meta device "
             "(`ds_muon.models.trace`), and those the config/module/name rules decided alone (with why the forward "
             "could not be read); `forward splits / made` counts the Muon matrices whose output the forward splits "
             "into blocks and those ds_muon splits into the same blocks (the proof: equal, and no disagreement "
             "listed); `read (ms)` is what reading the forward took; `step` is one single-process step from random "
             "gradients on a seeded sample.", "",
             f"transformers model types: {len(rows)}; build from a config in code: {len(built)}; classified "
             f"with no unknown kind: {len(ok)}/{len(built)} ({100 * len(ok) / max(1, len(built)):.0f}%), "
             f"{tensors} tensors; with fused projections split: {sum(1 for r in ok if r.fused)}; "
             f"refused by ds_muon: {len(built) - len(ok)}.", "",
             f"Read from the forward (meta device, `ds_muon.models.trace`): {sum(1 for r in ok if not r.trace_error)}"
             f"/{len(ok)} families; matrices decided by the trace: {sum(r.by_trace for r in ok)}, by the fallback "
             f"rules (config, module types, names): {sum(r.by_fallback for r in ok)}; fused splits the forward "
             f"performs: {sum(r.forward_splits for r in ok)}, made by ds_muon alike: {sum(r.splits_made for r in ok)}; "
             f"final layers (read from the autograd graph of one meta forward: the weights whose output reaches "
             f"the model's output with no weight after it): {sum(r.finals for r in ok)}, on AdamW: "
             f"{sum(r.finals_adamw for r in ok)}; disagreements between the traced forward (or the autograd "
             f"graph) and the decision: {sum(len(r.disagreements) for r in ok)}. {_reading_cost(ok)}", "",
             "| kind | tensors |", "| --- | --- |"]
    lines += [f"| {k} | {n} |" for k, n in kinds.most_common()]
    lines += ["", "| family | class | tensors | Muon | kinds | fused split | decided by trace / by fallback | "
              "forward splits / made | read (ms) | step |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.built and not r.refused:
            ks = ", ".join(f"{k} {n}" for k, n in sorted(r.kinds.items()))
            by = f"{r.by_trace} / {r.by_fallback}" + (f" ({r.trace_error.split(':')[0]})" if r.trace_error else "")
            lines.append(f"| {r.family} | {r.cls} | {r.tensors} | {r.muon} | {ks} | {'; '.join(r.fused)} | {by} | "
                         f"{r.forward_splits} / {r.splits_made} | {r.trace_ms:.0f} | {r.step} |")
    dis = [(r.family, d) for r in ok for d in r.disagreements]
    if dis:
        lines += ["", "| family | disagreement |", "| --- | --- |"] + [f"| {f} | {d} |" for f, d in dis]
    lines += ["", "| family | refused or not built: why |", "| --- | --- |"]
    for r in rows:
        if not r.built or r.refused:
            lines.append(f"| {r.family} | {'refused: ' if r.refused else 'does not build: '}{r.error.replace('|', '/')} |")
    return "\n".join(lines)


BEYOND_HEADING = "# Census beyond transformers: diffusers model classes and litgpt configs"


def table_beyond(rows: List[Row]) -> str:
    """The diffusers and litgpt census as markdown: totals per library, then one row per class or config."""
    lines = [BEYOND_HEADING, "",
             "`python tools/census.py --beyond diffusers,litgpt --markdown docs/CENSUS.md` (this section only). "
             "Every model class diffusers exports (enumerated, not listed by hand) is built from its `__init__` "
             "defaults with one layer per stack and, where that builds and its forward runs, small widths (else "
             "its default widths); every litgpt named config is built as `GPT` with 2 layers and, where it builds "
             "and runs, 4 heads of 16 and a 256 vocabulary. No `example_inputs`: the inputs are found from the "
             "forward's signature (`ds_muon.models.inputs`). Columns as above; `final layers on AdamW` counts the "
             "weights whose output reaches the model's output with no weight after it, read from the autograd "
             "graph of one meta forward (independent of the trace), and those of them on AdamW (the proof: equal)."]
    for lib in sorted({r.library for r in rows}):
        mine = [r for r in rows if r.library == lib]
        built = [r for r in mine if r.built]
        ok = [r for r in built if not r.refused]
        traced = [r for r in ok if not r.trace_error]
        version = _version(lib)
        lines += ["", f"{lib} {version}: {len(mine)} {'classes' if lib == 'diffusers' else 'named configs'}; "
                  f"build: {len(built)} ({sum(r.tiny for r in built)} at small widths); classified: {len(ok)}, "
                  f"{sum(r.tensors for r in ok)} tensors; forward read: {len(traced)}/{len(ok)}; matrices decided by "
                  f"the trace: {sum(r.by_trace for r in ok)}, by the fallback rules: {sum(r.by_fallback for r in ok)}; "
                  f"fused splits the forward performs: {sum(r.forward_splits for r in ok)}, made alike: "
                  f"{sum(r.splits_made for r in ok)}; final layers (autograd): {sum(r.finals for r in ok)}, on AdamW: "
                  f"{sum(r.finals_adamw for r in ok)}; disagreements: {sum(len(r.disagreements) for r in ok)}."]
    lines += ["", "| library | class or config | tensors | Muon | kinds | fused split | decided by trace / by fallback | "
              "forward splits / made | final layers on AdamW | read (ms) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.built and not r.refused:
            ks = ", ".join(f"{k} {n}" for k, n in sorted(r.kinds.items()))
            why = r.trace_error.split(':')[0] if r.trace_error else ""
            by = f"{r.by_trace} / {r.by_fallback}" + (f" ({why})" if why else "")
            lines.append(f"| {r.library} | {r.family}{'' if r.tiny else ' (default widths)'} | {r.tensors} | {r.muon} | "
                         f"{ks} | {'; '.join(r.fused)} | {by} | {r.forward_splits} / {r.splits_made} | "
                         f"{r.finals_adamw} / {r.finals} | {r.trace_ms:.0f} |")
    dis = [(r.library, r.family, d) for r in rows for d in r.disagreements]
    if dis:
        lines += ["", "| library | class or config | disagreement |", "| --- | --- | --- |"]
        lines += [f"| {lib} | {f} | {d} |" for lib, f, d in dis]
    unread = [r for r in rows if r.built and not r.refused and r.trace_error]
    if unread:
        lines += ["", "| library | class or config | forward not read: why (decided by the fallback rules) |",
                  "| --- | --- | --- |"]
        lines += [f"| {r.library} | {r.family} | {_unread_why(r).replace('|', '/')} |" for r in unread]
    lines += ["", "| library | class or config | refused or not built: why |", "| --- | --- | --- |"]
    lines += [f"| {r.library} | {r.family} | {'refused: ' if r.refused else 'does not build: '}"
              f"{r.error.replace('|', '/')} |" for r in rows if not r.built or r.refused]
    return "\n".join(lines)


def _unread_why(r: Row) -> str:
    """Why a forward was not read: where no input candidate ran, the first candidate's error (the guess's own
    error says only that it was a guess)."""
    mark = "no candidate from the signature ran: "
    if mark in r.inputs:
        return "inputs not found: " + r.inputs.split(mark, 1)[1].rstrip(")")[:160]
    return r.trace_error


def _version(lib: str) -> str:
    try:
        from importlib.metadata import version

        return version(lib)
    except Exception:  # noqa: BLE001
        return ""


def _reading_cost(ok: List[Row]) -> str:
    ms = sorted(r.trace_ms for r in ok if not r.trace_error)
    if not ms:
        return ""
    slow = max((r for r in ok if not r.trace_error), key=lambda r: r.trace_ms)
    return (f"Reading one forward on the meta device: median {ms[len(ms) // 2]:.0f} ms, 90th percentile "
            f"{ms[int(0.9 * len(ms))]:.0f} ms, slowest {ms[-1]:.0f} ms ({slow.family}).")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--step", type=int, default=0, help="step this many seeded families for real")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--read", type=int, default=None, help="read the forward of this many seeded families "
                    "(default: all)")
    ap.add_argument("--markdown", help="write the table to this file")
    ap.add_argument("--beyond", help="comma-separated libraries beyond transformers (diffusers, litgpt): census "
                    "these only, and write their section of --markdown (the transformers section is kept)")
    ap.add_argument("--sample", type=int, default=None, help="with --beyond: this many seeded classes or configs "
                    "of each library (default: all)")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.beyond:
        rows = census_beyond(args.beyond.split(","), args.only.split(",") if args.only else None, args.seed,
                             args.sample)
        text = table_beyond(rows)
        print(text)
        print(f"\n({time.time() - t0:.0f} s)", file=sys.stderr)
        if args.markdown:
            try:
                with open(args.markdown) as f:
                    old = f.read()
            except FileNotFoundError:
                old = ""
            head = old.split(BEYOND_HEADING)[0].rstrip()
            with open(args.markdown, "w") as f:
                f.write((head + "\n\n" if head else "") + text + "\n")
        return 0
    rows = census(args.only.split(",") if args.only else None, args.step, args.seed, args.read)
    text = table(rows)
    print(text)
    print(f"\n({time.time() - t0:.0f} s)", file=sys.stderr)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
