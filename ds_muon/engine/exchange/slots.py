"""The matrix slots of a tagged tensor: which logical matrices it holds and which part
of each a rank has, for adapters to put in a :class:`~ds_muon.engine.exchange.layout.ParamBinding`.

:func:`logical_blocks` reads the tags of :mod:`ds_muon.models.tags` (split rows, expert
stacks, row axes) into contiguous ranges of the tensor's row-major flattening;
:func:`block_slots` clips them to the range a rank holds; :func:`tp_slots` does the
same for a :func:`~ds_muon.models.tags.tensor_parallel` shard.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .layout import MatrixSlot, Piece, global_shape, matrix_shape, slots_in_range
from ...tensors.tag_keys import BLOCKS, EXPERTS, SPLIT_ROWS, TENSOR_PARALLEL, is_transposed, row_axes_of

Block = Tuple[str, Tuple[int, int], int]  # key, 2-D shape, start in the tensor's row-major flattening

def logical_blocks(param: torch.Tensor, name: str, shape: Optional[Sequence[int]] = None) -> List[Block]:
    """The logical matrices of a tensor of global ``shape`` (default ``param.shape``).

    Each is ``(key, (rows, cols), start)``: a contiguous range of the tensor's
    row-major flattening.  An untagged tensor is one matrix keyed ``name`` with
    its own shape (conv weights stay ``[out, in·k·k]``); one tagged
    :func:`~ds_muon.models.tags.row_axes` is ``[prod(shape[:k]), rest]``; blocks are keyed
    ``name[label]``, experts ``name[e]``.
    """
    shape = tuple(int(s) for s in (global_shape(param) if shape is None else shape))
    if getattr(param, BLOCKS, None) is not None:
        return [(k, bshape, off) for k, bshape, off, _, _ in strided_blocks(param, name, shape)]
    split, k = getattr(param, SPLIT_ROWS, None), row_axes_of(param)
    if getattr(param, EXPERTS, False):
        if len(shape) < 3:
            raise ValueError(f"ds_muon: {name} is tagged expert_weight but has shape {shape}; expected [E, out, in]")
        mshape = member_matrix(shape[1:], k, name)
        size = mshape[0] * mshape[1]
        bases = [(f"{name}[{e}]", e * size) for e in range(shape[0])]
    else:
        if split is None and k == 1:
            return [(name, shape, 0)]
        mshape = member_matrix(shape, k, name)
        bases = [(name, 0)]
    if split is None:
        return [(key, mshape, s) for key, s in bases]
    total = sum(n for _, n in split)
    if total != mshape[0]:
        raise ValueError(
            f"ds_muon: {name}: split_rows sizes {[n for _, n in split]} add up to {total} rows but the matrix "
            f"has {mshape[0]} (shape {shape}{', per expert' if getattr(param, EXPERTS, False) else ''})")
    out = []
    for key, start in bases:
        r0 = 0
        for label, n in split:
            out.append((f"{key}[{label}]", (n, mshape[1]), start + r0 * mshape[1]))
            r0 += n
    return out


def member_matrix(shape: Sequence[int], row_axes: int, name: str) -> Tuple[int, int]:
    """The matrix of one tensor (or stack member) of ``shape`` whose first ``row_axes`` axes are its rows."""
    if not 1 <= row_axes < len(shape):
        raise ValueError(f"ds_muon: {name} is tagged row_axes={row_axes} but a matrix of shape {tuple(shape)} "
                         f"has {len(shape)} axes; rows are 1 to {len(shape) - 1} leading axes")
    return matrix_shape(shape, row_axes)


StridedBlock = Tuple[str, Tuple[int, int], int, Tuple[int, ...], Tuple[int, ...]]


def strided_blocks(param: torch.Tensor, name: str, shape: Optional[Sequence[int]] = None) -> List[StridedBlock]:
    """The :func:`~ds_muon.models.tags.fused_blocks` of a tensor: ``(key, (rows, cols), offset, sizes, strides)``,
    each block the 4-D view ``[row runs, run rows, col runs, run cols]`` of the tensor's row-major
    flattening from ``offset`` (its row-major order is the block's)."""
    shape = tuple(int(s) for s in (global_shape(param) if shape is None else shape))
    k = row_axes_of(param)
    if getattr(param, EXPERTS, False):
        rows, cols = member_matrix(shape[1:], k, name)
        bases = [(f"{name}[{e}]", e * rows * cols) for e in range(shape[0])]
    else:
        rows, cols = member_matrix(shape, k, name)
        bases = [(name, 0)]
    out = []
    for key, base in bases:
        for label, (r0, rl, rn, rp), (c0, cl, cn, cp) in getattr(param, BLOCKS):
            out.append((f"{key}[{label}]", (rn * rl, cn * cl), base + r0 * cols + c0,
                        (rn, rl, cn, cl), (rp * cols, cols, cp, 1)))
    return out


def _position(i: int, sizes, strides) -> int:
    """Where element ``i`` (row-major) of a strided view sits in the flattening it views."""
    pos = 0
    for n, st in zip(reversed(sizes), reversed(strides)):
        i, r = divmod(i, n)
        pos += r * st
    return pos


def _count_before(x: int, offset: int, sizes, strides, numel: int) -> int:
    """How many elements of a strided block (positions increase with the index) sit before ``x``."""
    lo, hi = 0, numel
    while lo < hi:
        mid = (lo + hi) // 2
        if offset + _position(mid, sizes, strides) < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _range_views(sizes, strides, a: int, b: int) -> list:
    """Elements ``[a, b)`` (row-major) of a strided view as few strided views, in order:
    ``[(start index, sizes, strides), ...]`` (one where a rank holds whole runs, more where a flat
    shard cuts a run)."""
    views, pos = [], a
    while pos < b:
        for k in range(len(sizes)):  # the coarsest dim whose whole sub-blocks start here
            inner = math.prod(sizes[k + 1:])
            if pos % inner:
                continue
            end = min(b, (pos // (inner * sizes[k]) + 1) * inner * sizes[k])
            count = (end - pos) // inner
            if count >= 1:
                views.append((pos, (count,) + tuple(sizes[k + 1:]), tuple(strides[k:])))
                pos += count * inner
                break
    return views


def _strided_slots(param, name, lo, hi, local_offset, shape) -> List[MatrixSlot]:
    """Slots of a fused-blocks tensor for a rank holding ``[lo, hi)`` of its flattening: each block's
    held elements are a contiguous piece of the block, read through one strided local view."""
    slots = []
    for key, bshape, off, sizes, strides in strided_blocks(param, name, shape):
        numel = bshape[0] * bshape[1]
        a = _count_before(lo, off, sizes, strides, numel)
        b = _count_before(hi, off, sizes, strides, numel) if hi > lo else a
        if b <= a:
            slots.append(MatrixSlot(key, tuple(bshape), None, 0, transposed=is_transposed(param)))
            continue
        views = _range_views(sizes, strides, a, b)
        first = off + _position(a, sizes, strides)
        local = tuple((off + _position(start, sizes, strides) - first, vsizes, vstrides)
                      for start, vsizes, vstrides in views)
        slots.append(MatrixSlot(key, tuple(bshape), Piece(a, b - a), first - lo + local_offset,
                                transposed=is_transposed(param), local_view=local))
    return slots


def block_slots(param: torch.Tensor, name: str, lo: int, hi: int, local_offset: int = 0,
                shape: Optional[Sequence[int]] = None) -> List[MatrixSlot]:
    """Slots for a rank holding ``[lo, hi)`` of the tensor's global flattening at ``local_offset``
    of its flat local data (pieces clipped to each block; None where it holds none of one)."""
    if getattr(param, BLOCKS, None) is not None:
        return _strided_slots(param, name, lo, hi, local_offset, shape)
    blocks = logical_blocks(param, name, shape)
    if hi <= lo:
        slots = [MatrixSlot(k, tuple(s), None, 0) for k, s, _ in blocks]
    else:
        slots = slots_in_range(blocks, lo, hi)
    for s in slots:
        if s.piece is not None:
            s.local_offset += local_offset
        s.transposed = is_transposed(param)
    return slots


def tp_slots(param: torch.Tensor, name: str) -> List[MatrixSlot]:
    """This rank's slots of a :func:`tensor_parallel` shard (global shapes, TP pieces)."""
    group, pdim = getattr(param, TENSOR_PARALLEL)
    if not (dist.is_available() and dist.is_initialized()):
        tp, k = 1, 0
    else:
        tp, k = dist.get_world_size(group), dist.get_rank(group)
    if k < 0:
        raise ValueError(f"ds_muon: {name} is tagged tensor_parallel with a group this rank is not in")
    if param.ndim != 2:
        raise ValueError(f"ds_muon: {name}: tensor-parallel shard of shape {tuple(param.shape)}; expected 2-D")
    if not param.is_contiguous():
        raise ValueError(f"ds_muon: {name}: the tensor-parallel shard is not contiguous; Muon updates it in place "
                         "through a flat view")
    m, n = (int(s) for s in param.shape)
    if pdim == 0:  # column-parallel: rows [k·m, (k+1)·m) of [m·tp, n] — a contiguous range
        gshape = (m * tp, n)
        return block_slots(param, name, k * m * n, (k + 1) * m * n, 0, gshape)
    gshape = (m, n * tp)  # row-parallel: columns [k·n, (k+1)·n) of every row
    c0, c1 = k * n, (k + 1) * n
    slots = []
    for key, bshape, start in logical_blocks(param, name, gshape):
        rows, cols = matrix_shape(bshape)
        r0 = start // cols
        piece = Piece.block((rows, cols), 0, rows, c0, c1) if n > 0 and rows > 0 else None
        slots.append(MatrixSlot(key, tuple(bshape), piece if piece and piece.numel else None,
                                r0 * n if piece and piece.numel else 0, transposed=is_transposed(param)))
    return slots
