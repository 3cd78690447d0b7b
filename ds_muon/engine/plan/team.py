"""Team Newton–Schulz: one matrix orthogonalized by several ranks, each holding a column block.

When one matrix's NS is longer than a balanced rank's whole share of the step (more ranks than
matrices, or one large matrix beside small ones), one home bounds the step whatever the plan.
On the wide orientation X (m×n, m ≤ n) every NS iteration only needs the m×m product
A = X·Xᵀ = Σ_j X_j·X_jᵀ over column blocks X_j, so a team of k ranks can each keep a block:

    A = all_reduce(X_j·X_jᵀ)          (m×m in the NS dtype: the only bytes per iteration)
    X_j ← a·X_j + (b·A + c·A²)·X_j    or, where the block is narrower than m, a·X_j + b·A·(X_j + (c/b)·Y) with Y = A·X_j

and the Frobenius normalisation all-reduces one sum of squares first.  This is the distributed
NS of TransformerEngine's and Dion's Muon (there over tensor-parallel shards; here over the ranks the
planner picks, :func:`~ds_muon.engine.plan.team_plan.plan_teams`).  A tall matrix (rows > cols) is X = Gᵀ, so its
blocks are row blocks of G (contiguous); a wide one's are column blocks of G.

It is **not** bitwise equal to one process: the partial products are summed in another order
(and, in bf16, each is rounded before it is summed; a ring all_reduce of k > 2 members rounds each
partial sum too).  docs/PERFORMANCE.md states the measured
bound and ``tests/test_team_ns.py`` checks it against float64 NS and against the one-home result.

:class:`TeamExchange` moves each member its block straight from the ranks that hold the pieces
(one all_to_all), and each holder its piece of the result straight from the members (one more),
with the same ``gather_start / gather_finish / scatter_start / scatter_finish`` calls as
:class:`~ds_muon.engine.exchange.all_to_all.Exchange`, so the optimizer runs it as one more exchange.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, NamedTuple, Sequence, Tuple

import torch
import torch.distributed as dist

from ...rules.newton_schulz import input_dtype, resolve_coefficients
from ..exchange.layout import Layout, Piece
from ..agreement.timeouts import new_group_like


def team_bounds(rows: int, cols: int, k: int) -> List[Tuple[int, int]]:
    """The k column blocks of the wide orientation (``[c0, c1)`` of its n = max(rows, cols) columns):
    as even as can be, the first ``n % k`` one wider."""
    n = max(rows, cols)
    cuts = [(j * n) // k for j in range(k + 1)]
    return [(cuts[j], cuts[j + 1]) for j in range(k)]


def block_shape(rows: int, cols: int, c0: int, c1: int) -> Tuple[int, int]:
    """The block of the stored (rows, cols) matrix a member holds: rows ``[c0, c1)`` of a tall
    matrix (its X = Gᵀ), columns ``[c0, c1)`` of a wide one."""
    return (c1 - c0, cols) if rows > cols else (rows, c1 - c0)


class Segment(NamedTuple):
    """One regular run of elements shared by a contiguous piece and a block: ``src`` is where it
    sits in the piece's flat data, ``dst`` where it sits in the block's (row-major) flat data."""

    src: Piece
    dst: Piece


def segments(piece: Piece, rows: int, cols: int, c0: int, c1: int) -> List[Segment]:
    """Where the contiguous ``piece`` (of the row-major flattening of a rows×cols matrix) meets the
    block ``[c0, c1)`` (:func:`block_shape`): at most three regular runs (a head row, whole rows,
    a tail row)."""
    s, e = piece.offset, piece.offset + piece.numel
    if rows > cols:  # row block: one contiguous range of the flattening
        lo, hi = max(s, c0 * cols), min(e, c1 * cols)
        return [Segment(Piece(lo - s, hi - lo), Piece(lo - c0 * cols, hi - lo))] if lo < hi else []
    w = c1 - c0
    out = []

    def run(r):  # row r's part: one run
        lo, hi = max(s, r * cols + c0), min(e, r * cols + c1)
        if lo < hi:
            out.append(Segment(Piece(lo - s, hi - lo), Piece(r * w + lo - r * cols - c0, hi - lo)))

    first, last = s // cols, (e - 1) // cols
    run(first)
    if last - first > 1:  # whole rows between: one strided run in the piece, contiguous in the block
        n = last - first - 1
        out.append(Segment(Piece((first + 1) * cols + c0 - s, w, n, cols), Piece((first + 1) * w, w, n, w)))
    if last > first:
        run(last)
    return out


class TeamGroups:
    """Process groups of the teams, one per member set, made once and kept (like
    :class:`~ds_muon.engine.plan.compile.ExchangeGroups`).  ``dist.new_group`` is collective over the world, so
    :meth:`make` is only called for layouts spanning the world (every rank compiles the same plan at
    the same step) and in one sorted order; a group gets the timeout of the layout's group
    (:func:`~ds_muon.engine.agreement.timeouts.new_group_like`)."""

    def __init__(self):
        self._made: Dict[Tuple[int, ...], object] = {}

    def make(self, member_sets: Sequence[Tuple[int, ...]], parent) -> None:
        for ranks in sorted(set(member_sets)):
            if ranks not in self._made:
                self._made[ranks] = new_group_like(list(ranks), dist.get_backend(parent), parent)

    def get(self, ranks: Tuple[int, ...]):
        return self._made.get(ranks)


class TeamNS:
    """One team matrix's Newton–Schulz at a member: :meth:`run` takes the member's block and
    returns its block of the result (in the NS dtype), all-reducing over ``group`` (its team)."""

    def __init__(self, ns, rows: int, cols: int, group):
        self.ns, self.rows, self.cols, self.group = ns, rows, cols, group

    def run(self, block: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            raise RuntimeError("ds_muon: a team NS needs its team's process group (none was made)")
        return team_newton_schulz(block, self.rows > self.cols, self.ns, self.group)


def team_newton_schulz(block: torch.Tensor, tall: bool, ns, group) -> torch.Tensor:
    """NS of the matrix whose member blocks the ranks of ``group`` hold (see the module docstring);
    ``ns``: :class:`~ds_muon.engine.plan.compile.NSSettings` (``standard`` iteration).  Every member calls it."""
    per_step, norm_scale = resolve_coefficients(ns.coefficients, ns.steps)
    dtype = ns.dtype
    X = block.to(input_dtype(dtype))
    sq = torch.linalg.vector_norm(X, dtype=torch.float64).square()
    dist.all_reduce(sq, group=group)
    norm = (sq.sqrt() * norm_scale).clamp_(min=ns.eps).to(X.dtype)
    X = (X / norm).to(dtype)
    if tall:
        X = X.mT  # [m, n_j]
    m, w = X.shape
    for a, b, c in per_step:
        A = X @ X.mT
        dist.all_reduce(A, group=group)  # in the NS dtype: at k=2 the same bits as summing in fp32
        if w < m:  # cheaper on a narrow block: 6·m²·w instead of 4·m²·w + 2·m³
            # a·X + b·A·X + c·A·(A·X) = a·X + b·A·(X + (c/b)·Y), Y = A·X: one rounded elementwise op
            # (torch computes a bf16 add in fp32) and the products' sums rounded once by addmm
            Y = A @ X
            X = (torch.addmm(X, A, torch.add(X, Y, alpha=c / b), beta=a, alpha=b) if b
                 else torch.addmm(X, A, Y, beta=a, alpha=c))
        else:
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
    return (X.mT if tall else X).contiguous()


class _Move(NamedTuple):
    matrix: int
    seg: Segment


class TeamExchange:
    """Moves the team matrices of ``layout.matrices[active]`` to their members as blocks, and the
    results back; ``teams[i]`` are the member ranks (in the layout's group, sorted: member j holds
    block j of :func:`team_bounds`).  Pieces must be contiguous (:func:`~ds_muon.engine.plan.compile` only
    teams such matrices).  ``stacks`` at a member are ``{("team", i): block}``."""

    def __init__(self, layout: Layout, active: Sequence[int], teams: Dict[int, Tuple[int, ...]],
                 gather_dtype: torch.dtype, scatter_dtype: torch.dtype, device, group=None):
        self.layout = layout
        self.group = group if group is not None else layout.group
        self.world, self.rank = layout.world_size, layout.rank
        self.active = list(active)
        self.homes = self.teams = teams
        self.gather_dtype, self.scatter_dtype, self.device = gather_dtype, scatter_dtype, device
        r = self.rank
        self.blocks: Dict[int, Tuple[int, int]] = {}  # this rank's block of each matrix it is a member of
        send_g = [[] for _ in range(self.world)]
        recv_g = [[] for _ in range(self.world)]
        send_s = [[] for _ in range(self.world)]
        recv_s = [[] for _ in range(self.world)]
        self.self_gather: List[_Move] = []
        self.self_scatter: List[_Move] = []
        traffic_g = traffic_s = False
        for i in self.active:
            info = layout.matrices[i]
            members = teams[i]
            bounds = team_bounds(info.rows, info.cols, len(members))
            if r in members:
                self.blocks[i] = bounds[members.index(r)]
            for piece, holders in info.distinct_pieces():
                for j, h in enumerate(members):
                    segs = segments(piece, info.rows, info.cols, *bounds[j])
                    if not segs:
                        continue
                    if h in holders:
                        if h == r:
                            self.self_gather += [_Move(i, s) for s in segs]
                        continue
                    src = holders[(i + j) % len(holders)]
                    traffic_g = True
                    if src == r:
                        send_g[h] += [_Move(i, s) for s in segs]
                    if h == r:
                        recv_g[src] += [_Move(i, s) for s in segs]
            for d, piece in enumerate(info.pieces):
                if piece is None or piece.numel == 0:
                    continue
                for j, h in enumerate(members):
                    segs = segments(piece, info.rows, info.cols, *bounds[j])
                    if h == d:
                        if d == r:
                            self.self_scatter += [_Move(i, s) for s in segs]
                        continue
                    if segs:
                        traffic_s = True
                    if h == r:
                        send_s[d] += [_Move(i, s) for s in segs]
                    if d == r:
                        recv_s[h] += [_Move(i, s) for s in segs]
        self.gather_traffic = traffic_g and self.world > 1  # the same on every rank: skipping never deadlocks
        self.scatter_traffic = traffic_s and self.world > 1
        self.send_g, self.recv_g, self.send_s, self.recv_s = send_g, recv_g, send_s, recv_s
        size = lambda lst: [sum(mv.seg.src.numel for mv in x) for x in lst]  # noqa: E731
        self.split_send_g, self.split_recv_g = size(send_g), size(recv_g)
        self.split_send_s, self.split_recv_s = size(send_s), size(recv_s)
        self.bytes_sent = sum(self.split_send_g) * gather_dtype.itemsize + sum(self.split_send_s) * scatter_dtype.itemsize
        self.bytes_received = (sum(self.split_recv_g) * gather_dtype.itemsize
                               + sum(self.split_recv_s) * scatter_dtype.itemsize)
        self._buffers: Dict[str, object] = {}

    def for_rank(self, rank: int) -> "TeamExchange":
        """The same exchange as ``rank`` compiles it (for its bytes in :meth:`ds_muon.Muon.summary`)."""
        import dataclasses
        return TeamExchange(dataclasses.replace(self.layout, rank=rank), self.active, self.teams,
                            self.gather_dtype, self.scatter_dtype, self.device, self.group)

    # -- gather ---------------------------------------------------------------------------------
    def gather_start(self, local: Dict[int, torch.Tensor]):
        """``local[i]``: this rank's piece of matrix i, flat.  Fills this rank's blocks from its own
        pieces and issues the all_to_all for the rest; :meth:`gather_finish` returns the blocks."""
        blocks = self._buffer("blocks", lambda: {
            ("team", i): torch.empty(block_shape(self.layout.matrices[i].rows, self.layout.matrices[i].cols,
                                                 *b), dtype=self.gather_dtype, device=self.device)
            for i, b in self.blocks.items()})
        flat = {i: blocks[("team", i)].view(-1) for i in self.blocks}
        _copy([mv.seg.dst.view_in(flat[mv.matrix]) for mv in self.self_gather],
              [mv.seg.src.view_in(local[mv.matrix]) for mv in self.self_gather])
        if not self.gather_traffic:
            return blocks, None, None
        send = self._buffer("send_g", lambda: torch.empty(sum(self.split_send_g), dtype=self.gather_dtype,
                                                          device=self.device))
        moves = [mv for lst in self.send_g for mv in lst]
        _copy(_chunks(send, [mv.seg.src for mv in moves]), [mv.seg.src.view_in(local[mv.matrix]) for mv in moves])
        recv = self._buffer("recv_g", lambda: torch.empty(sum(self.split_recv_g), dtype=self.gather_dtype,
                                                          device=self.device))
        work = dist.all_to_all_single(recv, send, self.split_recv_g, self.split_send_g, group=self.group,
                                      async_op=True)
        return blocks, recv, work

    def gather_finish(self, pending) -> Dict[Hashable, torch.Tensor]:
        blocks, recv, work = pending
        if work is None:
            return blocks
        work.wait()
        moves = [mv for lst in self.recv_g for mv in lst]
        flat = {i: blocks[("team", i)].view(-1) for i in self.blocks}
        _copy([mv.seg.dst.view_in(flat[mv.matrix]) for mv in moves], _chunks(recv, [mv.seg.src for mv in moves]))
        return blocks

    # -- scatter --------------------------------------------------------------------------------
    def scatter_start(self, results: Dict[Hashable, torch.Tensor]):
        """``results``: this rank's result blocks.  Issues the all_to_all that brings every holder its
        piece of the results; :meth:`scatter_finish` returns ``{matrix: this rank's piece, flat}``."""
        mats = self.layout.matrices
        out = self._buffer("out", lambda: {
            i: torch.empty(mats[i].pieces[self.rank].numel, dtype=self.scatter_dtype, device=self.device)
            for i in self.active if mats[i].pieces[self.rank] is not None and mats[i].pieces[self.rank].numel})
        res = {i: results[("team", i)].reshape(-1) for i in self.blocks}
        _copy([mv.seg.src.view_in(out[mv.matrix]) for mv in self.self_scatter],
              [mv.seg.dst.view_in(res[mv.matrix]) for mv in self.self_scatter])
        if not self.scatter_traffic:
            return out, None, None
        send = self._buffer("send_s", lambda: torch.empty(sum(self.split_send_s), dtype=self.scatter_dtype,
                                                          device=self.device))
        moves = [mv for lst in self.send_s for mv in lst]
        _copy(_chunks(send, [mv.seg.src for mv in moves]), [mv.seg.dst.view_in(res[mv.matrix]) for mv in moves])
        recv = self._buffer("recv_s", lambda: torch.empty(sum(self.split_recv_s), dtype=self.scatter_dtype,
                                                          device=self.device))
        work = dist.all_to_all_single(recv, send, self.split_recv_s, self.split_send_s, group=self.group,
                                      async_op=True)
        return out, recv, work

    def scatter_finish(self, pending) -> Dict[int, torch.Tensor]:
        out, recv, work = pending
        if work is not None:
            work.wait()
            moves = [mv for lst in self.recv_s for mv in lst]
            _copy([mv.seg.src.view_in(out[mv.matrix]) for mv in moves], _chunks(recv, [mv.seg.src for mv in moves]))
        return dict(out)

    # -- as Exchange ----------------------------------------------------------------------------
    def release(self) -> None:
        self._buffers.clear()

    def buffer_bytes(self) -> int:
        out = 0
        for buf in self._buffers.values():
            for t in (buf.values() if isinstance(buf, dict) else [buf]):
                out += t.numel() * t.element_size()
        return out

    def _buffer(self, name: str, make):
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = make()
        return buf


def _chunks(flat: torch.Tensor, pieces: List[Piece]) -> List[torch.Tensor]:
    """``flat`` cut into consecutive ``[rows, length]`` chunks, one per piece."""
    out, at = [], 0
    for p in pieces:
        out.append(flat[at:at + p.numel].view(p.rows, p.length))
        at += p.numel
    return out


def _copy(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    if dst:
        torch._foreach_copy_(dst, src)
