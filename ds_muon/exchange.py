"""The fused exchange: every piece to its home in one all_to_all, results back in one more.

Compiled once per (Layout, active matrices, homes): which segment goes from
which rank to which, where it lands in the home's same-shape stacks, and the
split sizes.  A step then only packs, calls ``all_to_all_single`` and unpacks.
Nothing crosses the wire that the receiver already holds, and when no rank
needs to move anything the collective is skipped everywhere (every rank knows
the whole plan, so they all agree without talking).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Hashable, List, Sequence, Tuple

import torch
import torch.distributed as dist

from .layout import Layout, Piece


@dataclass
class _Segment:
    matrix: int  # index into the layout's matrices
    piece: Piece


class Exchange:
    """Moves pieces of ``layout.matrices[active]`` to their homes and results back.

    ``homes[i]`` is a tuple of ranks for ``layout.matrices[i]``: one rank in the
    sharded mode, every rank in the duplicated baseline.  ``stack_key[i]`` groups
    matrices that may share one batched NS call at a home (shape and NS settings).
    ``group`` (default ``layout.group``) holds the same ranks in the same order: the
    exchange's own communicator (:class:`~ds_muon.compile.ExchangeGroups`).
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
        for i in self.active:
            info = layout.matrices[i]
            hs = homes[i]
            for piece, holders in info.distinct_pieces():
                for hk, h in enumerate(hs):
                    if h in holders:
                        if h == r:
                            self.self_gather.append(_Segment(i, piece))
                        continue
                    src = holders[(i + hk) % len(holders)]
                    gather_traffic = True
                    if src == r:
                        send_g[h].append(_Segment(i, piece))
                    if h == r:
                        recv_g[src].append(_Segment(i, piece))
            for d, piece in enumerate(info.pieces):
                if piece is None or piece.numel == 0 or d in hs:
                    continue
                src = hs[d % len(hs)]
                scatter_traffic = True
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
        # Where each of r's own results arrives in the scatter receive buffer.
        self.recv_offset: Dict[int, int] = {}
        off = 0
        for lst in recv_s:
            for s in lst:
                self.recv_offset[s.matrix] = off
                off += s.piece.numel
        self._buffers: Dict[str, object] = {}
        self.bytes_sent = sum(self.split_send_g) * gather_dtype.itemsize + sum(self.split_send_s) * scatter_dtype.itemsize
        self.bytes_received = (sum(self.split_recv_g) * gather_dtype.itemsize
                               + sum(self.split_recv_s) * scatter_dtype.itemsize)

    # -- gather ---------------------------------------------------------------
    def gather_start(self, local: Dict[int, torch.Tensor]):
        """``local[i]``: this rank's piece of matrix i, flat.  Pack and issue the gather
        all_to_all without waiting (other domains' exchanges can be issued meanwhile);
        :meth:`gather_finish` waits and returns the home stacks ``{key: [k, rows, cols]}``
        filled with the full matrices."""
        stacks = self._buffer("stacks", lambda: {
            key: torch.empty((len(idx), self.layout.matrices[idx[0]].rows, self.layout.matrices[idx[0]].cols),
                             dtype=self.gather_dtype, device=self.device)
            for key, idx in self.stacks.items()})
        for seg in self.self_gather:
            self._home_view(stacks, seg).copy_(local[seg.matrix].view(seg.piece.rows, seg.piece.length))
        if not self.gather_traffic:
            return stacks, None, None
        send = self._pack("send_g", self.send_g, self.split_send_g, self.gather_dtype,
                          lambda seg: local[seg.matrix])
        recv = self._buffer("recv_g", lambda: torch.empty(sum(self.split_recv_g), dtype=self.gather_dtype,
                                                          device=self.device))
        work = dist.all_to_all_single(recv, send, self.split_recv_g, self.split_send_g, group=self.group,
                                      async_op=True)
        return stacks, recv, (work, send)

    def gather_finish(self, pending) -> Dict[Hashable, torch.Tensor]:
        stacks, recv, work = pending
        if work is None:
            return stacks
        work[0].wait()
        off = 0
        for lst in self.recv_g:
            for seg in lst:
                n = seg.piece.numel
                self._home_view(stacks, seg).copy_(recv[off:off + n].view(seg.piece.rows, seg.piece.length))
                off += n
        return stacks

    # -- scatter --------------------------------------------------------------
    def scatter_start(self, results: Dict[Hashable, torch.Tensor]):
        """``results``: the home stacks after NS (contiguous).  Pack and issue the scatter
        all_to_all without waiting; :meth:`scatter_finish` waits and returns, for each matrix
        this rank holds a piece of, that piece of the result as ``[rows, length]``."""
        out: Dict[int, torch.Tensor] = {}
        mine = self.layout.matrices
        for i in self.active:
            piece = mine[i].pieces[self.rank]
            if piece is not None and piece.numel > 0 and self.rank in self.homes[i]:
                out[i] = self._home_view(results, _Segment(i, piece))
        if not self.scatter_traffic:
            return out, None, None
        send = self._pack("send_s", self.send_s, self.split_send_s, self.scatter_dtype,
                          lambda seg: self._home_view(results, seg))
        recv = self._buffer("recv_s", lambda: torch.empty(sum(self.split_recv_s), dtype=self.scatter_dtype,
                                                          device=self.device))
        work = dist.all_to_all_single(recv, send, self.split_recv_s, self.split_send_s, group=self.group,
                                      async_op=True)
        return out, recv, (work, send)

    def scatter_finish(self, pending) -> Dict[int, torch.Tensor]:
        out, recv, work = pending
        if work is None:
            return out
        work[0].wait()
        mine = self.layout.matrices
        for i, off in self.recv_offset.items():
            piece = mine[i].pieces[self.rank]
            out[i] = recv[off:off + piece.numel].view(piece.rows, piece.length)
        return out

    # -- helpers --------------------------------------------------------------
    def release(self) -> None:
        """Drop the buffers kept across steps (an evicted exchange); a later use allocates anew,
        and a gather or scatter in flight keeps the tensors it holds until it finishes."""
        self._buffers.clear()

    def buffer_bytes(self) -> int:
        """Bytes held in buffers kept across steps (for memory reports and tests)."""
        out = 0
        for buf in self._buffers.values():
            for t in (buf.values() if isinstance(buf, dict) else [buf]):
                out += t.numel() * t.element_size()
        return out

    def _home_view(self, stacks, seg: _Segment) -> torch.Tensor:
        key, j = self.slot[seg.matrix]
        return seg.piece.view_in(stacks[key][j].view(-1))

    def _buffer(self, name: str, make):
        """A buffer kept across steps: its sizes are fixed by the compiled exchange, and every
        use of the previous step's contents (waits, deferred applies) ends before the next step."""
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = make()
        return buf

    def _pack(self, name, segs, splits, dtype, source) -> torch.Tensor:
        buf = self._buffer(name, lambda: torch.empty(sum(splits), dtype=dtype, device=self.device))
        off = 0
        for lst in segs:
            for seg in lst:
                n = seg.piece.numel
                buf[off:off + n].view(seg.piece.rows, seg.piece.length).copy_(
                    source(seg).reshape(seg.piece.rows, seg.piece.length))
                off += n
        return buf
