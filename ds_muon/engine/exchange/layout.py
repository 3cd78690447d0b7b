"""Where the pieces of each Muon matrix live.

Every stack (DDP, FSDP1, FSDP2, ZeRO) differs only in *what a rank holds*; this
module is the one description they all produce.  A rank's piece of a matrix is a
:class:`Piece` of its row-major flattening: ``rows`` runs of ``length`` elements
starting at ``offset``, ``stride`` apart.  A contiguous range (FSDP, ZeRO, DDP)
is ``rows == 1``; a column block of a tensor-parallel shard is ``rows > 1``.

A :class:`ParamBinding` says, for one tensor the optimizer steps, how to reach
its local data and which matrix pieces sit where inside it.  A :class:`Layout` is
the global picture for one process group, identical on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ...tensors.shape import global_shape, matrix_shape  # noqa: F401 - the vocabulary's shapes (ground floor)


@dataclass(frozen=True)
class Piece:
    """``rows`` runs of ``length`` elements of a matrix's flattening, ``stride`` apart."""

    offset: int
    length: int
    rows: int = 1
    stride: int = 0

    @property
    def numel(self) -> int:
        return self.length * self.rows

    @property
    def contiguous(self) -> bool:
        return self.rows == 1 or self.stride == self.length

    @staticmethod
    def block(shape: Tuple[int, int], row0: int, row1: int, col0: int, col1: int) -> "Piece":
        """The 2-D block ``[row0:row1, col0:col1]`` of a matrix of ``shape``."""
        if row1 <= row0 or col1 <= col0:
            return Piece(0, 0)
        cols = shape[1]
        if col0 == 0 and col1 == cols:
            return Piece(row0 * cols, (row1 - row0) * cols)
        return Piece(row0 * cols + col0, col1 - col0, row1 - row0, cols)

    def view_in(self, flat: torch.Tensor) -> torch.Tensor:
        """This piece of a flat (row-major) matrix buffer, as a ``[rows, length]`` view."""
        stride = self.stride if self.rows > 1 else self.length
        return flat.as_strided((self.rows, self.length), (stride, 1), flat.storage_offset() + self.offset)

    def intervals(self):
        step = self.stride if self.rows > 1 else 0
        return [(self.offset + i * step, self.offset + i * step + self.length) for i in range(self.rows)]


@dataclass
class MatrixSlot:
    """One logical matrix (or a piece of it) inside an optimizer tensor's local storage.

    ``shape`` is the original tensor's global shape; Muon treats it as
    ``[shape[0], prod(shape[1:])]``.  ``piece`` is what this rank holds of it,
    None when nothing; it sits at ``local_offset`` of the binding's flat data.
    ``transposed``: the tensor is stored ``[in, out]`` (:func:`ds_muon.transposed`), recorded
    here for bindings whose tensor is a flat partition that cannot carry the tag itself.
    ``local_view``: when the piece is not contiguous in the local data (a column block or an
    interleaved block of a fused projection, :func:`ds_muon.fused_blocks`), the strided views that
    hold it, ``((offset from local_offset, sizes, strides), ...)``: their row-major orders, one
    after the other, are the piece's.
    """

    key: str
    shape: Tuple[int, ...]
    piece: Optional[Piece]
    local_offset: int = 0
    transposed: bool = False
    local_view: Optional[Tuple[Tuple[int, Tuple[int, ...], Tuple[int, ...]], ...]] = None

    @property
    def matrix_shape(self) -> Tuple[int, int]:
        return matrix_shape(self.shape)


@dataclass
class ParamBinding:
    """How the optimizer reaches one of its tensors, and which matrices live in it.

    ``flat(t)`` maps the parameter, its gradient or any state tensor created
    ``zeros_like`` it to the 1-D local data the rank owns (a view: writes land in
    the buffers the stack owns).  ``adam_ranges`` are the (offset, numel) slices
    that take AdamW in a tensor that mixes both (FSDP1 flat parameters) and that this
    rank holds; ``mixed`` says the tensor mixes both on *some* rank, so that every rank
    keeps its AdamW state keys and step count (FSDP's optimizer state dict gathers them
    from every rank).  ``copied``: the
    parameter has no flat view (a strided slice such as ``w[..., 0]``), so ``flat(param)`` is a
    copy, read afresh at every use, and the results are copied back into the parameter; its
    gradient and state are contiguous (autograd and ``zeros_like`` make them so), flat as views.
    """

    param: torch.Tensor
    flat: Callable[[torch.Tensor], torch.Tensor]
    matrices: List[MatrixSlot]
    adam_ranges: List[Tuple[int, int]] = field(default_factory=list)
    group: Optional[dist.ProcessGroup] = None
    copied: bool = False  # flat(param) is a copy (no flat view exists): results are copied back in
    mixed: bool = False

    @property
    def has_adam(self) -> bool:
        """AdamW state belongs to this tensor (its rank holds AdamW slices, or another rank does)."""
        return bool(self.adam_ranges) or self.mixed


@dataclass(frozen=True)
class MatrixInfo:
    """The global facts of one matrix, identical on every rank of its group."""

    key: str
    shape: Tuple[int, ...]
    pieces: Tuple[Optional[Piece], ...]  # indexed by rank in the group

    @property
    def rows(self) -> int:
        return matrix_shape(self.shape)[0]

    @property
    def cols(self) -> int:
        return matrix_shape(self.shape)[1]

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def holders(self) -> List[int]:
        return [r for r, p in enumerate(self.pieces) if p is not None and p.numel > 0]

    def held_numel(self, rank: int) -> int:
        p = self.pieces[rank]
        return 0 if p is None else p.numel

    def distinct_pieces(self) -> List[Tuple[Piece, List[int]]]:
        """Distinct pieces with the ranks that hold each (replicas hold identical pieces)."""
        out: dict = {}
        for r, p in enumerate(self.pieces):
            if p is not None and p.numel > 0:
                out.setdefault(p, []).append(r)
        return list(out.items())


