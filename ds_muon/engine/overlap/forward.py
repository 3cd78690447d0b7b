"""Updates applied in the next forward (opt-in: ``apply_in_forward=True``).

With ``Muon(..., overlap=True, apply_in_forward=True, model=model)`` the step issues
every wave's exchange and runs NS as waves arrive, but does not wait for the last
scatters: each wave's update is applied by a forward pre-hook of a module that uses
its parameters, just before they are needed (for FSDP, before the unit all-gathers
its shards).

The contract: a pending update lands before

* the forward of any module that owns the parameter (each owner of a tied weight,
  whichever runs first), or of the FSDP unit that gathers it;
* the next ``step()``, ``flush()``, the optimizer's ``state_dict()`` or
  ``load_state_dict()``;
* ``state_dict()`` or ``load_state_dict()`` of the model or of *any* of its submodules
  (so a checkpoint, and a rollback that loads the model first, see exactly the
  weights ``overlap=False`` gives).

Every other read must call ``opt.flush()`` first: ``parameters()`` read directly
(EMA/SWA, weight norms, clipping by weight norm, ``torch.save`` of parameters), a
parent module reading a child's weight in its own forward (``F.linear(h,
self.dec.weight)``), FSDP's ``summon_full_params`` or a manual ``unshard()``.
Without ``apply_in_forward`` nothing is deferred and every read sees the update.

A copy of the model (``copy.deepcopy`` for an EMA or reference model, pickling, ``torch.save(model)``)
lands every pending update first, so the copy holds the updated weights, and the copy's hooks are
inert: nothing in it can apply the original's updates (a second time).

Waiting needs no new collective — every exchange was issued in ``step()`` in the
same order on every rank — so a rank that never runs some module's forward cannot
deadlock the others.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, NamedTuple, Optional, Set

import torch
from torch import nn

from .units import all_gather_streams, fsdp1_units_by_handle, fsdp_units, gathered_in_pre_forward, hook_owners


class _Pending(NamedTuple):
    param_ids: Set[int]
    apply: Callable[[], None]
    device: Optional[torch.device]  # a CUDA device when the update lands there (see _gathers_wait)


class DeferredApply:
    """Pending wave applications and the hooks that run them.

    A hook sits on every module that owns pending parameters and on every FSDP unit.  It
    lands the updates of all the units whose shards FSDP is about to all-gather: the
    module's own, and under FSDP those of the units its pre-forward prefetches (FSDP2
    ``set_modules_to_forward_prefetch``, FSDP1 ``forward_prefetch=True``) or gathers with
    it (FSDP2 ``fully_shard([a, b])``), which would otherwise be gathered from shards
    whose update has not landed.  Our hook runs before FSDP's (both are prepended, ours
    later), so the update always precedes the gather."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._pending: List[_Pending] = []
        self._owner: Dict[int, List[nn.Module]] = {}
        self._members: Dict[int, Set[int]] = {}  # id(module) -> ids of the parameters it owns
        self._units: Set[int] = set()  # ids of the model's FSDP units
        self._fsdp1_by_handle: Dict[int, nn.Module] = {}
        self._hooked: Dict[int, object] = {}
        self._state_hooks: list = []  # state_dict / load_state_dict pre-hooks on every module
        self._state_hook = _first(model._state_dict_pre_hooks, model.register_state_dict_pre_hook(_Hook(self)))
        _parameters_last(model)

    def add(self, param_ids: List[int], apply: Callable[[], None], params: List[torch.Tensor]) -> None:
        device = next((p.device for p in params if p.is_cuda), None)
        self._pending.append(_Pending(set(param_ids), apply, device))
        if not self._owner:
            self._learn_owners()
        for p in params:
            mods = self._owner.get(id(p))
            if not mods:
                # a tensor the model does not own (swapped by a stack): nothing would apply it in time
                self.flush()
                return
            for mod in mods:
                self._hook(mod)

    def _learn_owners(self) -> None:
        """Who owns which parameter, a hook on every FSDP unit (a unit may prefetch others
        while owning no pending parameter itself), and state_dict / load_state_dict
        pre-hooks on every module (a submodule's checkpoint, a rollback)."""
        self._owner = hook_owners(self.model)
        self._members = {}
        for pid, mods in self._owner.items():
            for mod in mods:
                self._members.setdefault(id(mod), set()).add(pid)
        self._fsdp1_by_handle = fsdp1_units_by_handle(self.model)
        units = fsdp_units(self.model)
        self._units = {id(u) for u in units}
        for unit in units:
            self._hook(unit)
        for mod in self.model.modules():
            self._state_hooks.append(_first(mod._state_dict_pre_hooks, mod.register_state_dict_pre_hook(_Hook(self))))
            self._state_hooks.append(
                _first(mod._load_state_dict_pre_hooks, mod.register_load_state_dict_pre_hook(_Hook(self))))
            _parameters_last(mod)

    def _hook(self, mod: nn.Module) -> None:
        if id(mod) not in self._hooked:
            self._hooked[id(mod)] = mod.register_forward_pre_hook(_Hook(self, forward=True), prepend=True)

    def _pre_forward(self, mod: nn.Module) -> None:
        """Land what ``mod``'s forward (or, for an FSDP unit, its all-gather) is about to read."""
        if not self._pending:
            return
        is_unit = id(mod) in self._units
        units = gathered_in_pre_forward(mod, self._fsdp1_by_handle) if is_unit else [mod]
        ids = set()
        for unit in units:
            ids |= self._members.get(id(unit), set())
        devices = self.apply_for(ids)
        if devices and is_unit:
            _gathers_wait(units, devices)

    def apply_for(self, param_ids) -> Set[torch.device]:
        """Apply (in dispatch order) every pending wave that touches these parameters;
        returns the CUDA devices the applied updates landed on."""
        keep, devices = [], set()
        for entry in self._pending:
            if entry.param_ids & param_ids:
                entry.apply()
                if entry.device is not None:
                    devices.add(entry.device)
            else:
                keep.append(entry)
        self._pending = keep
        return devices

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for entry in pending:
            entry.apply()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def reset_owners(self) -> None:
        """Forget hook targets (after the model's parameters were swapped)."""
        self.flush()
        for h in list(self._hooked.values()) + self._state_hooks:
            h.remove()
        self._hooked.clear()
        self._state_hooks = []
        self._owner, self._members, self._units, self._fsdp1_by_handle = {}, {}, set(), {}


