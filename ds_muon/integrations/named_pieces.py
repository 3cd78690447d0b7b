"""This rank's pieces of the model's tensors, found by the model's names, on every stack (for QK-clip).

:class:`ds_muon.QKClip` knows the q/k weights and biases by their names in the model; the optimizer steps
what the stack hands it.  :class:`NamedPieces` joins the two on each rank:

* :meth:`NamedPieces.matrix_slots` — the slots of the optimizer's bindings that are pieces of named
  matrices: a binding of the model's own tensor (local, DDP, FSDP2), or a slot of a flat tensor keyed by the
  model's names (FSDP1 flat parameters, DeepSpeed partitions);
* :meth:`NamedPieces.vector_pieces` — the local elements of named 1-D tensors (biases): the model's own
  tensor (a DTensor's local rows), an FSDP1 flat parameter's slice, a DeepSpeed fp32 partition's fragment;
* :meth:`NamedPieces.tagged` — the tensor that carries a matrix's global shape and tags, where FSDP1 hides it;
* :func:`weight_shape` — a module's weight's global shape, where a stack flattened it away.

Names are compared without the wrappers' own levels (:func:`clean_name`).
"""

from __future__ import annotations

from typing import Container, Dict, Optional, Tuple

import torch
from torch import nn

from ..engine.exchange.layout import is_flat_shard, local_data
from ..engine.exchange.row_scale import shard_offset
from ..tensors.shape import global_shape
from ..models.names import clean_name  # noqa: F401 - (re-exported for the face)
from .base import BindContext
from .fsdp1 import _Fsdp1Index, _shard_piece, _tag_carrier

