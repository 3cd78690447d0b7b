"""The layout: what each rank holds of each matrix, and the checks that a stack described it right.

Single-process unit tests of :mod:`ds_muon.engine.exchange.layout`; the multi-rank layouts are exercised end to end
by the per-stack tests and tests/test_sharded_engine.py.
"""

import pytest
import torch
from torch import nn

from ds_muon.engine.exchange.layout import MatrixInfo, MatrixSlot, ParamBinding, Piece, _check_cover, build_layout, global_shape
from ds_muon.engine.exchange.layout import matrix_shape, slots_in_range


def test_slots_in_range_cut_matrices_laid_end_to_end():
    # three matrices at offsets 0, 6, 18 of a 22-element buffer; this rank holds [4, 20)
    tensors = [("a", (2, 3), 0), ("b", (3, 4), 6), ("c", (2, 2), 18)]
    a, b, c = slots_in_range(tensors, 4, 20)
    assert (a.piece, a.local_offset) == (Piece(4, 2), 0)  # the tail of a
    assert (b.piece, b.local_offset) == (Piece(0, 12), 2)  # all of b
    assert (c.piece, c.local_offset) == (Piece(0, 2), 14)  # the head of c
    # a rank whose range misses a matrix still lists it, with no piece
    assert [s.piece for s in slots_in_range(tensors, 6, 18)] == [None, Piece(0, 12), None]
    assert [s.key for s in slots_in_range(tensors, 6, 18)] == ["a", "b", "c"]


def test_piece_block_and_view():
    shape = (4, 6)
    rows = Piece.block(shape, 1, 3, 0, 6)  # whole rows: one contiguous run
    assert rows == Piece(6, 12) and rows.contiguous and rows.intervals() == [(6, 18)]
    cols = Piece.block(shape, 0, 4, 2, 5)  # a column block: 4 runs of 3, 6 apart
    assert cols == Piece(2, 3, 4, 6) and not cols.contiguous and cols.numel == 12
    assert cols.intervals() == [(2, 5), (8, 11), (14, 17), (20, 23)]
    flat = torch.arange(24.0)
    assert torch.equal(cols.view_in(flat), flat.view(4, 6)[:, 2:5])
    assert Piece.block(shape, 2, 2, 0, 6).numel == 0


def test_shapes():
    assert matrix_shape((8, 3, 3, 3)) == (8, 27) and MatrixSlot("w", (8, 3, 3, 3), None).matrix_shape == (8, 27)
    p = nn.Parameter(torch.empty(0))
    assert global_shape(p) == (0,)
    p.ds_shape = torch.Size([16, 4])  # ZeRO-3 keeps the real shape beside an empty tensor
    assert global_shape(p) == (16, 4)


def test_cover_check_names_the_matrix_and_the_fault():
    _check_cover(MatrixInfo("ok", (4, 4), (Piece(0, 8), Piece(8, 8), Piece(8, 8))))  # replicas are fine
    _check_cover(MatrixInfo("tp", (4, 4), (Piece.block((4, 4), 0, 4, 0, 2), Piece.block((4, 4), 0, 4, 2, 4))))
    bad = {
        "a gap at element 6": (Piece(0, 6), Piece(8, 8)),
        "overlap at element 6": (Piece(0, 8), Piece(6, 10)),
        "an out-of-range piece": (Piece(0, 8), Piece(8, 9)),
        "cover 12 of 16 elements": (Piece(0, 12), None),
        "overlaps itself": (Piece(0, 4, 2, 2), Piece(6, 10)),
    }
    for what, pieces in bad.items():
        with pytest.raises(ValueError, match=rf"'w'.*{what}"):
            _check_cover(MatrixInfo("w", (4, 4), pieces))


def test_build_layout_single_process():
    p = nn.Parameter(torch.zeros(22))
    binding = ParamBinding(p, lambda t: t.reshape(-1), slots_in_range([("a", (2, 3), 0), ("b", (4, 4), 6)], 0, 22))
    layout = build_layout([(binding, s) for s in binding.matrices])
    assert (layout.world_size, layout.rank) == (1, 0)
    assert [(m.key, m.rows, m.cols, m.holders()) for m in layout.matrices] == [("a", 2, 3, [0]), ("b", 4, 4, [0])]
    short = ParamBinding(p, lambda t: t.reshape(-1), slots_in_range([("b", (4, 4), 0)], 0, 10))
    with pytest.raises(ValueError, match=r"'b'.*cover 10 of 16"):
        build_layout([(short, s) for s in short.matrices])
