"""Overlap (``Muon(..., overlap=True, model=model)``): the step's communication hidden
behind the training loop, always bitwise equal to ``overlap=False``.

* waves (:func:`ds_muon.engine.plan.compile.split_waves`): each layout's exchange is cut into runs
  of about equal NS work, so NS of one wave runs while the next travels;
* gathers sent from backward (:mod:`.backward`), where a parameter's gradient is
  final when its hook fires (FSDP2, one process);
* (opt-in, ``apply_in_forward=True``) updates applied in the next forward
  (:mod:`.forward`), just before a module needs its parameters.

Without ``apply_in_forward`` every update has landed when ``step()`` returns: no
stack lets ds_muon see every read of a parameter (FSDP2 and FSDP1 keep the sharded
parameter on the module between forwards, where ``parameters()``, ``state_dict()``,
EMA, norms and ``torch.save`` read it directly), so a deferred update would be
visible.  :class:`OverlapSettings` is the one object that says which of these run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from torch import nn

from .backward import BackwardDispatch, Wave
from .forward import DeferredApply
from .units import hook_owner

__all__ = ["OverlapSettings", "BackwardDispatch", "DeferredApply", "Wave", "hook_owner"]


@dataclass(frozen=True)
class OverlapSettings:
    """``enabled``: waves (and, with a model, gathers from backward); ``waves``: how many
    per exchange; ``dispatch_in_backward``: gathers may leave from backward;
    ``apply_in_forward``: updates may wait for the next forward (opt-in, see
    :class:`~ds_muon.engine.overlap.forward.DeferredApply` for what then sees them)."""

    enabled: bool = False
    waves: int = 4
    dispatch_in_backward: bool = True
    apply_in_forward: bool = False

    def __post_init__(self):
        if not isinstance(self.waves, int) or self.waves < 1:
            raise ValueError(f"waves must be an integer >= 1, got {self.waves!r}")
        if not isinstance(self.apply_in_forward, bool):
            raise TypeError(f"apply_in_forward must be True or False, got {self.apply_in_forward!r}")
        if self.apply_in_forward and not self.enabled:
            raise ValueError("apply_in_forward=True defers the updates of overlap's waves: pass overlap=True too")

    @property
    def wave_count(self) -> int:
        """Waves per exchange: one without overlap."""
        return self.waves if self.enabled else 1

    def hooks(self, model: Optional[nn.Module], inputs: Callable, hyper: Callable,
              before: Callable) -> Tuple[Optional[DeferredApply], Optional[BackwardDispatch]]:
        """The deferred-apply and backward-dispatch hooks these settings call for on ``model``
        (None where off; both need the model).  See :class:`BackwardDispatch` for the callables."""
        if not self.enabled or model is None:
            return None, None
        deferred = DeferredApply(model) if self.apply_in_forward else None
        dispatch = BackwardDispatch(inputs, hyper, before) if self.dispatch_in_backward else None
        return deferred, dispatch
