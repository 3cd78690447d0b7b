"""The fused exchange: every piece to its home in one all_to_all, results back in one more.

Compiled once per (Layout, active matrices, homes): which segment goes from
which rank to which, where it lands in the home's same-shape stacks, and the
split sizes.  A step then only packs, calls ``all_to_all_single`` and unpacks.
Nothing crosses the wire that the receiver already holds, and when no rank
needs to move anything the collective is skipped everywhere (every rank knows
the whole plan, so they all agree without talking).

``transport="p2p"`` moves the same buffers with ``batch_isend_irecv`` to and from
only the ranks with a nonzero split (:attr:`Exchange.peers`): an all_to_all over
thousands of ranks pays a per-peer cost (and, on NCCL, a connection) for every rank
of the group, a sparse plan talks to a few.  The bytes are the same, so the result is.

(Over 400 lines, as one class: compiling the index maps and packing, moving and unpacking with them
share one state, the segments, cuts and lent buffers, that a split would only pass back and forth.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Hashable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .layout import Layout, Piece
from ..memory.lending import full_bytes, give_back, give_back_all, take, take_all
from .routes import gather_source, replica_groups, scatter_source


TRANSPORTS = ("all_to_all", "p2p")


class Peers(NamedTuple):
    """Ranks (in the exchange's group) this rank sends to / receives from, per direction."""

    gather_send: FrozenSet[int]
    gather_recv: FrozenSet[int]
    scatter_send: FrozenSet[int]
    scatter_recv: FrozenSet[int]

    def all(self) -> FrozenSet[int]:
        return self.gather_send | self.gather_recv | self.scatter_send | self.scatter_recv


@dataclass
class _Segment:
    matrix: int  # index into the layout's matrices
    piece: Piece


class Exchange:
    """Moves pieces of ``layout.matrices[active]`` to their homes and results back.

    ``homes[i]`` is a tuple of ranks for ``layout.matrices[i]``: one rank in the
    sharded mode, several where the planner duplicates NS (DDP replicas; HSDP: one per
    replica group, which gathers from and scatters to its own group), every rank in the
    duplicated baseline.  ``stack_key[i]`` groups
    matrices that may share one batched NS call at a home (shape and NS settings).
    ``group`` (default ``layout.group``) holds the same ranks in the same order: the
    exchange's own communicator (:class:`~ds_muon.engine.plan.compile.ExchangeGroups`).
    ``transport``: "all_to_all", "p2p", or a function of (world, max_peers) naming one.
    """

    def __init__(
        self,
        layout: Layout,
        active: Sequence[int],
        homes: Dict[int, Tuple[int, ...]],
        stack_key: Dict[int, Hashable],
        gather_dtype: torch.dtype,
        scatter_dtype: torch.dtype,
        device: torch.device,
        group=None,
        transport="all_to_all",
    ):
        self.layout = layout
        self.group = group if group is not None else layout.group  # same ranks, same order
        self.world = layout.world_size
        self.rank = r = layout.rank
        self.active = list(active)
        self.homes = homes
        self.gather_dtype = gather_dtype
        self.scatter_dtype = scatter_dtype
        self.device = device

        # Stacks at this rank: key -> ordered matrix indices; position of each matrix.
        self.stacks: Dict[Hashable, List[int]] = {}
        for i in self.active:
            if r in homes[i]:
                self.stacks.setdefault(stack_key[i], []).append(i)
        self.slot = {i: (k, j) for k, idx in self.stacks.items() for j, i in enumerate(idx)}

        send_g = [[] for _ in range(self.world)]  # gather: what r sends to each home
        recv_g = [[] for _ in range(self.world)]  # gather: what r (a home) receives from each rank
        self.self_gather: List[_Segment] = []  # pieces r holds of matrices it is home of
        send_s = [[] for _ in range(self.world)]
        recv_s = [[] for _ in range(self.world)]
        gather_traffic = scatter_traffic = False
        links = [set() for _ in range(self.world)]  # every rank's peers (either direction): max_peers
        for i in self.active:
            info = layout.matrices[i]
            hs = homes[i]
            pieces = info.distinct_pieces()
            groups = replica_groups([holders for _, holders in pieces]) if len(hs) > 1 else ()
            for piece, holders in pieces:
                for hk, h in enumerate(hs):
                    if h in holders:
                        if h == r:
                            self.self_gather.append(_Segment(i, piece))
                        continue
                    src = gather_source(holders, h, hs, groups, holders[(i + hk) % len(holders)])
                    gather_traffic = True
                    links[src].add(h)
                    links[h].add(src)
                    if src == r:
                        send_g[h].append(_Segment(i, piece))
                    if h == r:
                        recv_g[src].append(_Segment(i, piece))
            for d, piece in enumerate(info.pieces):
                if piece is None or piece.numel == 0 or d in hs:
                    continue
                src = scatter_source(hs, d, groups)  # a home in d's replica group first
                scatter_traffic = True
                links[src].add(d)
                links[d].add(src)
                if src == r:
                    send_s[d].append(_Segment(i, piece))
                if d == r:
                    recv_s[src].append(_Segment(i, piece))
        # Known identically on every rank, so skipping a collective never deadlocks.
        self.gather_traffic = gather_traffic and self.world > 1
        self.scatter_traffic = scatter_traffic and self.world > 1
        self.send_g, self.recv_g, self.send_s, self.recv_s = send_g, recv_g, send_s, recv_s
        sizes = lambda segs: [sum(s.piece.numel for s in lst) for lst in segs]  # noqa: E731
        self.split_send_g, self.split_recv_g = sizes(send_g), sizes(recv_g)
        self.split_send_s, self.split_recv_s = sizes(send_s), sizes(recv_s)
        nonzero = lambda splits: frozenset(p for p, n in enumerate(splits) if n)  # noqa: E731
        self.peers = Peers(nonzero(self.split_send_g), nonzero(self.split_recv_g),
                           nonzero(self.split_send_s), nonzero(self.split_recv_s))
        # The most peers any rank talks to: known identically everywhere (transport="auto").
        self.max_peers = max((len(x) for x in links), default=0)
        if callable(transport):  # e.g. CostModel.transport: the same choice on every rank
            transport = transport(self.world, self.max_peers)
        if transport not in TRANSPORTS:
            raise ValueError(f"ds_muon: Exchange transport={transport!r} is unknown; use one of {list(TRANSPORTS)}")
        self.transport = transport
        # Where each of r's own results arrives in the scatter receive buffer.
        self.recv_offset: Dict[int, int] = {}
        off = 0
        for lst in recv_s:
            for s in lst:
                self.recv_offset[s.matrix] = off
                off += s.piece.numel
        # the matrices whose local pieces gather_start reads (sent, or copied into this rank's
        # stacks): a piece of a replica homed elsewhere is not read, nor its Nesterov input needed
        self.reads = frozenset([s.matrix for s in self.self_gather] + [s.matrix for lst in send_g for s in lst])
        self._buffers: Dict[str, object] = {}
        self.bytes_sent = sum(self.split_send_g) * gather_dtype.itemsize + sum(self.split_send_s) * scatter_dtype.itemsize
        self.bytes_received = (sum(self.split_recv_g) * gather_dtype.itemsize
                               + sum(self.split_recv_s) * scatter_dtype.itemsize)

    memory_budget: Optional[int] = None  # bytes of NS inputs the step fills in at a time (ds_muon.engine.memory.budget)

    # -- gather ---------------------------------------------------------------
    def gather_fill(self, local: Dict[int, torch.Tensor]) -> None:
        """Copy some of this rank's pieces (``local``, flat) to where the gather takes them from (the
        home stacks, the send buffer), so that their Nesterov inputs need not all exist at once;
        then :meth:`gather_start` with ``filled=True`` sends."""
        stacks = self._stacks()
        dst, src = [], []
        if self.self_gather:
            views = self._buffer("self_views", lambda: [self._flat_home_view(stacks, seg) for seg in self.self_gather])
            at = self._buffer("self_at", lambda: _positions(seg.matrix for seg in self.self_gather))
            for i in local:
                for k in at.get(i, ()):
                    dst.append(views[k])
                    src.append(local[i])
        if self.gather_traffic:
            segs = self.send_g
            buf = take(self._buffer("send_g", lambda: torch.empty(sum(self.split_send_g), dtype=self.gather_dtype,
                                                                 device=self.device)))
            views = self._buffer("send_g_views", lambda: _slices(buf, [seg.piece.numel for lst in segs for seg in lst]))
            at = self._buffer("send_at", lambda: _positions(seg.matrix for lst in segs for seg in lst))
            for i in local:
                for k in at.get(i, ()):
                    dst.append(views[k])
                    src.append(local[i])
        if dst:
            torch._foreach_copy_(dst, [s if s.dim() == d.dim() else s.reshape(d.shape) for d, s in zip(dst, src)])

    def _stacks(self) -> Dict[Hashable, torch.Tensor]:
        stacks = self._buffer("stacks", lambda: {
            key: torch.empty((len(idx), self.layout.matrices[idx[0]].rows, self.layout.matrices[idx[0]].cols),
                             dtype=self.gather_dtype, device=self.device)
            for key, idx in self.stacks.items()})
        take_all(stacks.values())  # memory lent back for this step (see ds_muon.engine.memory.lending)
        return stacks

    def home_destinations(self) -> Dict[int, torch.Tensor]:
        """``{matrix: flat view of its home stack}`` for the matrices whose piece on this rank goes only to
        this rank's own stack (one process; DDP's own homes): where the stack has the gradients' dtype (fp32
        NS: ``ns_dtype="auto"`` on an AVX2-only CPU, or pinned) the step writes their Nesterov inputs there
        itself, and :meth:`gather_start`'s copy of them is then a copy onto the same bytes, which torch skips
        (one pass fewer per matrix; bf16 stacks take the cast on that copy, as before)."""
        stacks = self._stacks()

        def build():
            sent = {seg.matrix for lst in self.send_g for seg in lst}
            seen = _positions(seg.matrix for seg in self.self_gather)
            views = self._buffer("self_views", lambda: [self._flat_home_view(stacks, seg) for seg in self.self_gather])
            return {seg.matrix: v for seg, v in zip(self.self_gather, views)
                    if len(seen[seg.matrix]) == 1 and seg.matrix not in sent and v.dim() == 1}
        return self._buffer("home_destinations", build)

    def gather_start(self, local: Optional[Dict[int, torch.Tensor]], filled: bool = False):
        """``local[i]``: this rank's piece of matrix i, flat.  Pack and issue the gather
        all_to_all without waiting (other domains' exchanges can be issued meanwhile);
        :meth:`gather_finish` waits and returns the home stacks ``{key: [k, rows, cols]}``
        filled with the full matrices.  Copies are one ``torch._foreach_copy_`` per direction
        into views of the kept buffers made once, not one copy call per piece.  ``filled``: the
        pieces were already copied in by :meth:`gather_fill` (``local`` is not read)."""
        stacks = self._stacks()
        if self.self_gather and not filled:
            homes = self._buffer("self_views", lambda: [self._flat_home_view(stacks, seg) for seg in self.self_gather])
            self._copy_all("self_views", homes, [local[seg.matrix] for seg in self.self_gather])
        if not self.gather_traffic:
            return stacks, None, None
        if filled:
            send = self._buffers["send_g"]
        else:
            send = self._pack("send_g", self.send_g, self.split_send_g, self.gather_dtype,
                              [local[seg.matrix] for lst in self.send_g for seg in lst])
        recv = take(self._buffer("recv_g", lambda: torch.empty(sum(self.split_recv_g), dtype=self.gather_dtype,
                                                               device=self.device)))
        work = self._move(recv, send, self.split_recv_g, self.split_send_g)
        return stacks, recv, (work, send)

    def gather_finish(self, pending) -> Dict[Hashable, torch.Tensor]:
        stacks, recv, work = pending
        if work is None:
            return stacks
        _wait(work[0])
        homes, parts = self._buffer("recv_g_views", lambda: (
            [self._flat_home_view(stacks, seg) for lst in self.recv_g for seg in lst],
            _slices(recv, [seg.piece.numel for lst in self.recv_g for seg in lst])))
        self._copy_all("recv_g_views", homes, parts)
        give_back_all((recv, work[1]))  # both sides of the gather are done with
        return stacks

    # -- scatter --------------------------------------------------------------
    def scatter_start(self, results: Dict[Hashable, torch.Tensor]):
        """``results``: the home stacks after NS (contiguous).  Pack and issue the scatter
        all_to_all without waiting; :meth:`scatter_finish` waits and returns, for each matrix
        this rank holds a piece of, that piece of the result: flat, or ``[rows, length]`` when
        it is not contiguous in the stack."""
        cuts = self._buffer("cuts", self._compile_cuts)
        kept = self._buffer("results", lambda: self._result_buffers(results))
        take_all(r for r in kept.values() if r._base is None)  # a result buffer of its own (wider than the stack)
        for key, r in results.items():  # one copy per stack: the pieces below are views made once
            if kept[key].data_ptr() != r.data_ptr():
                kept[key].copy_(r)
        pieces = self._buffer("result_pieces", lambda: {key: _pieces(kept[key], cut) for key, cut in cuts.items()})
        out = dict(self._buffer("own_results", lambda: {i: pieces[key][k] for i, (key, k) in self._own_cuts.items()}))
        if not self.scatter_traffic:
            return out, None, None
        send = self._pack("send_s", self.send_s, self.split_send_s, self.scatter_dtype,
                          self._buffer("send_s_sources", lambda: [pieces[key][k] for key, k in self._send_cuts]))
        recv = take(self._buffer("recv_s", lambda: torch.empty(sum(self.split_recv_s), dtype=self.scatter_dtype,
                                                               device=self.device)))
        work = self._move(recv, send, self.split_recv_s, self.split_send_s)
        return out, recv, (work, send)

    def scatter_finish(self, pending) -> Dict[int, torch.Tensor]:
        out, recv, work = pending
        if work is None:
            return out
        _wait(work[0])
        give_back(work[1])  # the send buffer; the received results are read by the apply (see done)
        mine = self.layout.matrices
        views = self._buffer("recv_s_views", lambda: dict(zip(
            self.recv_offset, _slices(recv, [mine[i].pieces[self.rank].numel for i in self.recv_offset]))))
        out.update(views)
        return out

    # -- helpers --------------------------------------------------------------
    def _move(self, recv: torch.Tensor, send: torch.Tensor, split_recv: List[int], split_send: List[int]):
        """Issue the exchange of ``send`` (cut by ``split_send``) into ``recv``: one all_to_all over
        the group, or (``p2p``) one batch of sends and receives with the nonzero splits only."""
        if self.transport == "all_to_all":
            return dist.all_to_all_single(recv, send, split_recv, split_send, group=self.group, async_op=True)
        ops = []
        for op, flat, splits in ((dist.irecv, recv, split_recv), (dist.isend, send, split_send)):
            for peer, part in enumerate(_slices(flat, splits)):
                if part.numel():
                    ops.append(dist.P2POp(op, part, group=self.group, group_peer=peer))
        return dist.batch_isend_irecv(ops) if ops else []

    def done(self) -> None:
        """The step is done with this exchange's results (applied): the memory of every kept
        buffer goes back until the next step (:mod:`~ds_muon.engine.memory.lending`); views stay."""
        give_back_all(self._bases())

    def _bases(self) -> List[torch.Tensor]:
        out = []
        for buf in self._buffers.values():
            for t in (buf.values() if isinstance(buf, dict) else [buf]):
                if torch.is_tensor(t) and t._base is None:
                    out.append(t)
        return out

    def release(self) -> None:
        """Drop the buffers kept across steps (an evicted exchange); a later use allocates anew,
        and a gather or scatter in flight keeps the tensors it holds until it finishes."""
        self._buffers.clear()

    def buffer_bytes(self) -> int:
        """Bytes of the buffers kept across steps while a step uses them (for memory reports and
        tests): the stacks and the send/receive buffers (and the results' own where wider than the
        stacks); the views and cut lists kept beside them alias those bytes.  Between steps their
        memory is given back (:meth:`held_bytes`)."""
        return sum(full_bytes(t) for t in {id(t): t for t in self._bases()}.values())

    def held_bytes(self) -> int:
        """Bytes the kept buffers hold now (0 between steps once :meth:`done`)."""
        return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in self._bases()}.values())

    def _home_view(self, stacks, seg: _Segment) -> torch.Tensor:
        key, j = self.slot[seg.matrix]
        return seg.piece.view_in(stacks[key][j].view(-1))

    def _flat_home_view(self, stacks, seg: _Segment) -> torch.Tensor:
        """Where ``seg`` lands in the home stacks: flat when contiguous there (as the pieces are)."""
        view = self._home_view(stacks, seg)
        return view.view(-1) if seg.piece.contiguous else view

    def _compile_cuts(self) -> Dict[Hashable, tuple]:
        """How to cut each result stack into the pieces this rank keeps or sends, in one
        ``split`` per stack: ``{key: (split sizes, which parts are pieces, strided pieces)}``.
        Pieces are identical (replicas) or disjoint; a strided one (a column block) is a view
        of its own.  Records where each piece is (``_own_cuts``, ``_send_cuts``)."""
        spans: Dict[Hashable, Dict[tuple, int]] = {}  # key -> {(start, end) or piece: part}
        where = {}

        def part(seg: _Segment) -> Tuple[Hashable, int]:
            key, j = self.slot[seg.matrix]
            m = self.layout.matrices[seg.matrix]
            span = ((j * m.numel + seg.piece.offset, j * m.numel + seg.piece.offset + seg.piece.numel)
                    if seg.piece.contiguous else (j, seg.piece))
            parts = spans.setdefault(key, {})
            if span not in parts:
                parts[span] = len(parts)
            return key, parts[span]

        mine = self.layout.matrices
        own = [i for i in self.active if mine[i].pieces[self.rank] is not None
               and mine[i].pieces[self.rank].numel > 0 and self.rank in self.homes[i]]
        for i in own:
            where[i] = part(_Segment(i, mine[i].pieces[self.rank]))
        sends = [part(seg) for lst in self.send_s for seg in lst]
        cuts = {}
        for key, by_span in spans.items():
            contiguous = sorted((s, k) for s, k in by_span.items() if isinstance(s[1], int))
            sizes, order, pos = [], {}, 0
            for (start, end), k in contiguous:
                if start > pos:
                    sizes.append(start - pos)
                order[k] = len(sizes)
                sizes.append(end - start)
                pos = end
            total = self.stacks_numel(key)
            if total > pos:
                sizes.append(total - pos)
            strided = {k: s for s, k in by_span.items() if not isinstance(s[1], int)}
            cuts[key] = (sizes, order, strided, len(by_span))
        self._own_cuts, self._send_cuts = where, sends
        return cuts

    def _result_buffers(self, results: Dict[Hashable, torch.Tensor]) -> Dict[Hashable, torch.Tensor]:
        """Where each stack's NS result is kept for the scatter and the apply: in the gather's stack
        (NS is done reading it), reinterpreted when the result's dtype is narrower (bf16 results in
        an fp32 stack), so keeping them costs no memory; a buffer of its own only when it is wider."""
        stacks = self._buffers.get("stacks", {})
        out = {}
        for key, r in results.items():
            s = stacks.get(key)
            nbytes = r.numel() * r.element_size()
            reuse = s is not None and s.is_contiguous() and nbytes <= s.numel() * s.element_size()
            if reuse and r.untyped_storage().data_ptr() == s.untyped_storage().data_ptr():
                # NS wrote its result into the stack's own memory (in chunks, ds_muon.engine.memory.budget): that is the view
                reuse = r.data_ptr() == s.data_ptr() and r.is_contiguous()
            if reuse:
                out[key] = s.view(-1).view(torch.uint8)[:nbytes].view(r.dtype).view(r.shape)
            else:
                out[key] = torch.empty_like(r, memory_format=torch.contiguous_format)
        return out

    def stacks_numel(self, key: Hashable) -> int:
        idx = self.stacks[key]
        return len(idx) * self.layout.matrices[idx[0]].numel

    def _buffer(self, name: str, make):
        """A buffer kept across steps: its sizes are fixed by the compiled exchange, and every
        use of the previous step's contents (waits, deferred applies) ends before the next step."""
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = make()
        return buf

    def _copy_all(self, name: str, dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
        """``dst[k].copy_(src[k])`` for all k in one call (``dst``: the kept views ``name``); a 2-D
        (strided) destination reads its flat source as ``[rows, length]`` and a 2-D source lands
        flat.  Which pairs differ in rank is worked out at the first use: sources keep their ranks."""
        if not dst:
            return
        at = self._buffer(name + "_reshape",
                          lambda: [k for k, (d, s) in enumerate(zip(dst, src)) if d.dim() != s.dim()])
        if at:
            src = list(src)
            for k in at:
                src[k] = src[k].reshape(dst[k].shape)
        torch._foreach_copy_(dst, src)

    def _pack(self, name, segs, splits, dtype, sources: List[torch.Tensor]) -> torch.Tensor:
        """``sources`` (one per segment of ``segs``, in order) copied into the kept send buffer."""
        buf = take(self._buffer(name, lambda: torch.empty(sum(splits), dtype=dtype, device=self.device)))
        views = self._buffer(name + "_views", lambda: _slices(buf, [seg.piece.numel for lst in segs for seg in lst]))
        self._copy_all(name, views, sources)
        return buf


def _wait(work) -> None:
    """Wait on an all_to_all's work or on every work of a p2p batch."""
    for w in (work if isinstance(work, list) else [work]):
        w.wait()


def _positions(matrices) -> Dict[int, List[int]]:
    """Where each matrix's segments are in a list of segments."""
    out: Dict[int, List[int]] = {}
    for k, i in enumerate(matrices):
        out.setdefault(i, []).append(k)
    return out


def _slices(flat: torch.Tensor, sizes: List[int]) -> List[torch.Tensor]:
    """``flat`` cut into consecutive pieces of ``sizes`` (views)."""
    total = sum(sizes)
    return list(flat[:total].split(sizes)) if sizes else []


def _pieces(stack: torch.Tensor, cut: tuple) -> List[torch.Tensor]:
    """The parts of one result stack named by :meth:`Exchange._compile_cuts`, by part number."""
    sizes, order, strided, n = cut
    parts = stack.view(-1).split(sizes) if order else ()
    out: List[torch.Tensor] = [None] * n  # type: ignore[list-item]
    for k, at in order.items():
        out[k] = parts[at]
    for k, (j, piece) in strided.items():
        out[k] = piece.view_in(stack[j].view(-1))
    return out
