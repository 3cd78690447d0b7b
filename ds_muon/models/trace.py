"""Read what a model's forward does with each parameter: one forward on the ``meta`` device.

The model is copied onto the meta device (its parameters replaced by meta tensors of their global
shape in the copy: the user's model and its data are never touched) and run once with example inputs
under a ``TorchFunctionMode`` that follows every tensor the forward makes.  For each parameter it
records (:class:`Use`):

* the ops that consume it: a linear map (``linear``, ``matmul``, ``bmm``, ``addmm``, ``baddbmm``, ``conv``,
  ``einsum``, ``tensordot``, grouped mm over a 3-D expert stack, a gathered expert stack), a lookup
  (``embedding``), or anything else (elementwise, gathered rows);
* how it is stored: ``[out, in]`` (``F.linear``) or ``[in, out]`` (``x @ W``), per expert for a 3-D stack;
  for an equation (``einsum``, ``tensordot``, a linear map of a reshaped view) the role of each stored axis,
  read from the equation and the view's strides (:mod:`.equations`);
* whether its input is the model's input with no weight in between (an input layer: stems, patch
  embeddings) and whether its output reaches the model's output with no other weight and no mixing
  with another weight's output after it, or reaches a loss function's prediction so (the final output
  layer; every tensor of the output counts, whatever holds it: :func:`_outputs`; a model returning
  ``loss + aux`` still has the head its loss read);
* how its output is split: every ``chunk``/``split``/``unbind``/slice of its output (after any
  ``view``/``reshape``/``permute`` exposing a block axis) is replayed on a small integer *companion*
  tensor holding each element's output-feature index, so the blocks and their interleaving are exact
  for any layout.  A split undone later (the pieces concatenated back in place, or added together as a
  rotary embedding does) is no split.

Any failure (a forward that needs real data, inputs that cannot be guessed) returns a :class:`Trace`
with ``error`` set and no uses: the caller falls back to the config/module rules.  The mode itself is
:mod:`.recorder`; the inputs are found by :mod:`.inputs`, the meta copy made by :mod:`.meta`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .inputs import default_inputs
from .meta import _to_meta, all_nonzero, failure, try_meta_copy
from .recorder import Use, _Info, _Recorder  # noqa: F401 - Use: what the trace reports, read from here


@dataclass
class Trace:
    """``uses``: parameter name (as ``named_parameters()`` of the traced module gives it) -> :class:`Use`;
    ``error``: why no forward ran (then ``uses`` is empty); ``ms``: what reading took."""

    uses: Dict[str, Use] = field(default_factory=dict)
    error: str = ""
    ms: float = 0.0
    inputs: str = ""



CACHES = ("past_key_values", "cache", "mems")  # output fields that are the forward's saved state, not its output


def _outputs(out, field: str = "") -> List[torch.Tensor]:
    """Every tensor the model outputs, whatever holds it: a tensor, a tuple or list, a mapping, a dataclass
    (transformers' ``ModelOutput``, diffusers' ``BaseOutput``, any ``@dataclass``), nested; fields named as
    caches (``past_key_values``, ``mems``: keys and values saved for the next call) are not outputs."""
    if any(c in str(field).lower() for c in CACHES):
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "keys") and hasattr(out, "__getitem__") and not isinstance(out, type):
        try:
            return [t for k in list(out.keys()) for t in _outputs(out[k], k)]
        except (KeyError, TypeError, IndexError):
            return []
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in _outputs(getattr(out, f.name, None), f.name)]
    if isinstance(out, (list, tuple)):
        names = getattr(out, "_fields", None) or [""] * len(out)
        return [t for k, v in zip(names, out) for t in _outputs(v, k)]
    return []


# -- the entry point --------------------------------------------------------------------------------
def trace(model: nn.Module, example_inputs=None) -> Trace:
    """What ``model``'s forward does with each parameter (:class:`Trace`), read on a meta copy (:func:`trace_meta`
    of :func:`~.meta.meta_copy`: the model is never touched)."""
    t0 = time.perf_counter()
    shadow, error = try_meta_copy(model)
    return trace_meta(shadow, example_inputs, error, t0)


def trace_meta(shadow: Optional[nn.Module], example_inputs=None, error: str = "", t0: Optional[float] = None) -> Trace:
    """What the forward of a meta model does with each parameter: a model's meta copy, or a stack's rebuild of it
    at its original shapes (FSDP1's).  ``error``: why no meta model could be made (the trace says so).

    ``example_inputs``: a tensor, a tuple of positional arguments, or a dict of keyword arguments for one
    forward (any device: only shapes and dtypes are used); default: :func:`default_inputs` (found on ``shadow``)."""
    t0 = time.perf_counter() if t0 is None else t0
    result = Trace()
    if error:
        result.error, result.ms = error, (time.perf_counter() - t0) * 1000
        return result
    try:
        if example_inputs is None:
            args, kwargs, result.inputs = default_inputs(shadow)
        elif isinstance(example_inputs, dict):
            args, kwargs, result.inputs = (), dict(example_inputs), "example_inputs="
        elif isinstance(example_inputs, (tuple, list)):
            args, kwargs, result.inputs = tuple(example_inputs), {}, "example_inputs="
        else:
            args, kwargs, result.inputs = (example_inputs,), {}, "example_inputs="
        shadow.eval()
        names = {}
        for n, p in shadow.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)
        rec = _Recorder(names, {n: tuple(p.shape) for n, p in shadow.named_parameters(remove_duplicate=False)})
        args, kwargs = _to_meta(args), _to_meta(kwargs)
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                rec.mark_input(t)
            elif isinstance(t, torch.Tensor):
                rec.put(t, _Info())  # ids: rows are looked up, not read as features
        with torch.no_grad(), all_nonzero(), rec:
            out = shadow(*args, **kwargs)
        uses = rec.finish(_outputs(out))
        alias = {}
        for n, p in shadow.named_parameters(remove_duplicate=False):
            alias.setdefault(id(p), []).append(n)
        for ns in alias.values():
            u = next((uses[n] for n in ns if n in uses), None)
            if u is not None:
                for n in ns:
                    uses[n] = u
        result.uses = uses
    except Exception as e:  # noqa: BLE001 - any failure falls back to the config/module rules
        result.error = failure(e)
        result.uses = {}
    result.ms = (time.perf_counter() - t0) * 1000
    return result

