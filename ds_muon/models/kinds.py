"""The closed list of kinds a tensor can be, the optimizer each takes, and :class:`Decision`.

:mod:`.decide` gives every tensor one of these (the README's rules table lists them); the summary and the
census count them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from .fused import FusedPlan

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
