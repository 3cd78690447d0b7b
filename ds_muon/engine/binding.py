"""Bindings and layouts of the Muon tensors now in ``param_groups``, from the stack's adapter.

A binding (:class:`~ds_muon.engine.exchange.layout.ParamBinding`) says where one tensor's matrices
live; the layouts (one per process group) are built from every rank's bindings.  The adapter is
duck-typed here (``adapter.bind(param, name, context)``) and its context is made by the callable the
optimizer passes, so the engine never imports a stack (:mod:`ds_muon.integrations`).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List

from .exchange.layout import _DTENSOR_OR_NONE, Layout, ParamBinding, build_layout
from ..tensors.tag_keys import restore_tags


def param_name(param_groups: List[dict], gi: int, pi: int) -> str:
    """Tensor ``pi`` of group ``gi`` by its ``param_names`` entry, else by its place."""
    names = param_groups[gi].get("param_names")
    return names[pi] if names else f"param_groups[{gi}]['params'][{pi}]"


def signature(param_groups: List[dict]) -> tuple:
    """What the bindings depend on: each Muon tensor, with its shape or a DTensor's spec."""
    return tuple(  # inline (a call per tensor costs more than the rest): shape, or a DTensor's spec
        (id(p), p._spec) if isinstance(p, _DTENSOR_OR_NONE) else (id(p), p.shape)
        for g in param_groups if g["use_muon"] for p in g["params"]
    )


def bind_all(param_groups: List[dict], adapter, context: Callable[[dict], object]) -> Dict[int, ParamBinding]:
    """Each Muon tensor's binding, by id, in group order: where its matrices live, from this rank's
    metadata alone (no collective; the layouts built from them are one).  ``context(group)``: the
    adapter's context for a tensor of ``group``."""
    bindings: Dict[int, ParamBinding] = {}
    for gi, g in enumerate(param_groups):
        if not g["use_muon"]:
            continue
        tags = g.get("param_tags")
        tags = tags if tags and len(tags) == len(g["params"]) else [None] * len(g["params"])
        ctx = context(g)
        for pi, p in enumerate(g["params"]):
            restore_tags(p, tags[pi])  # a stack swapped the tensor muon_param_groups tagged
            bindings[id(p)] = adapter.bind(p, param_name(param_groups, gi, pi), ctx)
    return bindings


def layouts_of(bindings: Dict[int, ParamBinding]) -> List[Layout]:
    """One layout per process group, of the non-empty matrices bound in it (collective: every rank's)."""
    by_group: Dict[object, tuple] = {}
    for b in bindings.values():
        # an empty matrix (a layer with 0 outputs or inputs) has nothing to orthogonalize
        by_group.setdefault(None if b.group is None else id(b.group), (b.group, []))[1].extend(
            (b, s) for s in b.matrices if math.prod(s.matrix_shape))
    return [build_layout(entries, group) for group, entries in by_group.values()]