class _Hook:
    """A module hook of :class:`DeferredApply`: ``forward``, the pre-hook that lands what the module
    (its first argument) is about to read; else the state_dict / load_state_dict pre-hook that lands
    all.  It holds the DeferredApply weakly (the optimizer owns it; a closure or a bound method would
    drag the optimizer, the model and any DDP wrapper into a copy of a module).  Copied or pickled,
    it first lands every pending update of the original (so the copy's weights are the updated
    ones) and becomes an :class:`_Inert` hook: a copy never applies the original's updates."""

    __slots__ = ("_owner", "_forward")

    def __init__(self, owner: "DeferredApply", forward: bool = False):
        self._owner = weakref.ref(owner)
        self._forward = forward

    def __call__(self, module, *args, **kwargs) -> None:
        owner = self._owner()
        if owner is None or not owner._pending:
            return
        if self._forward:
            owner._pre_forward(module)
        else:
            owner.flush()

    def _land(self) -> None:
        owner = self._owner()
        if owner is not None and owner._pending:
            owner.flush()

    def __deepcopy__(self, memo):
        self._land()
        return _Inert()

    def __copy__(self):
        return self  # a shallow copy shares the original's parameters: the same hook is right

    def __reduce__(self):
        self._land()
        return (_Inert, ())


class _Inert:
    """What a copy of a :class:`_Hook` becomes: a hook that does nothing."""

    __slots__ = ()

    def __call__(self, *args, **kwargs) -> None:
        return None


def _parameters_last(mod: nn.Module) -> None:
    """Move ``_parameters`` after the hook dicts in ``mod.__dict__`` (an order nothing else reads):
    deepcopy and pickle walk the dict in order, so a copy of ``mod`` meets a :class:`_Hook` (which
    lands the pending updates) before the weights it copies.  ``_modules`` already comes after."""
    d = mod.__dict__
    if "_parameters" in d:
        d["_parameters"] = d.pop("_parameters")


def _first(hooks, handle):
    """Run this hook before the module's others: FSDP1's state_dict pre-hook all-gathers the
    shards (and FSDP2's may swap parameters), so the update must land before it."""
    hooks.move_to_end(handle.id, last=False)
    return handle


def _gathers_wait(units: List[nn.Module], devices: Set[torch.device]) -> None:
    """Make FSDP's all-gather streams wait for updates just applied on the current stream.

    FSDP reads a unit's shards on its own streams (FSDP2: copy-in and all-gather streams;
    FSDP1: pre-unshard and unshard streams), which wait on the compute stream only in the
    root's pre-forward.  An update applied later, in a unit's pre-forward, must be ordered
    before the gather FSDP is about to issue for that unit or for the units it prefetches."""
    for device in devices:
        event = torch.cuda.current_stream(device).record_event()
        seen = set()
        for unit in units:
            for stream in all_gather_streams(unit):
                if id(stream) not in seen and getattr(stream, "device", device) == device:
                    seen.add(id(stream))
                    stream.wait_event(event)
