"""Fused projections: which blocks of one weight are separate linear maps, read from the config.

A fused ``[q | k | v]`` or ``[gate | up]`` weight is several matrices side by side; Muon
orthogonalizes each apart (as Megatron-Core does), unless ``split_fused=False``.  Where the
blocks sit depends on the family (contiguous rows, rows interleaved per head, columns of an
``[in, out]`` weight, columns interleaved), and their sizes come from the config (heads, key/value
heads, head dim, intermediate size).  :data:`READERS` maps a module class name to the reader that
knows its layout; :func:`looks_fused` spots a projection none reads (a Linear in an attention
module whose outputs add up to q + k + v), which raises rather than train as one matrix.

A plan is ``{label: (rows, cols)}`` for :func:`ds_muon.fused_blocks` (runs in the weight as
stored) and whether the weight is stored ``[in, out]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from ..tensors.shape import global_shape
from .tags import expert_weight, fused_blocks, row_axes, split_rows, transposed


@dataclass(frozen=True)
class FusedPlan:
    """The blocks of one fused weight (``{label: (rows, cols)}``, see :func:`ds_muon.fused_blocks`),
    what fused them (``what``: ``"q|k|v"``, ``"gate|up"``, …), ``[in, out]`` storage, per expert, and how many
    leading axes are the matrix's rows (``row_axes``, see :func:`ds_muon.row_axes`)."""

    blocks: Dict[str, tuple]
    what: str
    transposed: bool = False
    experts: bool = False
    row_axes: int = 1


def _get(obj, name):
    """``getattr(obj, name, None)``, also where a config refuses a per-layer field (transformers raises
    its own error there, not AttributeError)."""
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - any refusal means: not known here
        return None


