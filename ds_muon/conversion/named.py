"""The neutral form every checkpoint format is read into: weights and per-tensor optimizer state by name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

import torch

MUON_KEYS = ("momentum_buffer",)
NORMUON_V = "normuon_v"  # NorMuon's second moment, carried where the source has it (ds_muon.engine.exchange.row_moments)
ADAMW_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class Named:
    """Weights and per-tensor optimizer state keyed by the tensor's name in the model."""

    weights: Dict[str, torch.Tensor] = field(default_factory=dict)
    state: Dict[str, Dict[str, Any]] = field(default_factory=dict)
