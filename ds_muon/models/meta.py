"""A model's meta copy, and what running a forward on the meta device needs (shared by the trace and the
input search, :mod:`.trace` and :mod:`.inputs`, so neither imports the other for it).

* :func:`meta_copy`: the model with meta tensors of its global shapes in place of its parameters and buffers
  (ZeRO-3's ``ds_shape``, a DTensor's full shape), hooks dropped; the user's model is never touched;
* :func:`_to_meta`: example inputs on meta; :func:`all_nonzero`: ``nonzero`` answered on meta;
* :func:`_fake_scalar`: what a data-dependent read of a meta tensor gets; :func:`_name`: a torch function's name.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ..tensors.shape import global_shape


def all_nonzero():
    """``nonzero`` (``torch.where(mask)``: MoE routing) on meta tensors answers as if every element were
    nonzero, the trace's convention for data-dependent reads, where this torch has the switch."""
    try:
        from torch.fx.experimental import _config

        if hasattr(_config, "meta_nonzero_assume_all_nonzero"):
            return _config.patch(meta_nonzero_assume_all_nonzero=True)
    except ImportError:
        pass
    return contextlib.nullcontext()


def _to_meta(obj):
    if isinstance(obj, torch.Tensor):
        return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, dict):
        return {k: _to_meta(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_meta(v) for v in obj)
    return obj


# -- the meta copy ----------------------------------------------------------------------------------
def _tensor_memo(model: nn.Module) -> Dict[int, Any]:
    """Meta stand-ins for every parameter, buffer and plain tensor attribute of ``model``'s modules."""
    memo: Dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(global_shape(p), dtype=p.dtype, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty(global_shape(b), dtype=b.dtype, device="meta")
    for m in model.modules():
        for v in vars(m).values():  # views FSDP1 keeps as attributes, cached tables
            if isinstance(v, torch.Tensor) and id(v) not in memo:
                memo[id(v)] = torch.empty(global_shape(v), dtype=v.dtype, device="meta")
    return memo


def meta_copy(model: nn.Module, memo: Optional[Dict[int, Any]] = None) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors of their global shape (ZeRO-3's
    ``ds_shape``, a DTensor's full shape), without hooks; the original's data is never copied or touched.
    A deep copy where the model allows one, else (FSDP2 refuses deep copies) a rebuild of the module tree
    that shares only the modules' non-tensor attributes (configs are copied)."""
    memo = dict(memo or {})
    memo.update({k: v for k, v in _tensor_memo(model).items() if k not in memo})
    try:
        out = copy.deepcopy(model, dict(memo))
    except Exception:  # noqa: BLE001 - a module refusing deepcopy
        out = _rebuild(model, memo, {})
    for m in out.modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
            d = getattr(m, attr, None)
            if isinstance(d, dict):
                d.clear()
    for c in _configs(out):  # the experts implementation that needs no real routing
        if hasattr(c, "_experts_implementation"):
            try:
                c._experts_implementation = "batched_mm"
            except Exception:  # noqa: BLE001 - a config refusing it keeps its own
                pass
    return out


def try_meta_copy(model: nn.Module) -> Tuple[Optional[nn.Module], str]:
    """``(meta copy, "")``, or ``(None, why)`` where the model cannot be copied (the trace then says why)."""
    try:
        return meta_copy(model), ""
    except Exception as e:  # noqa: BLE001 - any failure: the config and module types decide alone
        return None, failure(e)


def failure(e: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    first = str(e).splitlines()[0][:160] if str(e) else ""
    return f"{type(e).__name__}: {first}"


def _plain_class(cls):
    """FSDP2's ``fully_shard`` swaps a module's class for ``FSDP<cls>(FSDPModule, cls)``: the user's class."""
    if cls.__name__.startswith("FSDP") and len(cls.__bases__) == 2 and cls.__bases__[0].__name__ == "FSDPModule":
        return cls.__bases__[1]
    return cls


def _rebuild(m: nn.Module, memo: Dict[int, Any], done: Dict[int, nn.Module]) -> nn.Module:
    if id(m) in done:
        return done[id(m)]
    new = object.__new__(_plain_class(type(m)))
    done[id(m)] = new
    state = dict(vars(m))
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            state[k] = memo.get(id(v), v)
        elif hasattr(v, "to_dict") and hasattr(v, "model_type"):  # a config: its own copy
            if id(v) not in memo:
                memo[id(v)] = copy.deepcopy(v)
            state[k] = memo[id(v)]
    state["_parameters"] = {k: (None if p is None else memo[id(p)]) for k, p in m._parameters.items()}
    state["_buffers"] = {k: (None if b is None else memo[id(b)]) for k, b in m._buffers.items()}
    state["_modules"] = {k: (None if c is None else _rebuild(c, memo, done)) for k, c in m._modules.items()}
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                 "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_state_dict_hooks", "_load_state_dict_pre_hooks", "_state_dict_pre_hooks",
                 "_load_state_dict_post_hooks"):
        if attr in state:
            state[attr] = type(state[attr])()
    new.__dict__.update(state)
    return new


def _configs(model):
    seen, out = set(), []
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "to_dict") and id(c) not in seen:
            seen.add(id(c))
            out.append(c)
            for v in vars(c).values():
                if hasattr(v, "to_dict") and id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
    return out


def _name(func) -> str:
    n = getattr(func, "__name__", "") or ""
    if n == "__get__":  # properties (Tensor.T, .mT) arrive as their getter
        n = getattr(getattr(func, "__self__", None), "__name__", n)
    return n


_SCALARS = {"item", "__bool__", "tolist", "__int__", "__float__", "__index__", "__len__"}


def _fake_scalar(name: str, t: torch.Tensor):
    """What a data-dependent read of a meta tensor gets: true, one, zero (the forward's common paths: no
    padding, no packed sequences, one of each)."""
    if name == "__len__":
        return int(t.shape[0])
    if name == "tolist":
        return torch.ones(t.shape, dtype=torch.long).tolist()
    if name == "__bool__" or t.dtype == torch.bool:
        return True
    if name == "__float__" or t.is_floating_point():
        return 0.0
    return 1
