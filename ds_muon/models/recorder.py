"""The tracing mode: a ``TorchFunctionMode`` that follows every tensor a meta forward makes, and records for
each parameter what consumes it (:class:`Use`; what each field means: :mod:`.trace`).

Each tensor the forward makes carries an :class:`_Info`: whether it is still the model's raw input, which
weights' outputs it is (unmixed), the parameter it is a view of, and a small integer *companion* holding each
element's output-feature index, on which every split of a weight's output is replayed.

Over 400 lines: one mode whose op families (views, pieces, products, concatenations, pools, the linear maps
and equations) read and write the same per-tensor state, so they stay in one class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .equations import Applied, read as read_equation, tensordot_equation
from .meta import _SCALARS, _fake_scalar, _name


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
    heads: frozenset = frozenset()  # weights whose output this is, unmixed
    param: Optional[str] = None  # a view of this parameter (transforms in pview)
    transposed: bool = False
    gathered: bool = False  # rows of a stack picked per token/expert (W[idx])
    comp: Optional[Tuple[str, torch.Tensor]] = None  # (param, feature index of each element)
    pooled: bool = False  # pooled, reduced or tokens picked since the last weight


_VIEWS = {"view", "reshape", "permute", "transpose", "t", "contiguous", "clone", "flatten", "unflatten", "squeeze",
          "unsqueeze", "expand", "movedim", "swapaxes", "swapdims", "expand_as", "view_as", "reshape_as"}
_SAME = {"to", "type", "float", "half", "bfloat16", "double", "detach", "requires_grad_", "__get__", "cpu", "cuda",
         "dropout", "alpha_dropout", "feature_alpha_dropout"}
_PIECES = {"chunk", "split", "unbind", "tensor_split", "split_with_sizes", "__getitem__", "narrow", "select"}
_UNARY = {"neg", "__neg__", "silu", "gelu", "relu", "sigmoid", "tanh", "softplus", "exp", "clamp", "clip", "abs",
          "leaky_relu", "elu", "mish", "hardswish", "hardsigmoid", "relu6", "square", "sqrt", "rsqrt", "log",
          "sin", "cos", "pow", "__pow__", "silu_", "relu_", "gelu_", "sigmoid_", "tanh_", "clamp_", "float_power"}
_LINEAR_BIN = {"add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__", "__isub__", "sub_"}
_PRODUCT_BIN = {"mul", "__mul__", "__rmul__", "__imul__", "mul_", "div", "__truediv__", "__rtruediv__",
                "__itruediv__", "div_", "true_divide"}
_CAT = {"cat", "concat", "concatenate", "stack"}
_POOLS = {"mean", "sum", "amax", "amin", "logsumexp", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
          "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
          "max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices", "max_pool2d_with_indices"}


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

    # -- bookkeeping
    def get(self, t) -> _Info:
        if not isinstance(t, torch.Tensor):
            return _Info()
        i = self.info.get(id(t))
        if i is not None:
            return i
        if id(t) in self.params:
            return _Info(param=self.params[id(t)])
        return _Info()

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
        if not outs:
            return
        matrix = self._matrix(name, func, args, kwargs, out)
        if matrix is not None:
            return
        if name in ("embedding", "embedding_bag"):
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            wi = self.get(w)
            if wi.param:
                self.use(wi.param).ops.add("embedding")
            for o in outs:
                self.put(o, _Info(weighted=True, heads=frozenset()))
            return
        # a view of a parameter (transposed, per expert, reshaped)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        fi = self.get(first) if first is not None else _Info()
        if fi.param and len(flat_in) >= 1 and flat_in[0] is first and name in (_VIEWS | _SAME | _PIECES | {"T", "mT"}):
            transposed = fi.transposed ^ (name in ("t", "T", "mT") or (name in ("transpose", "swapaxes", "swapdims")
                                                                          and _last_two(args, first))
                                          or (name == "permute" and _swaps_last_two(args, first)))
            gathered = fi.gathered or (name == "__getitem__" and first.ndim >= 3 and _first_axis_index(args))
            for o in outs:
                self.put(o, _Info(param=fi.param, transposed=transposed, gathered=gathered))
            if name not in _VIEWS and name not in _SAME and name not in ("T", "mT") and not gathered:
                self.use(fi.param).ops.add("index")
            return
        for a, i in zip(flat_in, infos):  # any other use of a parameter: elementwise, gathered
            if i.param:
                self.use(i.param).ops.add("elementwise" if name not in _PIECES else "index")
        weighted = any(i.weighted for i in infos)
        raw = any(i.raw for i in infos) and not weighted
        pooled = any(i.pooled for i in infos) or name in _POOLS or (
            name in ("__getitem__", "select") and first is not None and outs[0].ndim < first.ndim)
        heads = _merge_heads(infos)
        comps = [(a, i.comp) for a, i in zip(flat_in, infos) if i.comp is not None]
        comp_out: List[Optional[Tuple[str, torch.Tensor]]] = [None] * len(outs)
        if comps:
            comp_out = self._follow(name, func, args, kwargs, flat_in, infos, comps, outs)
        for o, c in zip(outs, comp_out):
            self.put(o, _Info(raw=raw, weighted=weighted, heads=heads, comp=c, pooled=pooled))

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
        if op in ("linear", "matmul", "mm", "addmm") and w.ndim == 2 and len(shape) != 2:
            # a reshaped view applied as a matrix ([H, hd, D] as [H·hd, D]): which stored axes are in and out
            if op == "linear" or in_out:  # x W^T, x W: the parameter is the second operand
                eq, ranks, k = ("...i,oi->...o" if op == "linear" else "...i,io->...o"), [data.ndim, 2], 1
            else:  # W x
                eq, ranks, k = ("oi,i->o" if data.ndim == 1 else "oi,...in->...on"), [2, data.ndim], 0
            self._read(u, eq, ranks, k, w, wi.param)
            if di.raw:
                u.input_layer = True
            self.put(out if isinstance(out, torch.Tensor) else None,
                     _Info(weighted=True, heads=frozenset({wi.param})))
            return op
        stored = in_out ^ wi.transposed
        if op != "conv":
            u.stored_in_out = stored if u.stored_in_out is None else (u.stored_in_out if u.stored_in_out == stored
                                                                       else None)
        u.experts = u.experts or len(shape) >= 3 and op != "conv"
        if di.raw:
            u.input_layer = True
        if di.pooled:
            u.pooled_input = True
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
        self.put(o, _Info(weighted=True, heads=frozenset({wi.param}), comp=comp))
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
            self._read(u, eq, [t.ndim for t in ts], k, ts[k], infos[k].param)
            others = [j for n, j in enumerate(infos) if n != k]
            if any(j.raw for j in others) and not any(j.weighted for j in others):
                u.input_layer = True
            if any(j.pooled for j in others):
                u.pooled_input = True
        heads = frozenset({infos[params[0]].param}) if len(params) == 1 else frozenset()
        self.put(out if isinstance(out, torch.Tensor) else None, _Info(weighted=True, heads=heads))
        return name

    def _read(self, u: Use, eq, ranks, k: int, t: torch.Tensor, pname: str) -> None:
        """Record the map ``eq`` applies with operand ``k`` (``t``, a view of parameter ``pname``)."""
        shape = self.shapes[pname]
        spans = _spans(t, shape) if isinstance(eq, str) else None
        a = read_equation(eq, ranks, k, spans, len(shape)) if spans is not None else None
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
        if name in _VIEWS | _SAME | _PIECES | {"T", "mT"} and args and args[0] is src:
            if name in _SAME or name in ("contiguous", "clone"):
                return [(pname, comp)] * len(outs) if all(o.shape == comp.shape for o in outs) else none
            rest = [a for a in tree_flatten((args[1:], kwargs))[0] if isinstance(a, torch.Tensor)]
            if rest:  # an index tensor (advanced indexing): the pieces are not a split we can read
                return none
            res = func(comp, *args[1:], **kwargs)
            res = list(res) if isinstance(res, (tuple, list)) else [res]
            if len(res) != len(outs) or any(tuple(r.shape) != tuple(o.shape) for r, o in zip(res, outs)):
                return none
            if name in _PIECES:
                self.pieces.setdefault(id(src), []).extend(res)
                self.sources[id(src)] = (pname, comp)
                self.keep.append(src)
            return [(pname, r) for r in res]
        if name in _UNARY and len(comps) == 1 and len(outs) == 1 and outs[0].shape == comp.shape:
            return [(pname, comp)]
        if name in _LINEAR_BIN | _PRODUCT_BIN and len(outs) == 1:
            others = [i for a, i in zip(flat_in, infos) if i.comp is None and (i.weighted or i.heads)]
            if len(comps) == 1:
                if others or outs[0].shape != comp.shape:
                    return none
                return [(pname, comp)]
            (_, (p1, c1)), (_, (p2, c2)) = comps[0], comps[1]
            if c1.shape != c2.shape or outs[0].shape != c1.shape:
                return none
            if p1 != p2:  # a low-rank adapter added to its base layer (LoRA): the base layer's features
                return [(p1, c1)] if name in _LINEAR_BIN else none
            if torch.equal(c1, c2):
                return [(p1, c1)]
            if name in _LINEAR_BIN:  # pieces added back together (a rotary embedding): one map, not blocks
                self.mixed.append((p1, c1, c2))
                return [(p1, c1)]
            return none
        if name in _CAT and len(outs) == 1:
            if len(comps) != len(flat_in) or len({p for _, (p, _) in comps}) != 1:
                return none
            res = func([c for _, (_, c) in comps], *args[1:], **kwargs)
            if tuple(res.shape) != tuple(outs[0].shape):
                return none
            self.rejoined.append((pname, res))
            return [(pname, res)]
        return none

    # -- the end
    def finish(self, outputs: Sequence[torch.Tensor]) -> Dict[str, Use]:
        for t in outputs:
            for p in self.get(t).heads:
                self.use(p).head = True
        splits: Dict[str, List[torch.Tensor]] = {}  # param -> per split: piece id of each feature (-1: not in)
        for sid, pieces in self.pieces.items():
            pname, comp = self.sources[sid]
            n = self.uses[pname].features or int(comp.max()) + 1
            whole = _present(comp, n)
            sets: List[torch.Tensor] = []
            for pc in pieces:
                m = _present(pc, n)
                if torch.equal(m, whole):
                    continue  # a piece with every feature: rows or tokens picked, not a split
                if not any(torch.equal(m, t) for t in sets):
                    sets.append(m)
            if len(sets) < 2 or not torch.equal(torch.stack(sets).sum(0), whole.long()):
                continue  # not a partition of the features
            if any(r.shape == comp.shape and torch.equal(r, comp) for p, r in self.rejoined if p == pname):
                continue  # concatenated back as it was
            piece_of = torch.full((n,), -1, dtype=torch.int64)
            for k, m in enumerate(sets):
                piece_of[m] = k
            splits.setdefault(pname, []).append(piece_of)
        for pname, c1, c2 in self.mixed:  # splits whose pieces are added together again are undone
            if pname not in splits:
                continue
            a, b = c1.reshape(-1).long(), c2.reshape(-1).long()
            kept = []
            for piece_of in splits[pname]:
                pa, pb = piece_of[a], piece_of[b]
                if not bool(((pa != pb) & (pa >= 0) & (pb >= 0)).any()):
                    kept.append(piece_of)
            splits[pname] = kept
        for pname, plist in splits.items():
            if not plist:
                continue
            u = self.uses[pname]
            n = int(plist[0].numel())
            sig = torch.stack(plist, dim=1)  # [features, splits]
            groups: Dict[tuple, List[int]] = {}
            for f in range(n):
                groups.setdefault(tuple(sig[f].tolist()), []).append(f)
            if len(groups) > 1:
                u.blocks = sorted(groups.values(), key=lambda g: g[0])
        return self.uses


def _present(comp: torch.Tensor, n: int) -> torch.Tensor:
    """Which of the ``n`` output features a companion holds (a mask)."""
    return torch.bincount(comp.reshape(-1).long(), minlength=n)[:n] > 0


def _last_two(args, t) -> bool:
    dims = [a for a in args[1:3] if isinstance(a, int)]
    if len(dims) != 2:
        return False
    nd = t.ndim
    return sorted(d % nd for d in dims) == [nd - 2, nd - 1]


def _swaps_last_two(args, t) -> bool:
    """``permute(dims)`` that swaps the last two axes and keeps the others (a 2-D ``w.permute(1, 0)``)."""
    dims = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    nd = t.ndim
    if len(dims) != nd or nd < 2 or not all(isinstance(d, int) for d in dims):
        return False
    return [d % nd for d in dims] == list(range(nd - 2)) + [nd - 1, nd - 2]


def _first_axis_index(args) -> bool:
    """``W[idx]`` / ``W[e]``: rows of the first axis of a stack picked (per expert)."""
    if len(args) < 2:
        return False
    idx = args[1]
    if isinstance(idx, tuple):
        idx = idx[0] if idx else None
    return isinstance(idx, (int, torch.Tensor))


def _spans(t: torch.Tensor, shape) -> Optional[List[Tuple[int, ...]]]:
    """The axes of the contiguous stored ``shape`` that each axis of ``t`` spans, where ``t`` is a view of
    it (reshaped, permuted: read from its strides); None where it is not (a slice, an expanded view)."""
    numel = 1
    for n in shape:
        numel *= int(n)
    if t.numel() != numel or t.layout != torch.strided:
        return None
    stored, st = [], 1
    for n in reversed(shape):
        stored.insert(0, (st, st * int(n)))
        st *= int(n)
    axes = sorted((int(s), int(n), k) for k, (n, s) in enumerate(zip(t.shape, t.stride())) if n > 1)
    expect = 1
    for s, n, _ in axes:
        if s != expect:
            return None
        expect *= n
    spans: List[Tuple[int, ...]] = [()] * t.ndim
    for s, n, k in axes:
        spans[k] = tuple(j for j, (lo, hi) in enumerate(stored) if hi > lo and lo < s * n and hi > s)
    return spans


def _merge_heads(infos) -> frozenset:
    """The weight whose output this is: the one every weighted input comes from alone (a bias, a cast, a
    constant keep it; a residual stream or another weight's output added to it mixes it away)."""
    sets = {i.heads for i in infos if i.heads or i.weighted}
    return next(iter(sets)) if len(sets) == 1 else frozenset()