@dataclass
class Layout:
    """Every matrix of one process group: global facts plus this rank's local slots.

    ``local[i]`` is ``(binding, slot)`` for ``matrices[i]`` on this rank (slot piece
    may be None).  Built by :func:`build_layout`; validated so that a misdescribed
    stack fails here, not as silent corruption in the exchange.
    """

    group: Optional[dist.ProcessGroup]
    world_size: int
    rank: int
    matrices: List[MatrixInfo]
    local: List[Tuple[ParamBinding, MatrixSlot]]


def _group_info(group) -> Tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def build_layout(entries: List[Tuple[ParamBinding, MatrixSlot]], group=None) -> Layout:
    """Assemble the global Layout from this rank's slots (one all_gather, once).

    Every rank must list the same matrix keys in the same order, each with the same
    shape; pieces must be identical (replicas) or disjoint and together cover the
    matrix exactly.  Anything else raises ValueError naming the matrix.
    """
    world, rank = _group_info(group)
    mine = [(slot.key, tuple(slot.shape), slot.piece) for _, slot in entries]
    if world == 1:
        everyone = [mine]
    else:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
    first = everyone[0]  # every rank compares with rank 0: the same error on every rank
    for r, theirs in enumerate(everyone):
        if [(k, s) for k, s, _ in theirs] != [(k, s) for k, s, _ in first]:
            ours = {(k, s) for k, s, _ in first}
            diff = [k for k, s, _ in theirs if (k, s) not in ours] or [
                k for k, s, _ in first if (k, s) not in {(k2, s2) for k2, s2, _ in theirs}
            ]
            raise ValueError(
                f"ds_muon: rank 0 and rank {r} describe different Muon matrices "
                f"(first difference: {diff[:1] or 'order'}); every rank must build the optimizer "
                "over the same model with the same param groups (and, with several optimizers, step them "
                "in the same order)"
            )
    matrices = []
    for i, (key, shape, _) in enumerate(mine):
        pieces = tuple(everyone[r][i][2] for r in range(world))
        info = MatrixInfo(key, shape, pieces)
        _check_cover(info)
        matrices.append(info)
    return Layout(group, world, rank, matrices, list(entries))


def _check_cover(info: MatrixInfo) -> None:
    numel = info.numel
    spans = []
    for piece, _ in info.distinct_pieces():
        if piece.rows > 1 and (piece.stride < piece.length):
            raise ValueError(f"ds_muon: matrix {info.key!r}: piece {piece} overlaps itself")
        spans.extend(piece.intervals())
    spans.sort()
    pos = 0
    for lo, hi in spans:
        if lo != pos or hi > numel:
            what = "overlap" if lo < pos else ("a gap" if lo > pos else "an out-of-range piece")
            raise ValueError(
                f"ds_muon: the pieces of matrix {info.key!r} (shape {info.shape}) have {what} at "
                f"element {min(lo, pos)}; the stack's metadata does not describe a partition of it"
            )
        pos = hi
    if pos != numel:
        raise ValueError(
            f"ds_muon: the pieces of matrix {info.key!r} (shape {info.shape}) cover {pos} of {numel} elements"
        )


def slots_in_range(tensors: Sequence[Tuple[str, Tuple[int, ...], int]], lo: int, hi: int) -> List[MatrixSlot]:
    """Slots for matrices laid end to end in a flat buffer of which a rank holds ``[lo, hi)``.

    ``tensors`` lists ``(key, shape, offset in the flat buffer)``.  Local offsets are
    relative to ``lo``.  Matrices outside the range get a slot with ``piece=None`` so
    every rank lists every matrix (FSDP1 flat parameters, ZeRO-1/2 flat groups).
    """
    slots = []
    for key, shape, start in tensors:
        numel = math.prod(shape)
        a, b = max(lo, start), min(hi, start + numel)
        if a < b:
            slots.append(MatrixSlot(key, tuple(shape), Piece(a - start, b - a), a - lo))
        else:
            slots.append(MatrixSlot(key, tuple(shape), None, 0))
    return slots


def is_flat_shard(p: torch.Tensor) -> bool:
    """Flat shards that hold matrices although they are 1-D (FSDP1 FlatParameter and views, ZeRO partitions).
    A ZeRO-3 parameter is not one: its real shape is ``ds_shape`` (:func:`global_shape`)."""
    return (hasattr(p, "_fqns") or getattr(p, "_ds_muon_flat", False)
            or getattr(p, "_fsdp_flattened", False))  # FSDP1 use_orig_params=True: 1-D views


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (no collective); any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def _dtensor_class():
    """DTensor, looked up once (the step asks per tensor, several times)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


_DTENSOR = _dtensor_class()
_DTENSOR_OR_NONE = _DTENSOR if _DTENSOR is not None else ()  # for isinstance


def local_data(t: torch.Tensor) -> torch.Tensor:
    """:func:`local_shard` for code under ``torch.no_grad()`` (the step): a DTensor's local tensor
    as it holds it (what ``to_local()`` returns there), read without the call's overhead."""
    return t._local_tensor if _DTENSOR is not None and isinstance(t, _DTENSOR) else t
