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
"""

from __future__ import annotations

from typing import Tuple

import torch


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