def _heads(module: nn.Module, config) -> Tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of an attention module, from the module or its config."""
    nh = _get(module, "num_heads") or _get(module, "num_attention_heads") or _get(config, "num_attention_heads")
    nkv = _get(module, "num_key_value_heads") or _get(config, "num_key_value_heads") or nh
    hd = _get(module, "head_dim") or _get(config, "head_dim") or _get(config, "hidden_size") // nh
    return int(nh), int(nkv), int(hd)


def _rows(sizes: Sequence[Tuple[str, int]], heads: Optional[Sequence[int]] = None) -> Dict[str, tuple]:
    """Contiguous row blocks ``[a | b | …]``; with ``heads`` (head dim per block), one block per head."""
    out, r = {}, 0
    for i, (label, n) in enumerate(sizes):
        if heads is None:
            out[label] = ((r, n), None)
        else:
            hd = heads[i]
            for h in range(n // hd):
                out[f"{label}{h}"] = ((r + h * hd, hd), None)
        r += n
    return out


def _cols(sizes: Sequence[Tuple[str, int]], heads: Optional[Sequence[int]] = None) -> Dict[str, tuple]:
    """The same as :func:`_rows` for the columns of an ``[in, out]`` weight."""
    return {k: (None, r) for k, (r, _) in _rows(sizes, heads).items()}


def _per_head(per_head: bool, hd: int, n: int):
    return [hd] * n if per_head else None


def contiguous_qkv(module, pname, shape, config, per_head=False) -> FusedPlan:
    """``[q | k | v]`` rows (Phi-3 ``qkv_proj``, DBRX ``Wqkv``; GQA/MQA sizes)."""
    nh, nkv, hd = _heads(module, config)
    sizes = [("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)]
    return FusedPlan(_rows(sizes, _per_head(per_head, hd, 3)), "q|k|v")


def contiguous_kv(module, pname, shape, config, per_head=False) -> FusedPlan:
    """``[k | v]`` rows (JetMoE ``kv_proj``)."""
    n = int(shape[0]) // 2
    hd = getattr(module, "head_dim", n)
    return FusedPlan(_rows([("k", n), ("v", n)], _per_head(per_head, hd, 2)), "k|v")


def interleaved_qkv(module, pname, shape, config, per_head=False) -> FusedPlan:
    """Rows ``[head, (q, k, v), head_dim]`` (GPT-NeoX ``query_key_value``): q is every head's first
    ``head_dim`` rows, so each block is ``heads`` runs ``3·head_dim`` apart."""
    nh, _, hd = _heads(module, config)
    if per_head:
        return FusedPlan({f"{w}{h}": ((h * 3 * hd + j * hd, hd), None) for h in range(nh)
                          for j, w in enumerate("qkv")}, "q|k|v per head")
    return FusedPlan({w: ((j * hd, hd, nh, 3 * hd), None) for j, w in enumerate("qkv")}, "q|k|v interleaved")


def gpt2_c_attn(module, pname, shape, config, per_head=False) -> FusedPlan:
    """GPT-2's ``c_attn`` (``Conv1D``, stored ``[in, out]``): q, k, v are column blocks
    (k, v only in cross-attention, where ``q_attn`` is its own weight)."""
    d = int(module.embed_dim)
    labels = "kv" if getattr(module, "is_cross_attention", False) else "qkv"
    hd = d // int(module.num_heads)
    return FusedPlan(_cols([(w, d) for w in labels], _per_head(per_head, hd, len(labels))),
                     "|".join(labels), transposed=True)


def sized_qkv(module, pname, shape, config, per_head=False) -> FusedPlan:
    """``[q | k | v]`` rows of the sizes the module keeps (``q_dim``/``kv_dim``, or ``embed_dim`` and
    ``kv_dim`` of GPT-BigCode's multi-query attention)."""
    q = int(getattr(module, "q_dim", None) or module.embed_dim)
    kv = int(module.kv_dim)
    hd = int(getattr(module, "head_dim", 0) or 0)
    return FusedPlan(_rows([("q", q), ("k", kv), ("v", kv)], _per_head(per_head and hd > 0, hd, 3)), "q|k|v")


def gpt_bigcode_c_attn(module, pname, shape, config, per_head=False) -> FusedPlan:
    """GPT-BigCode: multi-query ``[q | k | v]`` rows, else rows interleaved per head."""
    if getattr(module, "is_cross_attention", False):
        raise NotImplementedError("GPT-BigCode cross-attention c_attn")
    if module.multi_query:
        return sized_qkv(module, pname, shape, config, per_head)
    return interleaved_qkv(module, pname, shape, config, per_head)


def codegen_qkv(module, pname, shape, config, per_head=False) -> FusedPlan:
    """CodeGen's ``qkv_proj``: ``mp_num`` groups of rows, each ``[q | v | k]`` of ``embed_dim / mp_num``."""
    mp, local = int(module.mp_num), int(module.embed_dim) // int(module.mp_num)
    return FusedPlan({w: ((j * local, local, mp, 3 * local), None) for j, w in enumerate("qvk")},
                     "q|v|k per mp group")


def conv1d_split_size(module, pname, shape, config, per_head=False) -> FusedPlan:
    """GPT-2-style ``c_attn`` (``Conv1D``, ``[in, out]``) split by the module's ``split_size``: column blocks."""
    n = int(module.split_size)
    labels = "qkv" if int(shape[1]) == 3 * n else "kv"
    heads = int(getattr(module, "num_heads", 0) or getattr(module, "n_head", 0) or 0)
    return FusedPlan(_cols([(w, n) for w in labels], _per_head(per_head and heads > 0, n // max(heads, 1),
                                                               len(labels))), "|".join(labels), transposed=True)


def contiguous_gate_up(module, pname, shape, config, per_head=False) -> FusedPlan:
    """``[gate | up]`` rows of a fused MLP (Phi-3 ``gate_up_proj``; JetMoE's expert stack ``input_linear``)."""
    experts = len(shape) == 3
    n = int(shape[1 if experts else 0]) // 2
    return FusedPlan(_rows([("gate", n), ("up", n)]), "gate|up", experts=experts)


def interleaved_gate_up(module, pname, shape, config, per_head=False) -> FusedPlan:
    """gpt-oss experts ``gate_up_proj`` ``[E, in, 2·ff]``: gate and up are the even and odd columns."""
    ff = int(shape[-1]) // 2
    return FusedPlan({"gate": (None, (0, 1, ff, 2)), "up": (None, (1, 1, ff, 2))}, "gate|up interleaved",
                     transposed=True, experts=True)


def experts_gate_up(module, pname, shape, config, per_head=False) -> FusedPlan:
    """A transformers experts ``gate_up_proj`` read from the flags ``@use_experts_implementation`` sets:
    stored ``[E, in, 2·ff]`` (``is_transposed``: gate and up are columns) or ``[E, 2·ff, in]``, the
    halves concatenated or interleaved (``is_concatenated=False``, gpt-oss: even and odd)."""
    stored_in_out, concatenated = bool(module.is_transposed), bool(module.is_concatenated)
    ff = int(shape[2] if stored_in_out else shape[1]) // 2
    runs = {"gate": (0, ff), "up": (ff, ff)} if concatenated else {"gate": (0, 1, ff, 2), "up": (1, 1, ff, 2)}
    blocks = {k: ((None, r) if stored_in_out else (r, None)) for k, r in runs.items()}
    return FusedPlan(blocks, "gate|up" + ("" if concatenated else " interleaved"), transposed=stored_in_out,
                     experts=True)


def dbrx_experts(module, pname, shape, config, per_head=False) -> FusedPlan:
    """DBRX keeps every expert in one 2-D weight ``[E·ff, d]``: expert ``e`` is rows
    ``[e·ff, (e+1)·ff)``; ``w1``/``v1`` are applied as ``x @ w.T`` (``[out, in]``), ``w2`` as
    ``x @ w`` (``[in, out]``)."""
    ff = int(module.ffn_hidden_size)
    n = int(shape[0]) // ff
    return FusedPlan(_rows([(str(e), ff) for e in range(n)]), "experts", transposed=pname == "w2")


def expert_stack(module, pname, shape, config, per_head=False) -> FusedPlan:
    """A stack ``[E, out, in]`` of expert weights on a module of its own (JetMoE's
    ``JetMoeParallelExperts``): one matrix per expert, no blocks."""
    return FusedPlan({}, "experts", experts=True)


def mha_in_proj(module, pname, shape, config, per_head=False) -> FusedPlan:
    """``nn.MultiheadAttention.in_proj_weight``: ``[q | k | v]`` rows of ``embed_dim`` each."""
    e, h = int(module.embed_dim), int(module.num_heads)
    return FusedPlan(_rows([(w, e) for w in "qkv"], _per_head(per_head, e // h, 3)), "q|k|v")


Reader = Callable[..., FusedPlan]
# module class name -> {parameter name: reader}: the families whose fused layout is known
READERS: Dict[str, Dict[str, Reader]] = {
    "MultiheadAttention": {"in_proj_weight": mha_in_proj},
    "Phi3Attention": {"qkv_proj.weight": contiguous_qkv},
    "Phi3MLP": {"gate_up_proj.weight": contiguous_gate_up},
    "GPTNeoXAttention": {"query_key_value.weight": interleaved_qkv},
    "BloomAttention": {"query_key_value.weight": interleaved_qkv},  # view(b, s, heads, 3, head_dim)
    "PersimmonAttention": {"query_key_value.weight": interleaved_qkv},
    "MptAttention": {"Wqkv.weight": contiguous_qkv},  # chunk(3)
    "Phi4MultimodalAttention": {"qkv_proj.weight": contiguous_qkv},
    "GPTBigCodeAttention": {"c_attn.weight": gpt_bigcode_c_attn},
    "CodeGenAttention": {"qkv_proj.weight": codegen_qkv},
    "BarkSelfAttention": {"att_proj.weight": lambda *a, **k: _qkv_from_shape_contiguous(*a, **k)},
    "DisentangledSelfAttention": {"in_proj.weight": interleaved_qkv},  # DeBERTa: [head, (q, k, v), head_dim]
    "Exaone4_5_VisionAttention": {"qkv.weight": sized_qkv},
    "Attention": {"c_attn.weight": conv1d_split_size},  # OpenAI GPT
    "ImageGPTAttention": {"c_attn.weight": conv1d_split_size},
    "DecisionTransformerGPT2Attention": {"c_attn.weight": conv1d_split_size},
    "ModernBertAttention": {"Wqkv.weight": contiguous_qkv},  # view(…, 3, heads, head_dim)
    "GPT2Attention": {"c_attn.weight": gpt2_c_attn},
    "DbrxAttention": {"Wqkv.weight": contiguous_qkv},
    "DbrxExpertGLU": {"w1": dbrx_experts, "v1": dbrx_experts, "w2": dbrx_experts},
    "JetMoeAttention": {"kv_proj.weight": contiguous_kv},
    "JetMoeMoE": {"input_linear.weight": contiguous_gate_up},
    "JetMoeParallelExperts": {"weight": expert_stack},
}


def reader_for(owner: nn.Module, path: str) -> Optional[Reader]:
    """The reader of parameter ``path`` (relative to ``owner``, e.g. ``"qkv_proj.weight"``)."""
    return READERS.get(type(owner).__name__, {}).get(path)


SEPARATE = ("q_proj", "k_proj", "v_proj", "query", "key", "value", "q", "k", "v", "wq", "wk", "wv", "linear",
            "sampling_offsets", "attention_weights", "value_proj", "output_proj",  # deformable attention
            "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # MLA (DeepSeek-V3: q_b_proj's outputs can
# equal (heads + 2·kv heads)·head_dim, e.g. 128·192 = (128 + 256)·64, and are one linear map)
_CONTIGUOUS = re.compile(r"\b3\s*,\s*(?:self\.)?num_(?:attention_)?heads|\b3\s*,\s*(?:self\.)?n_heads|"
                         r"\bqkv\b[^\n]*\.chunk\(\s*3|\.unbind\(\s*(?:dim\s*=\s*)?[02]\s*\)")
_INTERLEAVED = re.compile(r"num_(?:attention_)?heads\s*,\s*3\b|3\s*\*\s*self\.head_dim")


def from_forward(owner: nn.Module, child_name: str) -> Optional[Reader]:
    """A reader for a fused q|k|v Linear of an attention module no entry of :data:`READERS` knows, from
    how the module's own ``forward`` splits the output: ``reshape(…, 3, num_heads, head_dim)`` (or a
    ``chunk(3)``) is contiguous ``[q | k | v]``, ``view(…, num_heads, 3, head_dim)`` interleaved per head.
    None when the code says neither or both (the caller raises)."""
    import inspect

    try:
        src = inspect.getsource(type(owner).forward)
    except (OSError, TypeError):
        return None
    if f"self.{child_name}(" not in src and f"self.{child_name}," not in src:
        return None
    contiguous, interleaved = bool(_CONTIGUOUS.search(src)), bool(_INTERLEAVED.search(src))
    if contiguous == interleaved:
        return None
    return _qkv_from_shape_contiguous if contiguous else interleaved_qkv


def _qkv_from_shape_contiguous(module, pname, shape, config, per_head=False) -> FusedPlan:
    """``[q | k | v]`` rows of equal thirds (vision attention ``qkv``: heads and widths are the module's)."""
    n = int(shape[0]) // 3
    hd = getattr(module, "head_dim", None)
    return FusedPlan(_rows([(w, n) for w in "qkv"], _per_head(per_head and bool(hd), int(hd or n), 3)),
                     "q|k|v (read from forward)")


def looks_fused(module: nn.Module, child: nn.Module, config, child_name: str = "") -> Optional[str]:
    """``"q|k|v"``/``"k|v"`` when ``child`` (a Linear of attention ``module``) outputs what several
    projections would, by the config's sizes; None otherwise."""
    if config is None or getattr(child, "weight", None) is None or child_name in SEPARATE:
        return None
    try:
        nh, nkv, hd = _heads(module, config)
    except (AttributeError, TypeError, ZeroDivisionError):
        return None
    out = getattr(child, "out_features", None) or getattr(child, "nf", None)
    if out is None:
        return None
    if out in {(nh + 2 * nkv) * hd, 3 * nh * hd}:
        return "q|k|v"
    if out == 2 * nkv * hd and not hasattr(module, "kv_proj"):
        return None
    return None


def apply_fused_plan(p: torch.Tensor, plan: FusedPlan, name: str = "") -> torch.Tensor:
    """Tag ``p`` as ``plan`` says: contiguous row blocks as :func:`ds_muon.split_rows`, any other
    blocks (columns, interleaved) as :func:`ds_muon.fused_blocks`."""
    try:
        if plan.experts:
            expert_weight(p)
        if plan.row_axes != 1:
            row_axes(p, plan.row_axes)
        if plan.transposed:
            transposed(p)
        rows_only = all(c is None and r is not None and len(r) == 2 for r, c in plan.blocks.values())
        if not plan.blocks:
            pass  # one matrix per expert
        elif rows_only and not plan.transposed:
            split_rows(p, {k: r[1] for k, (r, _) in plan.blocks.items()})
        else:
            fused_blocks(p, plan.blocks)
    except ValueError as e:
        raise ValueError(f"muon_param_groups: {name} {tuple(global_shape(p))}: the config's sizes do not fit "
                         f"its {plan.what} blocks ({e}); pass split_fused=False, or tag it yourself") from None
    return p
