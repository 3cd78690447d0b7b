"""The matrix slots of a tagged tensor: which logical matrices it holds and which part
of each a rank has, for adapters to put in a :class:`~ds_muon.layout.ParamBinding`.

:func:`logical_blocks` reads the tags of :mod:`ds_muon.tags` (split rows, expert
stacks) into contiguous ranges of the tensor's row-major flattening;
:func:`block_slots` clips them to the range a rank holds; :func:`tp_slots` does the
same for a :func:`~ds_muon.tags.tensor_parallel` shard.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .layout import MatrixSlot, Piece, global_shape, matrix_shape, slots_in_range
from .tags import EXPERTS, SPLIT_ROWS, TENSOR_PARALLEL, is_transposed

Block = Tuple[str, Tuple[int, int], int]  # key, 2-D shape, start in the tensor's row-major flattening

def logical_blocks(param: torch.Tensor, name: str, shape: Optional[Sequence[int]] = None) -> List[Block]:
    """The logical matrices of a tensor of global ``shape`` (default ``param.shape``).

    Each is ``(key, (rows, cols), start)``: a contiguous range of the tensor's
    row-major flattening.  An untagged tensor is one matrix keyed ``name`` with
    its own shape (conv weights stay ``[out, in·k·k]``); blocks are keyed
    ``name[label]``, experts ``name[e]``.
    """
    shape = tuple(int(s) for s in (global_shape(param) if shape is None else shape))
    split = getattr(param, SPLIT_ROWS, None)
    if getattr(param, EXPERTS, False):
        if len(shape) < 3:
            raise ValueError(f"ds_muon: {name} is tagged expert_weight but has shape {shape}; expected [E, out, in]")
        mshape = (shape[1], math.prod(shape[2:]))
        size = mshape[0] * mshape[1]
        bases = [(f"{name}[{e}]", e * size) for e in range(shape[0])]
    else:
        if split is None:
            return [(name, shape, 0)]
        mshape = matrix_shape(shape)
        bases = [(name, 0)]
    if split is None:
        return [(k, mshape, s) for k, s in bases]
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


def block_slots(param: torch.Tensor, name: str, lo: int, hi: int, local_offset: int = 0,
                shape: Optional[Sequence[int]] = None) -> List[MatrixSlot]:
    """Slots for a rank holding ``[lo, hi)`` of the tensor's global flattening at ``local_offset``
    of its flat local data (pieces clipped to each block; None where it holds none of one)."""
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
