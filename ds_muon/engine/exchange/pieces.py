"""This rank's pieces of one wave's matrices, as the lists the update's foreach calls take.

A step touches every matrix piece three times (momentum and Nesterov before the gather,
the update after the scatter), through the parameter, its gradient and its momentum
buffer.  Making those views afresh every step (``to_local()``, a flat view, a slice, per
tensor and use) cost more host time than the arithmetic on a small matrix.
:class:`WavePieces` works out once per wave which pieces go together (param group, then
shape: the order the update's coefficients are shared in) and keeps the views of
parameters and momentum buffers, checked every step by the address of each local tensor
(a stack or a load that swaps storage gets new views).  Gradients are new every step: a
piece that is all of a contiguous local tensor uses the tensor itself (no view), others
are cut from the binding's flat view.  Nesterov's inputs are written into a kept buffer
whose flat views the exchange reads, instead of new tensors every step; its memory is lent
only until the exchange has copied them (:mod:`~ds_muon.engine.memory.lending`), and only the pieces the
exchange reads get one (a replica's piece of a matrix homed elsewhere is not sent).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from ...rules.update import apply_coefficients, apply_result, ns_input
from .layout import _DTENSOR_OR_NONE as _DTENSOR, Layout, ParamBinding, matrix_shape
from ..memory.lending import give_back, take


class WavePieces:
    """The pieces of ``ex.active`` this rank holds, sorted by (param group, shape,
    transposed); ``group_index[id(param)]`` is each parameter's index in ``param_groups``.
    ``reads`` (default all): the matrices whose NS inputs the exchange reads; the others only
    move their momentum."""

    def __init__(self, layout: Layout, active: List[int], group_index: Dict[int, int], reads=None):
        entries = []
        for i in active:
            b, slot = layout.local[i]
            piece = slot.piece
            if piece is None or piece.numel == 0:
                continue
            key = (group_index[id(b.param)], slot.shape, slot.transposed)
            if slot.local_view is None:
                entries.append(key + (i, b, slot.local_offset, piece.numel, None, None))
                continue
            start = 0  # a strided piece: one entry per strided view of it, in the piece's order
            for rel, sizes, strides in slot.local_view:
                n = math.prod(sizes)
                entries.append(key + (i, b, slot.local_offset + rel, n, (tuple(sizes), tuple(strides)),
                                      (start, n) if len(slot.local_view) > 1 else None))
                start += n
        entries.sort(key=lambda e: e[:3])  # stable: layout order within a kind
        self.idx = [e[3] for e in entries]
        self.bindings: List[ParamBinding] = [e[4] for e in entries]
        self.params = [b.param for b in self.bindings]
        self.spans = [(e[5], e[6]) for e in entries]
        self.views = [e[7] for e in entries]  # (sizes, strides) of a strided local piece, else None
        self.subs = [e[8] for e in entries]  # (start, numel) in its matrix piece of a piece held in several views
        self._multi = {i for i, sub in zip(self.idx, self.subs) if sub is not None}
        self._strided = any(v is not None for v in self.views)
        # runs of equal param group (the update's inputs) and of equal (group, shape, transposed) (its coefficients)
        self.group_indices = [e[0] for e in entries]
        self.groups = _runs(self.group_indices)
        # per run of a param group: the positions in it whose inputs are read (None: all of them)
        self._read_at = [None if reads is None or all(self.idx[k] in reads for k in range(a, z))
                         else [k - a for k in range(a, z) if self.idx[k] in reads] for a, z in self.groups]
        self.kinds = [(a, z, entries[a][0], matrix_shape(entries[a][1]), entries[a][2])
                      for a, z in _runs([e[:3] for e in entries])]
        self._ptrs: Optional[list] = None  # local storage addresses of params then momenta the views were made for
        self._keep: list = []  # the local tensors those views are of (so an address stays theirs)
        self._whole: List[bool] = []
        self._bufs: List[torch.Tensor] = []  # momentum pieces, shaped like the gradient pieces
        self._buf_flats: List[torch.Tensor] = []
        self._param_pieces: List[torch.Tensor] = []  # shaped like the gradient pieces (L2 decay)
        self._param_flats: List[torch.Tensor] = []  # flat (the results are)
        self._param_ptrs: Optional[list] = None
        self._inputs: Dict[tuple, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}  # kept Nesterov inputs
        self._all_whole = False
        self._bound_in = None
        self._flat_results: Optional[bool] = None  # are all results flat (no column blocks)?
        self._parts: Dict[Optional[int], List[Tuple[int, int]]] = {}
        self._step_grads: Optional[List[torch.Tensor]] = None  # this step's, across its parts
        self._copied: List[int] = []  # pieces of parameters with no flat view (ParamBinding.copied)

    # -- views, checked every use ----------------------------------------------------------------
    def _bind(self, state) -> None:
        """The views of parameters and momentum buffers, made again when a local tensor moved."""
        lps = _locals(self.params)
        lms = _locals([state[p]["momentum_buffer"] for p in self.params])
        ptrs = [t.data_ptr() for t in lps] + [t.data_ptr() for t in lms]
        if ptrs == self._ptrs:
            return
        self._whole = [_whole(b, p, lp, off, n)
                       for p, lp, b, (off, n) in zip(self.params, lps, self.bindings, self.spans)]
        self._param_flats = [_cut(b, p, off, n, v)
                             for b, p, (off, n), v in zip(self.bindings, self.params, self.spans, self.views)]
        self._param_pieces = [lp if w else f for lp, w, f in zip(lps, self._whole, self._param_flats)]
        self._buf_flats = [_cut(b, state[p]["momentum_buffer"], off, n, v)
                           for b, p, (off, n), v in zip(self.bindings, self.params, self.spans, self.views)]
        self._bufs = [lm if w else f for lm, w, f in zip(lms, self._whole, self._buf_flats)]
        self._inputs.clear()
        self._keep = lps + lms
        self._ptrs = ptrs
        self._param_ptrs = ptrs[:len(lps)]
        self._all_whole = all(self._whole)
        self._copied = [k for k, b in enumerate(self.bindings) if b.copied]

    def _fresh_copies(self) -> None:
        """Parameters with no flat view (``ParamBinding.copied``): their flat pieces are copies,
        taken again now (the parameter may have changed since the last one)."""
        for k in self._copied:
            off, n = self.spans[k]
            self._param_flats[k] = self._param_pieces[k] = _cut(self.bindings[k], self.params[k], off, n)

    def _copy_back(self) -> None:
        """The updated copies written into their parameters (each such piece is the whole tensor)."""
        for k in self._copied:
            p = _locals([self.params[k]])[0]
            p.copy_(self._param_flats[k].view(p.shape))

    def _grads(self) -> List[torch.Tensor]:
        if self._all_whole:
            return _locals([p.grad for p in self.params])
        out = []
        flats: Dict[int, torch.Tensor] = {}
        for p, b, w, (off, n), v in zip(self.params, self.bindings, self._whole, self.spans, self.views):
            if w:
                out.append(_locals([p.grad])[0])
            else:
                flat = flats.get(id(p))
                if flat is None:
                    flat = flats[id(p)] = b.flat(p.grad)
                out.append(_strided(flat, off, v) if v is not None
                           else flat if off == 0 and n == flat.numel() else flat[off:off + n])
        return out

    def _kept_inputs(self, a: int, z: int, grads: List[torch.Tensor], at: Optional[List[int]]):
        """A kept buffer for the Nesterov inputs of pieces ``[a, z)`` (those ``at``, or all): views
        shaped like ``grads`` and flat, and the buffer (its memory lent until :meth:`sent`)."""
        key = (a, z) + tuple(g.dtype for g in grads[:1])
        kept = self._inputs.get(key)
        if kept is None:
            numels = [self.spans[a + k][1] for k in at] if at is not None else [n for _, n in self.spans[a:z]]
            buf = torch.empty(sum(numels), dtype=grads[0].dtype, device=grads[0].device)
            flats = list(buf.split(numels))
            kept = self._inputs[key] = ([f.view(g.shape) for f, g in zip(flats, grads)], flats, buf)
        take(kept[2])
        return kept

    def _within(self, part: Tuple[int, int]):
        """The runs of a param group cut to ``part``, with their read positions."""
        p0, p1 = part
        for (a, z), at in zip(self.groups, self._read_at):
            a2, z2 = max(a, p0), min(z, p1)
            if a2 < z2:
                yield (a2, z2), None if at is None else [a + k - a2 for k in at if a2 <= a + k < z2]

    def sent(self) -> None:
        """The exchange has copied this step's inputs: the Nesterov buffers' memory goes back."""
        for kept in self._inputs.values():
            give_back(kept[2])

    def parts(self, budget: Optional[int]) -> List[Tuple[int, int]]:
        """``[start, end)`` runs of the pieces whose NS inputs read take at most ``budget`` bytes each
        (one run for everything without a budget, or when it all fits): the step computes and hands
        over one run's inputs at a time, so only one run's Nesterov buffer exists at once."""
        cached = self._parts.get(budget)
        if cached is None:
            n = len(self.idx)
            read = [True] * n
            for (a, z), at in zip(self.groups, self._read_at):
                if at is not None:
                    read[a:z] = [False] * (z - a)
                    for k in at:
                        read[a + k] = True
            size = [self.spans[k][1] * self.params[k].dtype.itemsize if read[k] else 0 for k in range(n)]
            cached, a, acc = [], 0, 0
            if budget is not None and sum(size) > budget and not self._multi:  # (a matrix in several views: one part)
                for k in range(n):
                    if k > a and acc + size[k] > budget:
                        cached.append((a, k))
                        a, acc = k, 0
                    acc += size[k]
            cached.append((a, n))
            self._parts[budget] = cached
        return cached

    # -- the update's two halves -----------------------------------------------------------------
    def inputs(self, param_groups, state, commit: bool = True, bound_in=None, part: Optional[Tuple[int, int]] = None,
               into: Optional[Dict[int, torch.Tensor]] = None):
        """This rank's pieces of the wave's NS inputs (weight decay, momentum, Nesterov:
        :func:`~ds_muon.rules.update.ns_input`, one call per param group) as ``{matrix: flat piece}``,
        and (``commit=False``) the ``(momentum piece, new value)`` pairs to commit later.
        ``bound_in``: a token of the step, for :meth:`apply`.  ``part``: only the pieces of one of
        :meth:`parts` (default all).  ``into`` (``{matrix: flat tensor}``, the exchange's
        :meth:`~ds_muon.engine.exchange.all_to_all.Exchange.home_destinations`): where a matrix's Nesterov
        input is written instead of the kept buffer (the same lerp, so the same bits)."""
        if part is None or part[0] == 0:  # the views are checked and gradients listed once per step
            self._bind(state)
            self._bound_in = bound_in
            if self._copied:
                self._fresh_copies()
            self._step_grads = self._grads()
        grads = self._step_grads
        if part is None or part[1] == len(self.idx):
            self._step_grads = None  # no reference to the gradients outlives the step
        pieces: Dict[int, torch.Tensor] = {}
        commits = []
        for (a, z), at in (zip(self.groups, self._read_at) if part is None else self._within(part)):
            g = param_groups[self._group_of(a)]
            gs = grads[a:z]
            kept = None
            idx = self.idx[a:z] if at is None else [self.idx[a + k] for k in at]
            if commit and g["nesterov"] and at != [] and all(t.dtype == gs[0].dtype for t in gs):
                kept = self._kept_inputs(a, z, gs if at is None else [gs[k] for k in at], at)
                if into:
                    kept = _written_into(kept, idx, into, self._multi)
            inputs, new = ns_input(gs, self._bufs[a:z], self._param_pieces[a:z], g, commit,
                                   out=kept[0] if kept is not None else None, only=at)
            if kept is not None:
                flats = kept[1]
            elif commit and not g["nesterov"] and not self._strided:
                flats = self._buf_flats[a:z] if at is None else [self._buf_flats[a + k] for k in at]
            else:
                flats = [t.reshape(-1) for t in inputs]
            if self._multi:
                for i, f in zip(idx, flats):
                    if i in self._multi:
                        pieces.setdefault(i, []).append(f)
                    else:
                        pieces[i] = f
            else:
                pieces.update(zip(idx, flats))
            if not commit:
                commits.extend(zip(self._bufs[a:z], new))
        for i in self._multi:  # the exchange sends a piece held in several views as one
            if i in pieces:  # (not when the exchange does not read it: a replica homed elsewhere)
                pieces[i] = torch.cat([f.reshape(-1) for f in pieces[i]])
        return pieces, commits

    def _group_of(self, a: int) -> int:
        return self.group_indices[a]

    def coefficients(self, param_groups) -> List[tuple]:
        """``(decay, alpha)`` of each kind, read now (a scheduler stepping later changes nothing)."""
        return [apply_coefficients(param_groups[gi], shape, transposed) for _, _, gi, shape, transposed in self.kinds]

    def apply(self, results: Dict[int, torch.Tensor], coefficients: List[tuple], bound_in=None) -> None:
        """``param = param * decay + alpha * result`` for every piece, one call per kind.
        ``bound_in``: the token the step passed :meth:`inputs` (its views need no second check)."""
        if bound_in is not None and bound_in == self._bound_in:
            pass  # the step's own apply: the views were checked by its inputs
        elif [t.data_ptr() for t in _locals(self.params)] != self._param_ptrs:  # moved since (or never bound)
            lps = _locals(self.params)
            self._param_flats = [_cut(b, p, off, n, v)
                                 for b, p, (off, n), v in zip(self.bindings, self.params, self.spans, self.views)]
            self._param_ptrs = [t.data_ptr() for t in lps]
            self._ptrs = None  # the inputs' views are made again at their next use
            self._copied = [k for k, b in enumerate(self.bindings) if b.copied]
        if self._copied:
            self._fresh_copies()
        ordered = [results[i] for i in self.idx]
        if self._multi:
            ordered = [r if sub is None else r.reshape(-1)[sub[0]:sub[0] + sub[1]] for r, sub in zip(ordered, self.subs)]
        if self._flat_results is None:  # the exchange hands out the same kinds of pieces every step
            self._flat_results = all(r.dim() == 1 for r in ordered) and not self._strided
        for (a, z, _, _, _), (decay, alpha) in zip(self.kinds, coefficients):
            apply_result(self._param_flats[a:z], ordered[a:z], decay, alpha, self._flat_results)
        if self._copied:
            self._copy_back()


def _written_into(kept, idx: List[int], into: Dict[int, torch.Tensor], multi) -> tuple:
    """The kept Nesterov buffers ``kept`` (views, flats, buffer) with the pieces of matrices in ``into``
    replaced by their destinations there (same dtype and size; not a matrix held in several views)."""
    views, flats = list(kept[0]), list(kept[1])
    for k, i in enumerate(idx):
        d = into.get(i)
        if d is not None and i not in multi and d.dtype == flats[k].dtype and d.numel() == flats[k].numel():
            views[k], flats[k] = d.view(views[k].shape), d
    return views, flats, kept[2]


def _locals(ts: List[torch.Tensor]) -> List[torch.Tensor]:
    """:func:`~ds_muon.engine.exchange.layout.local_data` of each (inline: a call per tensor costs more)."""
    return [t._local_tensor if isinstance(t, _DTENSOR) else t for t in ts]


def _cut(b: ParamBinding, t: torch.Tensor, off: int, n: int, view=None) -> torch.Tensor:
    flat = b.flat(t)
    if view is not None:
        return _strided(flat, off, view)
    return flat if off == 0 and n == flat.numel() else flat[off:off + n]


def _strided(flat: torch.Tensor, off: int, view) -> torch.Tensor:
    """A strided piece (:attr:`~ds_muon.engine.exchange.layout.MatrixSlot.local_view`) of a flat local tensor, as a view."""
    sizes, strides = view
    return flat.as_strided(sizes, strides, flat.storage_offset() + off)


def _runs(keys: list) -> List[Tuple[int, int]]:
    """``[start, end)`` of each run of equal consecutive keys."""
    out = []
    a = 0
    for k in range(1, len(keys) + 1):
        if k == len(keys) or keys[k] != keys[a]:
            out.append((a, k))
            a = k
    return out


def _whole(b: ParamBinding, p: torch.Tensor, lp: torch.Tensor, off: int, n: int) -> bool:
    """Is the piece all of ``p``'s local tensor, in the order of its flat view (row-major)?  Then
    the tensor itself stands for the piece (and its gradient's local tensor too): no view needed."""
    if off or n != lp.numel() or not lp.is_contiguous():
        return False
    flat = b.flat(p)
    return flat.data_ptr() == lp.data_ptr() and flat.numel() == n
