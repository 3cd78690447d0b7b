"""Where each element of a view of a parameter sits in its stored tensor, and which stored axes the view's axes
run over: the one view algebra of the trace (:mod:`.recorder`).

A view is ``(sizes, strides, offset)`` into the parameter's row-major storage.  Any chain of views the forward
takes of a parameter (a slice, an integer or list-free index, ``flatten``/``unflatten``, ``view``, ``reshape``,
``permute``, ``transpose``/``.T``/``mT``, ``unbind``, ``chunk``, ``split``, ``narrow``, ``expand``) composes by
replaying each op on a meta tensor laid out at the view so far (:func:`replay`): torch's own stride rules do
the algebra, for every op that returns a view, with no list of them.  :func:`axes` then reads which stored
axes each axis of the final view runs over, which it broadcasts, and which it takes only part or one index of
(those pick matrices of a stack, as ``qkvo_w[:3]`` and ``qkvo_w[3]`` do).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten

View = Tuple[Tuple[int, ...], Tuple[int, ...], int]  # (sizes, strides, offset) into a parameter's stored elements


def row_major(shape) -> Tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, st = [], 1
    for n in reversed(tuple(shape)):
        strides.insert(0, st)
        st *= int(n)
    return tuple(strides)


def views_into(o: torch.Tensor, src: torch.Tensor) -> bool:
    """Is ``o`` a view of ``src``'s elements (the same storage, another tensor)?"""
    root = src._base if src._base is not None else src
    return o is not src and o._base is not None and o._base is root


def replay(func, args, kwargs, first: torch.Tensor, view: Optional[View], n: int) -> Optional[List[View]]:
    """Where the elements of each output of the view op ``func(first, *args[1:])`` sit in the parameter's
    storage, ``first`` sitting at ``view``: the op replayed on a meta tensor laid out at ``view`` (any chain
    of slices, indices, reshapes, permutes, splits and expands composes so; None where one copies)."""
    if view is None:
        return None
    sizes, strides, offset = view
    span = offset + sum((s - 1) * st for s, st in zip(sizes, strides) if s > 0) + 1
    base = torch.empty(max(span, 1), device="meta", dtype=first.dtype)
    shadow = base.as_strided(sizes, strides, offset)
    res = [r for r in tree_flatten(func(shadow, *args[1:], **kwargs))[0] if isinstance(r, torch.Tensor)]
    if len(res) != n or any(r._base is not base for r in res):
        return None
    return [(tuple(r.shape), tuple(r.stride()), int(r.storage_offset())) for r in res]


def tensor_index(args) -> bool:
    """``W[idx]`` with an index tensor on the first axis (rows of a stack picked per token or expert)."""
    idx = args[1] if len(args) >= 2 else None
    if isinstance(idx, tuple):
        idx = idx[0] if idx else None
    return isinstance(idx, torch.Tensor) and idx.ndim >= 1


def extent(view: View) -> int:
    """How many distinct stored elements a view reaches (a broadcast axis counts once)."""
    return math.prod(int(n) for n, st in zip(view[0], view[1]) if st != 0)


def swapped(view: Optional[View]) -> Optional[bool]:
    """Are a view's last two axes stored in the other order (``W.T``, ``W.mT``, ``transpose(-1, -2)``)?  None
    where the view is unknown."""
    if view is None or len(view[0]) < 2:
        return None if view is None else False
    (r, c), (sr, sc) = view[0][-2:], view[1][-2:]
    if r == 1 or c == 1:
        return False
    return sr < sc


def axes(view: Optional[View], shape) -> Optional[Tuple[List[Optional[Tuple[int, ...]]], Tuple[int, ...]]]:
    """The stored axes each axis of a view runs over (``()`` for a size-1 axis, None for a broadcast one), and
    the stored axes it holds only some of, or one index of (a slice or an index: those pick matrices of a
    stack); None where the view is no such product (overlapping or irregular strides).

    A stored axis a view splits (``[H·hd, D]`` viewed ``[H, hd, D]``) is first cut into the parts the view
    sees, so each axis of the view runs over whole parts, or over some of the outermost one (a slice)."""
    if view is None:
        return None
    sizes, strides = [int(n) for n in view[0]], [int(st) for st in view[1]]
    parts = _parts(shape, {b for n, st in zip(sizes, strides) if n > 1 and st > 0 for b in (st, st * n)})
    part_strides = row_major([n for _, n in parts])
    covered = [1] * len(parts)
    spans: List[Optional[Tuple[int, ...]]] = []
    for n, st in zip(sizes, strides):
        if n == 1:
            spans.append(())
            continue
        if st == 0:
            spans.append(None)
            continue
        j = next((j for j, (_, m) in enumerate(parts) if part_strides[j] == st and m > 1), None)
        if j is None:
            return None
        left, run = n, set()
        while left > 1:
            if j < 0:
                return None
            m = parts[j][1]
            if m > 1:
                if covered[j] != 1:
                    return None  # two axes of the view over one stored axis: a diagonal, not a matrix
                take = min(m, left)
                if left % take:
                    return None
                covered[j], left = take, left // take
                run.add(parts[j][0])
            j -= 1
        spans.append(tuple(sorted(run)))
    members = tuple(sorted({a for (a, m), c in zip(parts, covered) if m > 1 and c < m}))
    return spans, members


def _parts(shape, bounds) -> List[Tuple[int, int]]:
    """``shape``'s axes cut where a view's axes start or end inside one (at a divisor of its size): ``(stored
    axis, size)`` per part, outermost first."""
    parts = [(j, int(n)) for j, n in enumerate(shape)]
    for b in sorted(bounds):
        strides = row_major([n for _, n in parts])
        for k, ((a, m), st) in enumerate(zip(parts, strides)):
            if st < b < st * m and b % st == 0 and m % (b // st) == 0:
                parts[k:k + 1] = [(a, m // (b // st)), (a, b // st)]
                break
    return parts
