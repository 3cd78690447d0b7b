"""QK-clip (MuonClip, Kimi K2, arXiv 2507.20534): the maths, as pure functions of tensors.

After a step, a head ``h`` whose largest pre-softmax logit over the step's batches, ``S_max^h``, exceeded
``tau`` has its query and key weights scaled so the logit falls back to ``tau``:
``gamma_h = min(1, tau / S_max^h)``, the query rows of head ``h`` by ``gamma_h ** alpha`` and its key rows
by ``gamma_h ** (1 - alpha)``.  Scaling the *weights* (the rows that make the head's q and k) scales the
head's logits by ``gamma_h`` exactly, since ``q_h . k_h`` is bilinear in them (rotary embeddings rotate
pairs of rows, which commutes with a per-head scale).

Grouped-query attention (a key head serves ``nq / nkv`` query heads): the key rows of kv head ``g`` are
scaled by ``(min over its query heads h of gamma_h) ** (1 - alpha)`` and each query head's rows by
``gamma_h ** alpha``, so no weight is ever scaled up and every head ends at or below ``tau``
(a head below ``tau`` that shares its kv head with a clipped one shrinks by at most
``gamma_min ** (1 - alpha)``).  With ``nkv == nq`` it is the paper's formula.

MLA (DeepSeek-V3 / Kimi K2): the head-specific parts are scaled as the paper says
(:func:`mla_row_factors`): ``q_C`` and ``k_C`` (the non-rotary parts) by ``gamma ** alpha`` and
``gamma ** (1 - alpha)``, the head-specific rotary query ``q_R`` by ``gamma``, the shared rotary key
``k_R`` not at all.

Which output features of a weight are which head's: a :class:`Projection` (separate ``q_proj``/``k_proj``,
a fused ``q|k|v`` projection's runs, :func:`fused_heads`; MLA's up-projections), and from it and the heads'
``gamma`` the factor of every output feature (:func:`out_factors`) and of every stored element
(:func:`piece_factors`).  Finding the projections in a model and the rows on each rank is the face's
(:mod:`ds_muon.qk_clip`) and the engine's (:mod:`ds_muon.engine.exchange.row_scale`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch


@dataclass
class Projection:
    """One weight that makes q and/or k of an attention module: which output features belong to which head."""

    name: str  # clean parameter name
    module: str  # the attention module's (recorder's) name
    kind: str  # "q", "k", "qkv" (fused), "mla_q", "mla_kv"
    out_features: int
    transposed: bool  # stored [in, out]
    heads: Dict[str, Tuple[int, int]]  # fused: label ("q3", "k1") -> (first output feature, count)
    bias: Optional[str] = None  # clean name of its bias (one element per output feature), if it has one


def clip_gammas(s_max: torch.Tensor, tau: float) -> torch.Tensor:
    """``gamma_h = min(1, tau / S_max^h)`` per head (fp32); 1 where the head stayed at or below ``tau``,
    saw no logit (``-inf``) or a non-finite one (NaN: nothing sound to clip to)."""
    s = s_max.detach().to(torch.float32)
    over = torch.isfinite(s) & (s > tau)
    safe = torch.where(over, s, torch.ones_like(s))
    return torch.where(over, torch.full_like(s, float(tau)) / safe, torch.ones_like(s))


def head_scales(gammas: torch.Tensor, num_kv_heads: int, alpha: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(query-head scales ``[nq]``, key-head scales ``[nkv]``) from each query head's ``gamma``.

    Query heads are grouped in order (heads ``g·r .. g·r + r - 1`` use kv head ``g``, ``r = nq / nkv``), as
    transformers' ``repeat_kv`` does.  A kv head's scale is its group's smallest gamma to ``1 - alpha``."""
    nq = int(gammas.numel())
    if num_kv_heads <= 0 or nq % num_kv_heads:
        raise ValueError(f"ds_muon: QK-clip: {nq} query heads do not group into {num_kv_heads} key/value heads")
    g = gammas.to(torch.float32)
    kv_min = g.view(num_kv_heads, nq // num_kv_heads).amin(dim=1)
    return g.pow(alpha), kv_min.pow(1.0 - alpha)


def row_factors(scales: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A factor per output row of a projection laid out ``[head, head_dim]`` (q_proj, k_proj)."""
    return scales.to(torch.float32).repeat_interleave(int(head_dim))


def mla_row_factors(gammas: torch.Tensor, alpha: float, nope_dim: int, rope_dim: int,
                    v_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """MLA, as the paper scales it: (factors of the query up-projection's rows, laid out
    ``[head, (nope | rope)]``; factors of ``kv_b_proj``'s rows, laid out ``[head, (k nope | v)]``).
    ``q_C`` by ``gamma ** alpha``, ``q_R`` by ``gamma``, ``k_C`` by ``gamma ** (1 - alpha)``, v and the
    shared ``k_R`` (another projection) untouched."""
    g = gammas.to(torch.float32)
    nh = int(g.numel())
    q = torch.cat([g.pow(alpha)[:, None].expand(nh, nope_dim), g[:, None].expand(nh, rope_dim)], dim=1)
    kv = torch.cat([g.pow(1.0 - alpha)[:, None].expand(nh, nope_dim), torch.ones(nh, v_dim)], dim=1)
    return q.reshape(-1), kv.reshape(-1)


def piece_factors(out_factors: torch.Tensor, positions: torch.Tensor, cols: int, transposed: bool) -> torch.Tensor:
    """The factor of each element at ``positions`` (indices into a stored tensor's row-major flattening,
    ``cols`` columns): its output feature's, which is the row (``[out, in]`` storage) or the column
    (``[in, out]``, GPT-2's Conv1D)."""
    feature = positions % cols if transposed else torch.div(positions, cols, rounding_mode="floor")
    return out_factors[feature]


def fused_heads(blocks: Mapping[str, tuple], transposed: bool, where: str, path: str) -> Dict[str, Tuple[int, int]]:
    """A fused ``q|k|v`` projection's q and k heads, ``label -> (first output feature, count)``, from its
    reader's blocks (``label -> (row run, column run)``; the output features are the rows, or the columns of
    a weight stored ``[in, out]``).  Every block must be one run of output features."""
    heads = {}
    for label, (rows, cols) in blocks.items():
        run = cols if transposed else rows
        if run is None or len(run) != 2:
            raise NotImplementedError(f"ds_muon: QKClip: {where}: the {label} block of {path} is not "
                                      "a run of output features; its layout is not supported")
        if label[0] in "qk":
            heads[label] = (int(run[0]), int(run[1]))
    return heads


def out_factors(p: Projection, gammas: torch.Tensor, alpha: float, num_kv_heads: int, head_dim: int,
                mla_dims: Optional[Tuple[int, int, int]] = None) -> torch.Tensor:
    """The factor of each of ``p``'s output features (fp32) from its module's per-head ``gammas``: the GQA
    policy (:func:`head_scales`) over ``[head, head_dim]`` rows or a fused projection's head runs (features of
    no q/k head, v's, keep 1); MLA (``mla_dims``: nope, rope and v head dims) as :func:`mla_row_factors`."""
    if p.kind in ("mla_q", "mla_kv"):
        q, kv = mla_row_factors(gammas, alpha, *mla_dims)
        return q if p.kind == "mla_q" else kv
    q_scale, k_scale = head_scales(gammas, num_kv_heads, alpha)
    if p.kind == "q":
        return row_factors(q_scale, head_dim)
    if p.kind == "k":
        return row_factors(k_scale, head_dim)
    out = torch.ones(p.out_features, dtype=torch.float32)
    for label, (start, n) in p.heads.items():
        out[start:start + n] = (q_scale if label[0] == "q" else k_scale)[int(label[1:])]
    return out


def stored_columns(shape: Sequence[int], p: Projection, name: str) -> int:
    """The columns of ``p``'s stored tensor of global ``shape`` (its row-major flattening's row length),
    after checking that its output features (rows, or columns stored ``[in, out]``) are the head layout's."""
    want = shape[1] if p.transposed else shape[0]
    if int(want) != p.out_features:
        raise ValueError(f"ds_muon: QKClip: {name} has {want} output features; the head layout of "
                         f"{p.module} says {p.out_features}")
    return int(math.prod(shape[1:]))
