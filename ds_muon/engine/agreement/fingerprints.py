"""Fingerprints the agreement compares between ranks: 16-bit hashes of each gradient's (min, max)
and of everything that must be equal on every rank (:func:`settings_of`), and, when the settings
differ, the first one that does (:func:`first_difference`, for the error).
"""

from __future__ import annotations

import zlib
from typing import Any, Dict, List

import torch

from ...rules import ns_auto, ns_kernels
from .identity import identity_of

HASH_MOD = 65521  # a prime below 2**16: h² summed over 2**15 ranks fits in int64


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


def _plain(v: Any) -> Any:
    if torch.is_tensor(v):
        return v.item() if v.numel() == 1 else tuple(v.flatten().tolist())
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return v


def settings_of(optimizer) -> Dict[str, Any]:
    """Everything that must be equal on every rank, as plain values (names for the error)."""
    out: Dict[str, Any] = {STEPPED: identity_of(optimizer)}  # which optimizer this is (several in one job)
    for k in ("mode", "planner", "team_ns", "waves", "comm_dtype", "nonfinite", "adam_betas", "adam_eps"):
        out[k] = _plain(getattr(optimizer, k, None))
    # the rates the planner uses (CostModel.for_device when none was given): a rank whose NS device
    # type differs would plan other homes, so it must fail here, not in the exchange
    out["cost_model"] = repr(optimizer.planning_cost_model())
    # the NS kernel forms this process runs (ns_kernels: pinned, calibrated or the device family's
    # table): duplicated homes must compute the same bits everywhere
    out["ns_kernels"] = ns_kernels.fingerprint()
    out["overlap"] = bool(getattr(optimizer, "overlap", False))
    out["apply_in_forward"] = optimizer.runtime.deferred is not None
    out["dispatch_in_backward"] = optimizer.runtime.dispatch is not None
    clip = getattr(optimizer, "qk_clip", None)  # QK-clip (tau, alpha): every rank must clip alike
    out["qk_clip"] = None if clip is None else _plain(clip.settings())
    for gi, g in enumerate(optimizer.param_groups):
        for k, v in g.items():
            if k not in ("params", "param_names", "param_tags"):
                out[f"param_groups[{gi}][{k!r}]"] = _plain(v)
        if g.get("use_muon", True):  # what "auto" became on this machine (ns_auto): ranks must run alike
            for k, v in ns_auto.resolved(g).items():
                out[f"param_groups[{gi}][{k!r}] {AUTO_SUFFIX}"] = v
    return out


AUTO_SUFFIX = "(auto, resolved)"


STEPPED = "optimizer"


def settings_hash(settings: Dict[str, Any]) -> int:
    return text_hash(repr(sorted((k, repr(v)) for k, v in settings.items())))


def first_difference(everyone: List[Dict[str, Any]]) -> str:
    """Name the first setting that differs between ranks, with each rank's value."""
    keys = sorted({k for s in everyone for k in s})
    for k in keys:
        values = [s.get(k, "<missing>") for s in everyone]
        if any(v != values[0] for v in values[1:]):
            hint = (" (the NS kernel forms: call ds_muon.rules.ns_kernels.pin() alike on every rank, or calibrate() on "
                    "every rank, which adopts rank 0's choices)") if k == "ns_kernels" else ""
            if k.endswith(AUTO_SUFFIX):
                setting = "ns_method" if "'ns_method'" in k else "ns_dtype"
                hint = (f" ({setting}='auto' chose differently on these ranks: their machines differ, and a different "
                        f"NS would break bitwise agreement; pass an explicit {setting} (e.g. ns_dtype='float32' and "
                        "ns_method='standard') to Muon, or in the DsMuon config's params, the same on every rank. "
                        f"This rank: {ns_auto.choice(ns_auto.ns_device_type()).describe()})")
            return f"{k} is " + ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values)) + hint
    return "the settings hash differs, but no single setting does (a hash collision)"
