"""Optimizer state for every tensor at once, so every rank holds the same keys (DCP needs it).

Muon tensors get a ``momentum_buffer`` (laid out like the parameter: :func:`relaid_like`), NorMuon's
``normuon_v`` where their group asks, and the AdamW keys of a mixed flat shard (FSDP1); AdamW tensors
get ``step``, ``exp_avg`` and ``exp_avg_sq``.  FSDP1 ``use_orig_params=True`` views also hold the other
kind's keys as :func:`placeholder_like` zeros (its optim_state_dict gathers each key over a FlatParameter).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .exchange.layout import ParamBinding, local_shard
from .exchange.row_moments import KEY as NORMUON_V, is_normuon, new_moment


def fill_state(param_groups: List[dict], state: dict, bindings: Dict[int, ParamBinding], settled: set) -> None:
    """Add every missing state key.  ``settled``: ids of Muon tensors that need nothing but a momentum
    buffer (no AdamW slices), skipped next time; filled in here."""
    for g in param_groups:
        muon = g["use_muon"]
        for p in g["params"]:
            st = state[p]
            if muon:
                if NORMUON_V not in st and is_normuon(g) and id(p) in bindings:  # whole, every rank
                    st[NORMUON_V] = new_moment(bindings[id(p)], p)
                buf = st.get("momentum_buffer")
                if buf is None:
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif buf.stride() != p.stride():  # loaded from a differently laid-out model
                    st["momentum_buffer"] = relaid_like(buf, p, bindings.get(id(p)))
                if id(p) in settled or "exp_avg" in st:
                    continue
                b = bindings.get(id(p))
                if b is not None and b.has_adam:  # mixed flat parameter (FSDP1), on every rank
                    _adamw_state(st, p)
                elif fsdp1_view(p):
                    st["exp_avg"], st["exp_avg_sq"] = placeholder_like(p), placeholder_like(p)
                elif b is not None:
                    settled.add(id(p))
            elif "exp_avg" not in st:
                _adamw_state(st, p)
                if fsdp1_view(p):
                    st["momentum_buffer"] = placeholder_like(p)


def _adamw_state(st: dict, p: torch.Tensor) -> None:
    st["step"] = torch.tensor(0.0, dtype=torch.float32)
    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def fsdp1_view(p: torch.Tensor) -> bool:
    """An original parameter FSDP1 (use_orig_params=True) flattened into a FlatParameter."""
    return getattr(p, "_fsdp_flattened", False) and not hasattr(p, "_fqns")


def relaid_like(buf: torch.Tensor, p: torch.Tensor, binding: Optional[ParamBinding]) -> torch.Tensor:
    """``buf`` copied into ``p``'s memory layout (a channels_last weight's momentum saved
    from a contiguous model), so the binding's flat view of it is a view: the momentum
    update is written through it and must land in the state."""
    if buf.shape != p.shape or local_shard(p) is not p or binding is not None and binding.copied:
        return buf  # (a tensor with no flat view keeps a contiguous buffer: see ParamBinding.copied)
    out = torch.empty_like(p, dtype=buf.dtype, memory_format=torch.preserve_format).copy_(buf)
    if binding is not None:
        assert binding.flat(out).data_ptr() == out.data_ptr() and binding.flat(out)._base is not None, \
            "ds_muon: a momentum buffer laid out like its parameter must flatten to a view"
    return out


def placeholder_like(p: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``p`` that take no memory (stride 0), for state keys a tensor never uses.

    FSDP1's optim_state_dict (use_orig_params=True) gathers each state key over all
    tensors of a FlatParameter, so Muon and AdamW tensors sharing one must hold the
    same keys (momentum_buffer, exp_avg, exp_avg_sq)."""
    return torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)


def state_key(param_groups: List[dict], state: dict) -> tuple:
    """What :func:`fill_state` depends on: the state dict (``load_state_dict`` replaces it), its size and
    the tensors of every group (with their kind); while it stays, nothing can be missing."""
    return (id(state), len(state),
            tuple((g["use_muon"], is_normuon(g), tuple(map(id, g["params"]))) for g in param_groups))
