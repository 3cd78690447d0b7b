"""What an optimizer holds, and what a step allocates at its peak, on any device (CPU included).

``held_bytes(opt, params)``: bytes of the tensor storages reachable from the optimizer object
(its state, param groups, caches, hooks' closures), each storage counted once, without the
parameters' and gradients' own storages (the model's, not the optimizer's).  It walks the
object graph with ``gc.get_referents`` and stops at modules, classes and nn.Modules, so it
counts what the optimizer keeps alive, whatever it is called.  Deterministic: no timing.

``peak_bytes(fn)``: the highest net number of bytes that tensors allocated while ``fn`` runs
hold at once, read from the CPU allocator's own reports to the profiler
(``torch.profiler.profile(profile_memory=True)``: one event per allocation and free).
Frees of memory allocated before ``fn`` are not reported there, so this is the peak of
what ``fn`` adds (an upper bound when ``fn`` also frees older memory).
"""

from __future__ import annotations

import gc
import types
from typing import Callable, Iterable, Tuple

import torch
from torch import nn

import ds_muon

_STOP = (type, types.ModuleType, nn.Module, types.FrameType, types.CodeType)


def _storage_key(t: torch.Tensor) -> Tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _locals_of(t: torch.Tensor):
    inner = getattr(t, "_local_tensor", None)  # a DTensor: its local shard holds the memory
    return [t] if inner is None else [inner]


def model_storages(params: Iterable[torch.Tensor]) -> set:
    """The storages of ``params`` and of their gradients (local shards included)."""
    out = set()
    for p in params:
        for t in [p] + ([p.grad] if p.grad is not None else []):
            for x in _locals_of(t):
                if x.device.type != "meta":
                    out.add(_storage_key(x)[0])
    return out


def held_bytes(root, params: Iterable[torch.Tensor]) -> int:
    """Bytes of storages reachable from ``root`` other than ``params``' and their gradients'."""
    exclude = model_storages(params)
    seen_obj, seen_storage = set(), set()
    total = 0
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen_obj or isinstance(obj, _STOP) or obj is None:
            continue
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            for x in _locals_of(obj):
                if x.device.type == "meta":
                    continue
                ptr, nbytes = _storage_key(x)
                if nbytes and ptr not in exclude and ptr not in seen_storage:
                    seen_storage.add(ptr)
                    total += nbytes
        todo.extend(_referents(obj))
    return total


def _referents(obj) -> list:
    """What ``obj`` keeps alive; a function's closure and defaults, not its module's globals."""
    if isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in (obj.__closure__ or ()) if _filled(c)]
        return cells + list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
    return gc.get_referents(obj)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def peak_bytes(fn: Callable[[], object]) -> Tuple[int, int]:
    """``(peak, net)`` bytes allocated on the CPU while ``fn()`` runs: the highest running total
    of the allocator's allocation and free events, and what is still allocated at the end."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak, running


def optimizers(kind: str, model: nn.Module) -> list:
    """What a step is measured with: ``"ds_muon"`` (one Muon over ds_muon's groups), or
    ``"torch"``: torch.optim.Muon on the same Muon tensors beside torch.optim.AdamW on the rest."""
    groups = ds_muon.muon_param_groups(model)
    if kind == "ds_muon":
        # torch.optim.Muon's NS (bf16, standard), so both hold and peak on the same maths whatever auto picks
        return [ds_muon.Muon(groups, lr=0.02, log_summary=False, ns_dtype=torch.bfloat16, ns_method="standard")]
    muon = [p for g in groups if g.get("use_muon", True) for p in g["params"]]
    adam = [p for g in groups if not g.get("use_muon", True) for p in g["params"]]
    return [torch.optim.Muon(muon, lr=0.02, momentum=0.95, nesterov=True), torch.optim.AdamW(adam, lr=3e-4)]
