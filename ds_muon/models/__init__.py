"""What each tensor of a model is (:mod:`.kinds`), read from its modules (:mod:`.kinds`), its config
(:mod:`.config`) and the layout of its fused projections (:mod:`.fused`)."""

from .kinds import KINDS, MUON_KINDS, Decision, Rules, classify

__all__ = ["KINDS", "MUON_KINDS", "Decision", "Rules", "classify"]
