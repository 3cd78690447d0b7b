"""The tracing mode: a ``TorchFunctionMode`` that follows every tensor a meta forward makes, and records for
each parameter what consumes it (:class:`Use`; what each field means: :mod:`.trace`).

Each tensor the forward makes carries an :class:`_Info`: whether it is still the model's raw input, the set of
weights that last produced it, the parameter it is a view of (and where its elements sit in it: :mod:`.views`),
and a small integer *companion* holding each element's output-feature index, on which every split of a
weight's output is replayed (:mod:`.splits` reads the blocks).

Two rules in place of lists of ops.  *Provenance*: an op that applies a weight as a linear map makes its
output that weight's alone; every other op passes on the union of its inputs' weights, unless it sums or
multiplies the outputs of different weights together (:func:`_provenance`); the weights in the set of the
model's output, or of what a loss function reads as its prediction, are its final output layers, whatever ops
(a stack of heads, a soft-cap, a sort, a custom ``autograd.Function``) stand between.  *Views*: any op whose output is a view of a parameter keeps it one, its
layout composed by torch's own stride rules (:func:`.views.replay`), so a matrix op sees which stored axes are
the rows and columns of the matrix it applies, and which pick matrices of a stack.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .equations import Applied, read as read_equation, tensordot_equation
from .meta import _SCALARS, _fake_scalar, _name
from .op_names import CAT, COPIES, LINEAR_BIN, LOSSES, MIXING, PIECES, POOLS, PRODUCT_BIN, RESHAPES, SAME, UNARY
from .splits import output_blocks
from .views import View, axes, extent, replay, row_major, swapped, tensor_index, views_into


MATRIX_OPS = ("linear", "matmul", "bmm", "mm", "addmm", "baddbmm", "conv", "einsum", "tensordot", "grouped_mm")
COMPANION_CAP = 1 << 21  # elements of a companion tensor (int32): beyond, splits of that output are not read
CONV_COMPANION_CAP = 1 << 16  # the same for conv outputs (feature maps: large, and rarely split)


@dataclass
class Use:
    """What the forward did with one parameter (see the module docstring)."""

    ops: Set[str] = field(default_factory=set)
    stored_in_out: Optional[bool] = None  # True: x @ W ([in, out]); False: F.linear / W @ x ([out, in])
    experts: bool = False  # a 3-D stack applied per expert (bmm, grouped mm, gathered and applied)
    input_layer: bool = False
    head: bool = False
    unread: bool = False  # its output was too large to follow: splits of it are not known
    pooled_input: bool = False  # its input was pooled or had tokens picked since the last weight (a classifier)
    features: int = 0  # output features of the matrix the forward applies
    blocks: Optional[List[List[int]]] = None  # the output features of each block, when the output is split
    applied: Optional[Applied] = None  # the map an equation (einsum, tensordot, a reshaped view) applies with it
    applied_unread: str = ""  # why such a use could not be read as one map (the equation, or two that differ)

    @property
    def matrix(self) -> bool:
        return bool(self.ops & set(MATRIX_OPS))



# -- the tracing mode -------------------------------------------------------------------------------
@dataclass
class _Info:
    raw: bool = False  # derived from the model's input with no weight in between
    weighted: bool = False  # some weight (matrix or lookup) is upstream
    last: frozenset = frozenset()  # the weights that last produced it (the provenance rule: module docstring)
    param: Optional[str] = None  # a view of this parameter, its elements at ``view``
    view: Optional[View] = None  # where each element sits in the parameter's row-major storage (None: unknown)
    gathered: bool = False  # rows of a stack picked per token/expert (W[idx])
    comp: Optional[Tuple[str, torch.Tensor]] = None  # (param, feature index of each element)
    pooled: bool = False  # pooled, reduced or tokens picked since the last weight


class _Recorder(TorchFunctionMode):
    def __init__(self, params: Dict[int, str], shapes: Dict[str, Tuple[int, ...]]):
        super().__init__()
        self.params = params  # id(meta parameter) -> name
        self.shapes = shapes
        self.info: Dict[int, _Info] = {}
        self.keep: List[torch.Tensor] = []  # tensors stay alive so their ids stay theirs
        self.uses: Dict[str, Use] = {}
        self.pieces: Dict[int, List[torch.Tensor]] = {}  # id(split tensor) -> companions of its pieces
        self.sources: Dict[int, Tuple[str, torch.Tensor]] = {}
        self.rejoined: List[Tuple[str, torch.Tensor]] = []
        self.mixed: List[Tuple[str, torch.Tensor, torch.Tensor]] = []
        self.ends: Set[str] = set()  # weights whose outputs a loss function read as its prediction (LOSSES)

    # -- bookkeeping
    def get(self, t) -> _Info:
        if not isinstance(t, torch.Tensor):
            return _Info()
        if id(t) in self.info:
            return self.info[id(t)]
        name = self.params.get(id(t))
        shape = self.shapes.get(name, ())
        return _Info() if name is None else _Info(param=name, view=(tuple(shape), row_major(shape), 0))

    def put(self, t, info: _Info):
        if isinstance(t, torch.Tensor):
            self.info[id(t)] = info
            self.keep.append(t)

    def mark_input(self, t):
        self.put(t, _Info(raw=True))

    def use(self, name: str) -> Use:
        return self.uses.setdefault(name, Use())

    # -- the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name in _SCALARS and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta":
            return _fake_scalar(name, args[0])
        out = func(*args, **kwargs)
        try:
            self.observe(func, args, kwargs, out)
        except Exception:  # noqa: BLE001 - a bookkeeping miss only loses that op's facts
            pass
        return out

    def observe(self, func, args, kwargs, out):
        name = _name(func)
        flat_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        infos = [self.get(a) for a in flat_in]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if name == "__setitem__" and args and isinstance(args[0], torch.Tensor):
            self._write(args[0], infos)
            return
        if not outs:
            return
        if name in LOSSES:  # the prediction arguments' last weights are output layers (the kwarg is ``input``)
            preds = [a for a in list(args[:LOSSES[name]]) + [kwargs.get("input")] if isinstance(a, torch.Tensor)]
            self.ends.update(p for a in preds for p in self.get(a).last)
        if self._matrix(name, func, args, kwargs, out) is not None:
            return
        if name in ("embedding", "embedding_bag"):
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            wi = self.get(w)
            if wi.param:
                self.use(wi.param).ops.add("embedding")
            for o in outs:
                self.put(o, _Info(weighted=True))
            return
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        fi = self.get(first) if first is not None else _Info()
        if fi.param and flat_in[0] is first and self._param_view(func, name, args, kwargs, first, fi, outs):
            return
        for a, i in zip(flat_in, infos):  # any other use of a parameter: elementwise, gathered
            if i.param:
                self.use(i.param).ops.add("elementwise" if name not in PIECES else "index")
        weighted = any(i.weighted for i in infos)
        raw = any(i.raw for i in infos) and not weighted
        pooled = any(i.pooled for i in infos) or name in POOLS or (
            name in ("__getitem__", "select") and first is not None and outs[0].ndim < first.ndim)
        last = _provenance(name, infos)
        comps = [(a, i.comp) for a, i in zip(flat_in, infos) if i.comp is not None]
        comp_out: List[Optional[Tuple[str, torch.Tensor]]] = [None] * len(outs)
        if comps:
            comp_out = self._follow(name, func, args, kwargs, flat_in, infos, comps, outs)
        for o, c in zip(outs, comp_out):
            self.put(o, _Info(raw=raw, weighted=weighted, last=last, comp=c, pooled=pooled))

    def _param_view(self, func, name, args, kwargs, first, fi: _Info, outs) -> bool:
        """``first`` is (a view of) a parameter: record each output that is still one, with where its elements
        sit in the stored tensor (the view algebra: the op replayed on a meta tensor of the same strides)."""
        if name in SAME and all(tuple(o.shape) == tuple(first.shape) for o in outs):
            views = [fi.view] * len(outs)
        elif name in COPIES or all(views_into(o, first) for o in outs):  # (a copy replays to None: layout unknown)
            views = replay(func, args, kwargs, first, fi.view, len(outs)) or [None] * len(outs)
        elif name == "__getitem__" and tensor_index(args):
            # W[idx]: rows picked (a copy); of a stack, its matrices per token or expert, last two axes as stored
            stack = len(self.shapes[fi.param]) >= 3
            for o in outs:
                self.put(o, _Info(param=fi.param, view=(tuple(o.shape), row_major(o.shape), 0) if stack else None,
                                  gathered=stack))
            if not stack:
                self.use(fi.param).ops.add("index")
            return True
        else:
            return False
        numel = math.prod(self.shapes[fi.param])
        u = self.use(fi.param)  # the forward reads it (as what: the op its views reach says)
        for o, v in zip(outs, views):
            self.put(o, _Info(param=fi.param, view=v, gathered=fi.gathered))
            if not fi.gathered and (v is None or extent(v) < numel):
                u.ops.add("index")  # a slice, an index, a piece of it
        return True

    def _matrix(self, name, func, args, kwargs, out):
        """A weight applied as a linear map: record its use and start its output's companion."""
        op, w, data, feat_axis, in_out = None, None, None, -1, None
        a = list(args) + [kwargs.get(k) for k in ("input", "weight", "bias") if k in kwargs]
        if name == "linear":
            op, data, w, in_out = "linear", a[0], a[1], False
        elif name.startswith("conv") and name[4:5].isdigit() or name.startswith("conv_transpose"):
            op, data, w, feat_axis, in_out = "conv", a[0], a[1], 1, False
        elif name in ("matmul", "__matmul__", "bmm", "mm", "__rmatmul__"):
            x, y = (a[1], a[0]) if name == "__rmatmul__" else (a[0], a[1])
            if self.get(y).param:
                op, data, w, in_out = ("bmm" if name == "bmm" or y.ndim >= 3 else "matmul"), x, y, True
            elif self.get(x).param:
                op, data, w, in_out, feat_axis = "matmul", y, x, False, -2
        elif name in ("addmm", "baddbmm", "addbmm"):
            x, y = a[1], a[2]
            if self.get(y).param:
                op, data, w, in_out = name, x, y, True
            elif self.get(x).param:
                op, data, w, in_out, feat_axis = name, y, x, False, -2
        elif name in ("_grouped_mm", "grouped_mm"):
            op, data, w, in_out = "grouped_mm", a[0], a[1], True
        elif name in ("einsum", "tensordot"):
            return self._equation(name, args, kwargs, out)
        if op is None or not isinstance(w, torch.Tensor):
            return None
        wi, di = self.get(w), self.get(data)
        if not wi.param:
            return None
        u = self.use(wi.param)
        u.ops.add(op)
        shape = self.shapes[wi.param]
        if op in ("linear", "matmul", "mm", "addmm") and w.ndim == 2 and len(shape) != 2 and not wi.gathered:
            # a 2-D view of an N-D parameter applied as a matrix ([H, hd, D] as [H·hd, D], a slice of a stack):
            # which stored axes are its rows and columns (and which pick matrices of a stack)
            if op == "linear" or in_out:  # x W^T, x W: the parameter is the second operand
                eq, ranks, k = ("...i,oi->...o" if op == "linear" else "...i,io->...o"), [data.ndim, 2], 1
            else:  # W x
                eq, ranks, k = ("oi,i->o" if data.ndim == 1 else "oi,...in->...on"), [2, data.ndim], 0
            self._read(u, eq, ranks, k, wi, wi.param)
            u.input_layer |= di.raw
            self.put(out if isinstance(out, torch.Tensor) else None,
                     _Info(weighted=True, last=frozenset({wi.param})))
            return op
        transposed = swapped(wi.view)
        stored = None if transposed is None else in_out ^ transposed
        if op != "conv" and stored is not None:
            u.stored_in_out = stored if u.stored_in_out is None else (u.stored_in_out if u.stored_in_out == stored
                                                                       else None)
        u.experts = u.experts or len(shape) >= 3 and op != "conv"
        u.input_layer |= di.raw
        u.pooled_input |= di.pooled
        o = out if isinstance(out, torch.Tensor) else None
        if o is None:
            return op
        comp = None
        n = int(o.shape[feat_axis]) if o.ndim else 0
        u.features = n
        if o.numel() > (CONV_COMPANION_CAP if op == "conv" else COMPANION_CAP):
            u.unread = True
        elif o.numel() > 0 and o.ndim >= 1:
            idx = torch.arange(n, dtype=torch.int32)
            sh = [1] * o.ndim
            sh[feat_axis] = n
            comp = (wi.param, idx.view(sh).expand(tuple(o.shape)).contiguous())
        self.put(o, _Info(weighted=True, last=frozenset({wi.param}), comp=comp))
        return op

    def _equation(self, name, args, kwargs, out):
        """``einsum``/``tensordot`` with a parameter: the map its equation applies (:mod:`.equations`)."""
        if name == "einsum":
            eq = args[0] if args and isinstance(args[0], str) else kwargs.get("equation")
            ts = [t for t in tree_flatten((args[1:], kwargs.get("operands", ())))[0] if isinstance(t, torch.Tensor)]
        else:
            ts = [t for t in (list(args[:2]) + [kwargs.get("a"), kwargs.get("b")]) if isinstance(t, torch.Tensor)][:2]
            dims = args[2] if len(args) > 2 else kwargs.get("dims", 2)
            eq = tensordot_equation(ts[0].ndim, ts[1].ndim, dims) if len(ts) == 2 else None
        infos = [self.get(t) for t in ts]
        params = [k for k, i in enumerate(infos) if i.param]
        if not params:
            return None
        for k in params:
            u = self.use(infos[k].param)
            u.ops.add(name)
            self._read(u, eq, [t.ndim for t in ts], k, infos[k], infos[k].param)
            others = [j for n, j in enumerate(infos) if n != k]
            if any(j.raw for j in others) and not any(j.weighted for j in others):
                u.input_layer = True
            if any(j.pooled for j in others):
                u.pooled_input = True
        last = frozenset({infos[params[0]].param}) if len(params) == 1 else frozenset()
        self.put(out if isinstance(out, torch.Tensor) else None, _Info(weighted=True, last=last))
        return name

    def _read(self, u: Use, eq, ranks, k: int, info: _Info, pname: str) -> None:
        """Record the map ``eq`` applies with operand ``k`` (a view of parameter ``pname`` at ``info.view``)."""
        shape = self.shapes[pname]
        seen = axes(info.view, shape) if isinstance(eq, str) and not info.gathered else None
        a = read_equation(eq, ranks, k, seen[0], len(shape), seen[1]) if seen is not None else None
        if a is None:
            u.applied_unread = u.applied_unread or f"{eq!r} does not apply it as a linear map of its input"
        elif u.applied is not None and u.applied.roles != a.roles:
            u.applied_unread = f"{u.applied.equation!r} and {eq!r} apply it as different maps"
        elif u.applied is None:
            u.applied = a

    def _follow(self, name, func, args, kwargs, flat_in, infos, comps, outs):
        """The companion of each output (None where the op mixes features or is not a rearrangement)."""
        none = [None] * len(outs)
        src, (pname, comp) = comps[0]
        if args and args[0] is src and (name in SAME | RESHAPES or all(views_into(o, src) for o in outs)):
            if name in SAME:
                return [(pname, comp)] * len(outs) if all(o.shape == comp.shape for o in outs) else none
            rest = [a for a in tree_flatten((args[1:], kwargs))[0] if isinstance(a, torch.Tensor)]
            if rest:  # an index tensor (advanced indexing): the pieces are not a split we can read
                return none
            res = func(comp, *args[1:], **kwargs)
            res = list(res) if isinstance(res, (tuple, list)) else [res]
            if len(res) != len(outs) or any(tuple(r.shape) != tuple(o.shape) for r, o in zip(res, outs)):
                return none
            if any(r.numel() < comp.numel() for r in res):  # pieces of it: perhaps a split of the features
                self.pieces.setdefault(id(src), []).extend(res)
                self.sources[id(src)] = (pname, comp)
                self.keep.append(src)
            return [(pname, r) for r in res]
        if name in UNARY and len(comps) == 1 and len(outs) == 1 and outs[0].shape == comp.shape:
            return [(pname, comp)]
        if name in LINEAR_BIN | PRODUCT_BIN and len(outs) == 1:
            others = [i for a, i in zip(flat_in, infos) if i.comp is None and (i.weighted or i.last)]
            if len(comps) == 1:
                if others or outs[0].shape != comp.shape:
                    return none
                return [(pname, comp)]
            (_, (p1, c1)), (_, (p2, c2)) = comps[0], comps[1]
            if c1.shape != c2.shape or outs[0].shape != c1.shape:
                return none
            if p1 != p2:  # a low-rank adapter added to its base layer (LoRA): the base layer's features
                return [(p1, c1)] if name in LINEAR_BIN else none
            if torch.equal(c1, c2):
                return [(p1, c1)]
            if name in LINEAR_BIN:  # pieces added back together (a rotary embedding): one map, not blocks
                self.mixed.append((p1, c1, c2))
                return [(p1, c1)]
            return none
        if name in CAT and len(outs) == 1:
            if len(comps) != len(flat_in) or len({p for _, (p, _) in comps}) != 1:
                return none
            res = func([c for _, (_, c) in comps], *args[1:], **kwargs)
            if tuple(res.shape) != tuple(outs[0].shape):
                return none
            self.rejoined.append((pname, res))
            return [(pname, res)]
        return none

    # -- the end
    def _write(self, dst: torch.Tensor, infos: Sequence[_Info]) -> None:
        """``dst[idx] = value`` returns nothing: the destination (and what it is a view of) is its output, with the
        writers' weights beside its own, as a concatenation's (a decoder writing its chunks into one buffer)."""
        for t in [t for t in (dst, dst._base) if t is not None]:
            held = self.get(t)
            sets = [i for i in infos if i.last or i.weighted] + [held]
            weighted = any(i.weighted for i in sets)
            self.put(t, dataclasses.replace(held, raw=held.raw and not weighted, weighted=weighted,
                                            last=_provenance("__setitem__", sets)))

    def finish(self, outputs: Sequence[torch.Tensor]) -> Dict[str, Use]:
        for p in ({p for t in outputs for p in self.get(t).last} | self.ends) & set(self.uses):
            self.use(p).head = True
        for pname, blocks in output_blocks(self.uses, self.pieces, self.sources, self.rejoined, self.mixed).items():
            self.uses[pname].blocks = blocks
        return self.uses


# -- the provenance rule ----------------------------------------------------------------------------
def _provenance(name: str, infos: Sequence[_Info]) -> frozenset:
    """The weights that last produced an op's output: the union of its inputs' (a stack, a concatenation, a
    choice, a cast, a soft-cap, a sort keep every weight whose output they pass on), except where the op sums or
    multiplies the outputs of different weights together (:data:`MIXING`: a residual stream, attention
    scores), which no single weight produced."""
    sets = [i.last for i in infos if i.last or i.weighted]
    if not sets or name in MIXING and len(set(sets)) > 1:
        return frozenset()
    return frozenset().union(*sets)
