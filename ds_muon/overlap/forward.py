"""Updates applied in the next forward: results land while it runs.

With ``Muon(..., overlap=True, model=model)`` the step issues every wave's
exchange and runs NS as waves arrive, but does not wait for the last scatters:
each wave's update is applied by a forward pre-hook of the module that uses its
parameters, just before they are needed (for FSDP, before the unit all-gathers
its shards).  Anything still pending is applied at the next ``step()``,
``flush()``, ``state_dict()``, or when the model's ``state_dict()`` is taken, so
nothing ever reads a stale parameter through those paths.  Waiting needs no new
collective — every exchange was issued in ``step()`` in the same order on every
rank — so a rank that never runs some module's forward cannot deadlock the others.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch
from torch import nn

from .units import hook_owner


class DeferredApply:
    """Pending wave applications and the hooks that run them."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._pending: List[tuple] = []  # (param ids, apply callable)
        self._owner: Dict[int, nn.Module] = {}
        self._hooked: Dict[int, object] = {}
        self._state_hook = model.register_state_dict_pre_hook(lambda *a, **k: self.flush())

    def add(self, param_ids: List[int], apply: Callable[[], None], params: List[torch.Tensor]) -> None:
        self._pending.append((set(param_ids), apply))
        self._owner = self._owner or hook_owner(self.model)
        for p in params:
            mod = self._owner.get(id(p))
            if mod is None:
                # a tensor the model does not own (swapped by a stack): nothing would apply it in time
                self.flush()
                return
            if id(mod) not in self._hooked:
                self._hooked[id(mod)] = mod.register_forward_pre_hook(self._pre_forward(mod), prepend=True)

    def _pre_forward(self, mod: nn.Module):
        ids = {id(p) for p, m in ((p, self._owner.get(id(p))) for p in mod.parameters()) if m is mod}

        def hook(module, args):
            self.apply_for(ids)

        return hook

    def apply_for(self, param_ids) -> None:
        """Apply (in dispatch order) every pending wave that touches these parameters."""
        keep = []
        for entry in self._pending:
            if entry[0] & param_ids:
                entry[1]()
            else:
                keep.append(entry)
        self._pending = keep

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for _, apply in pending:
            apply()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def reset_owners(self) -> None:
        """Forget hook targets (after the model's parameters were swapped)."""
        self.flush()
        for h in self._hooked.values():
            h.remove()
        self._hooked.clear()
        self._owner = {}
