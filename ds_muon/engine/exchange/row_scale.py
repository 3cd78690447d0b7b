"""A rank's own piece of a matrix multiplied in place by a factor per output feature (QK-clip's rows).

QK-clip (:mod:`ds_muon.qk_clip`) scales the q/k rows of a head where they live: each rank multiplies the
elements it holds, as its binding's :class:`~.layout.MatrixSlot` describes them (a contiguous run of the
matrix's flattening, a strided piece, the strided views of a fused projection's block), by their output
features' fp32 factors (:mod:`ds_muon.rules.qk_clip`), and casts back to the tensor's dtype.  Every rank
multiplies the same elements by the same factors, so a sharded run stays bitwise equal to one process.

* :func:`multiply_rows` — a contiguous piece of an ``[out, in]`` matrix, row run by row run (no index
  tensors); :func:`multiply_piece` — any piece, by one factor per element in piece order;
* :func:`piece_positions`, :func:`block_positions` — where each element of a piece sits in the stored
  tensor's row-major flattening (a block of a tagged tensor: through its tags), for the factors of
  :func:`~ds_muon.rules.qk_clip.piece_factors`;
* :func:`shard_offset` — where a 1-D tensor's local data starts in the whole tensor (a bias).
"""

from __future__ import annotations

import torch

from .layout import MatrixSlot, Piece
from .slots import logical_blocks, strided_blocks
from ...tensors.tag_keys import BLOCKS


@torch.no_grad()
def multiply_rows(b, slot: MatrixSlot, factors: torch.Tensor, cols: int) -> None:
    """A contiguous piece ``[offset, offset + length)`` of an ``[out, in]`` matrix (``cols`` columns), multiplied
    in place row by row: a partial first row, whole rows as one ``[rows, cols]`` view, a partial last row."""
    flat = b.flat(b.param)
    v = flat[slot.local_offset:slot.local_offset + slot.piece.numel]
    f = factors.to(v.device)
    pos, end, at = slot.piece.offset, slot.piece.offset + slot.piece.length, 0
    while pos < end:
        row, col = divmod(pos, cols)
        if col == 0 and end - pos >= cols:
            n = (end - pos) // cols
            block = v[at:at + n * cols].view(n, cols)
            block.copy_((block.to(torch.float32) * f[row:row + n, None]).to(v.dtype))
            pos, at = pos + n * cols, at + n * cols
            continue
        n = min(cols - col, end - pos)
        part = v[at:at + n]
        part.copy_((part.to(torch.float32) * f[row]).to(v.dtype))
        pos, at = pos + n, at + n


@torch.no_grad()
def multiply_piece(b, slot: MatrixSlot, f: torch.Tensor) -> None:
    """This rank's piece of one matrix, multiplied in place by ``f`` (its elements' factors, in piece order)."""
    flat = b.flat(b.param)
    if slot.local_view is None:
        views = [(flat[slot.local_offset:slot.local_offset + slot.piece.numel], 0)]
    else:
        views, start = [], 0
        for rel, sizes, strides in slot.local_view:
            v = flat.as_strided(sizes, strides, flat.storage_offset() + slot.local_offset + rel)
            views.append((v, start))
            start += v.numel()
    for v, start in views:
        part = f[start:start + v.numel()].to(v.device).view(v.shape)
        v.copy_((v.to(torch.float32) * part).to(v.dtype))


def piece_positions(piece: Piece) -> torch.Tensor:
    """Where each element of ``piece`` sits in its matrix's row-major flattening (int64, piece order)."""
    e = torch.arange(piece.numel, dtype=torch.int64)
    return piece.offset + (e // piece.length) * piece.stride + e % piece.length if piece.rows > 1 else piece.offset + e


def block_positions(t: torch.Tensor, base: str, key: str, m: torch.Tensor, name: str) -> torch.Tensor:
    """The positions ``m`` in block ``key`` of the tagged tensor ``t`` (slots keyed from ``base``), as positions
    in ``t``'s row-major flattening: a fused block's strided view (:func:`~.slots.strided_blocks`) unravelled,
    a row block (:func:`~.slots.logical_blocks`) shifted to its start."""
    if getattr(t, BLOCKS, None) is not None:
        for k, _, off, sizes, strides in strided_blocks(t, base):
            if k == key:
                pos = torch.zeros_like(m)
                rest = m
                for n, st in zip(reversed(sizes), reversed(strides)):
                    rest, r = torch.div(rest, n, rounding_mode="floor"), rest % n
                    pos += r * st
                return off + pos
    else:
        for k, _, start in logical_blocks(t, base):
            if k == key:
                return start + m
    raise RuntimeError(f"ds_muon: QKClip: no block {key} in the tags of {name}")


def shard_offset(p: torch.Tensor) -> int:
    """Where a 1-D tensor's local data starts in the whole tensor: 0, or a DTensor shard's global offset."""
    if not (hasattr(p, "placements") and hasattr(p, "device_mesh")):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return int(compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1][0])