class NamedPieces:
    """The pieces of ``model``'s tensors this rank holds among an optimizer's tensors, by clean name; what it
    learns of the optimizer's bindings is kept while they stay (its binding signature)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._bias_bindings: Dict[int, object] = {}  # DeepSpeed: a flat AdamW partition's binding, by id
        self._fsdp1 = None  # FSDP1: which module owns each flat parameter (integrations.fsdp1's index)
        self._slot_cache: Dict[tuple, object] = {}
        self._lookup_cache: Optional[tuple] = None  # (the optimizer's binding signature, its lookups)

    def _lookups(self, opt):
        """(model tensor id -> clean name, clean name -> tensor, optimizer tensor id -> the name it binds under),
        made once per set of bound tensors (the optimizer's binding signature), not in every clipping step."""
        sig = (id(opt), opt.runtime.signature)
        if self._lookup_cache is not None and self._lookup_cache[0] == sig:
            return self._lookup_cache[1]
        by_id = {id(p): clean_name(n) for n, p in self.model.named_parameters()}
        tensors = {clean_name(n): p for n, p in self.model.named_parameters()}
        names = {id(p): opt.runtime.name(gi, pi) for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])}
        self._lookup_cache = (sig, (by_id, tensors, names))
        return self._lookup_cache[1]

    def matrix_slots(self, opt, wanted: Container[str]):
        """``(binding, slot, (clean name, key base, block suffix), clean name -> model tensor)`` of every slot
        bound in this call that is a piece of a matrix named in ``wanted``."""
        by_id, tensors, names = self._lookups(opt)
        for b in opt.runtime.bindings.values():
            for slot in b.matrices:
                where = self._resolve(b, slot, by_id, names, wanted)
                if where is not None:
                    yield b, slot, where, tensors

    def _resolve(self, b, slot, by_id, names, wanted):
        """(clean parameter name, slot key base, block suffix) of a slot of a matrix in ``wanted``, else None."""
        key = (id(b), slot.key)  # (bindings live as long as the optimizer's layouts)
        if key in self._slot_cache:
            return self._slot_cache[key]
        out = None
        pname = by_id.get(id(b.param))
        base = names.get(id(b.param), slot.key)
        if pname in wanted and slot.key.startswith(base):  # the model's own tensor (local, DDP, FSDP2)
            out = (pname, base, slot.key[len(base):])
        else:  # a flat tensor (FSDP1 flat parameters, DeepSpeed partitions): slots are keyed by the model's names
            k = clean_name(slot.key)
            base = k.split("[", 1)[0]
            if base in wanted:
                raw = slot.key.split("[", 1)[0]
                out = (base, raw, slot.key[len(raw):])
        self._slot_cache[key] = out
        return out

    def vector_pieces(self, opt, wanted: Container[str]):
        """``(clean name, the 1-D local data this rank holds of it or None, its first element's index)`` for
        each tensor named in ``wanted`` (biases) among the tensors this call steps: the model's own tensor (local,
        DDP; FSDP2: the DTensor's local rows), an FSDP1 flat parameter's slice, a DeepSpeed fp32 partition's
        fragment."""
        if not wanted:
            return
        by_id = {id(p): clean_name(n) for n, p in self.model.named_parameters()}
        names = getattr(opt.adapter, "names", {}) or {}
        flats = getattr(opt.adapter, "flats", None) or {}
        for g in opt.param_groups:
            for p in g["params"]:
                name = by_id.get(id(p))
                if name is None and not hasattr(p, "_fqns") and id(p) not in flats:
                    name = clean_name(names.get(p, "")) or None  # DeepSpeed stage 0 bf16: an fp32 copy
                if name in wanted:
                    if getattr(p, "_fsdp_flattened", False):
                        raise NotImplementedError(f"ds_muon: QKClip: {name} is an FSDP1 use_orig_params=True view; "
                                                  "scaling its bias is not supported there (use_orig_params=False "
                                                  "or FSDP2)")
                    yield name, local_data(p).view(-1), shard_offset(p)
                elif hasattr(p, "_fqns"):  # an FSDP1 flat parameter: its originals' slices of this shard
                    prefix = self._fsdp1_prefix(p)
                    for i, fqn in enumerate(p._fqns):
                        full = clean_name(prefix + fqn)
                        if full in wanted:
                            piece, off = _shard_piece(p, i, full)
                            yield full, None if piece is None else p.detach().view(-1)[off:off + piece.numel], \
                                0 if piece is None else piece.offset
                elif id(p) in flats:  # a DeepSpeed fp32 partition: its fragments, as the adapter binds them
                    b = self._bias_bindings.get(id(p))
                    if b is None:
                        b = self._bias_bindings[id(p)] = opt.adapter.bind(p, "flat", BindContext(
                            opt.process_group, opt.model, g))
                    for slot in b.matrices:
                        key = clean_name(slot.key)
                        if key in wanted:
                            piece = slot.piece
                            view = None if piece is None else b.flat(p)[slot.local_offset:slot.local_offset +
                                                                         piece.numel]
                            yield key, view, 0 if piece is None else piece.offset

    def tagged(self, b, pname: str, tensors: Dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """The tensor that carries ``pname``'s shape and tags: the binding's own (local, DDP, FSDP2), the model's
        parameter of that name (DeepSpeed keeps the model's tensors), or the tagged stand-in the FSDP1 adapter
        binds a flat parameter's original by (FSDP1 hides the tensor itself); None when there is none."""
        t = tensors.get(pname)
        if t is not None and not is_flat_shard(t) and len(global_shape(t)) >= 2:
            return t
        fqns = getattr(b.param, "_fqns", None)
        if fqns is not None:
            prefix = self._fsdp1_prefix(b.param)
            for i, fqn in enumerate(fqns):
                if clean_name(prefix + fqn) == pname:
                    return _tag_carrier(b.param, i, pname)
        return None

    def _fsdp1_prefix(self, flat) -> str:
        """The name of the FSDP1 module that owns ``flat`` (as the FSDP1 adapter keys its originals)."""
        if self._fsdp1 is None or id(flat) not in self._fsdp1.flat:
            self._fsdp1 = _Fsdp1Index(self.model)
        entry = self._fsdp1.flat.get(id(flat))
        return entry[1] if entry is not None else ""


def weight_shape(module: nn.Module, path: str) -> Optional[Tuple[int, ...]]:
    """The global shape of ``module``'s weight at ``path``: the parameter's, or, where a stack hides it (FSDP1
    flattens it away), the Linear's ``[out_features, in_features]`` or the Conv1D's ``[nx, nf]``; None when the
    module has no such weight."""
    try:
        return tuple(global_shape(module.get_parameter(path)))
    except AttributeError:
        pass
    child_path, _, leaf = path.rpartition(".")
    try:
        child = module.get_submodule(child_path) if child_path else module
    except AttributeError:
        return None
    if leaf == "weight" and isinstance(getattr(child, "out_features", None), int):
        return (int(child.out_features), int(child.in_features))
    if leaf == "weight" and isinstance(getattr(child, "nf", None), int) and isinstance(getattr(child, "nx", None), int):
        return (int(child.nx), int(child.nf))  # transformers' Conv1D: stored [in, out]
    return None
