"""Fingerprints that ride in the step's one agreement all_reduce.

The step already all-reduces a small int64 table (a row per tensor: has a
gradient, has none, non-finite).  Two more checks need no collective of their own:

* **replicas stay replicas** — a tensor every rank holds whole (no wrapper, DDP,
  DeepSpeed stage 0) must get the same gradient on every rank; a model that was
  never wrapped (or whose wrapper was bypassed) trains each rank on its own data,
  and Muon's scattered results would hide the drift of everything else;
* **settings agree** — NS steps, dtypes, planner, learning rates … must be equal
  on every rank, or the exchange sizes or the updates differ.

Each rank contributes, per row, ``(1, h, h²)`` for a 16-bit hash ``h``; after the
sum, all contributions were equal exactly when ``n·Σh² == (Σh)²`` (equality in
Cauchy–Schwarz), in exact integer arithmetic for up to 2¹⁵ ranks.
"""

from __future__ import annotations

import zlib
from typing import Any, Dict, List, Sequence

import torch

HASH_MOD = 65521  # a prime below 2**16: h² summed over 2**15 ranks fits in int64

# columns of the agreement table
HAS_GRAD, NO_GRAD, NONFINITE, N_HASHED, HASH, HASH_SQ = range(6)
COLUMNS = 6


def minmax_hash(minmax: torch.Tensor) -> torch.Tensor:
    """A 16-bit hash of each row's (min, max) bit patterns, on the tensors' device.

    ``minmax`` is ``[n, 2]`` (any float dtype); returns int64 ``[n]``.  Equal
    gradients give equal hashes; a gradient computed from other data changes its
    extremes, and so the hash, with overwhelming probability.
    """
    bits = minmax.float().view(torch.int32).to(torch.int64)
    return torch.remainder(bits[:, 0] * 1000003 + bits[:, 1], HASH_MOD)


def text_hash(text: str) -> int:
    return zlib.crc32(text.encode()) % HASH_MOD


def hashed_row(h: int) -> List[int]:
    row = [0] * COLUMNS
    row[N_HASHED], row[HASH], row[HASH_SQ] = 1, h, h * h
    return row


def hashes_differ(row: Sequence[int]) -> bool:
    """After the sum: did the ranks that hashed this row hash it differently?"""
    n, s, q = row[N_HASHED], row[HASH], row[HASH_SQ]
    return n > 1 and n * q != s * s


def _plain(v: Any) -> Any:
    if torch.is_tensor(v):
        return v.item() if v.numel() == 1 else tuple(v.flatten().tolist())
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return v


def settings_of(optimizer) -> Dict[str, Any]:
    """Everything that must be equal on every rank, as plain values (names for the error)."""
    out: Dict[str, Any] = {}
    for k in ("mode", "planner", "waves", "comm_dtype", "nonfinite", "adam_betas", "adam_eps"):
        out[k] = _plain(getattr(optimizer, k, None))
    out["cost_model"] = repr(getattr(optimizer, "cost_model", None))
    out["overlap"] = getattr(optimizer, "_deferred", None) is not None
    out["dispatch_in_backward"] = getattr(optimizer, "_dispatch", None) is not None
    for gi, g in enumerate(optimizer.param_groups):
        for k, v in g.items():
            if k not in ("params", "param_names", "param_tags"):
                out[f"param_groups[{gi}][{k!r}]"] = _plain(v)
    return out


def settings_hash(settings: Dict[str, Any]) -> int:
    return text_hash(repr(sorted((k, repr(v)) for k, v in settings.items())))


def first_difference(everyone: List[Dict[str, Any]]) -> str:
    """Name the first setting that differs between ranks, with each rank's value."""
    keys = sorted({k for s in everyone for k in s})
    for k in keys:
        values = [s.get(k, "<missing>") for s in everyone]
        if any(v != values[0] for v in values[1:]):
            return f"{k} is " + ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values))
    return "the settings hash differs, but no single setting does (a hash collision)"
