"""Gathers sent from backward: each wave's, as soon as its gradients are final.

With ``Muon(..., overlap=True, model=model)`` every step after the first hooks the
post-accumulate-grad hook of each Muon parameter whose gradient is *final* when that
hook fires: FSDP2 calls it after the unit's reduce-scatter (and HSDP all-reduce), and
a single process has nothing left to reduce.  When the last gradient of a wave
arrives, the hook computes the wave's momentum into scratch tensors and issues its
gather; ``step()`` then finds the gathers in flight and only runs NS and the
scatters.  Stacks whose hooks fire before the reduction (DDP, FSDP1, DeepSpeed)
keep dispatching at ``step()``.

Why this stays bitwise equal to ``overlap=False`` and cannot deadlock:

* the hooks fire in the same order on every rank (FSDP2 fires them right after a
  collective that every rank runs in the same order), and a wave is dispatched when
  its count of outstanding parameters reaches zero, so every rank issues the same
  all_to_alls in the same order; a wave whose parameters get no gradient is simply
  dispatched at ``step()``, on every rank alike;
* nothing in the optimizer state changes before ``step()``: the new momentum waits
  in scratch and is committed only after the step's one all_reduce has agreed that
  the gradients are good;
* that same all_reduce carries one more flag, "an early dispatch is stale": a
  gradient or setting changed after backward ended (gradient clipping or unscaling
  between backward and step, a momentum schedule).  If any rank raises it, every
  rank waits out its early gathers and redoes them at ``step()`` — exact, but with
  nothing hidden.  A change is seen through the gradient object, its version
  counters, or its min and max; code that edits gradients in place while keeping
  every tensor's extremes (and, through DTensor foreach ops, its version counters)
  should pass ``dispatch_in_backward=False``;
* a hook firing a second time for a parameter (gradient accumulation that reduces
  every micro-batch, or a backward without a step) drains what was dispatched and
  starts counting again, so only the last micro-batch's dispatch survives.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..exchange.layout import local_shard


@dataclass
class Wave:
    key: tuple  # (id(layout), active matrices): which compiled exchanges these are
    layout: object
    exchange: object
    params: Dict[int, torch.Tensor]  # id -> parameter whose gradients the wave needs


@dataclass
class _Early:
    """A wave dispatched from backward: its gather in flight, its momentum in scratch."""

    pending: tuple
    commits: List[Tuple[torch.Tensor, torch.Tensor]]  # (momentum buffer slice, new value)
    seen: Optional[List[tuple]]  # see _snapshot
    hyper: tuple  # the settings the momentum was computed with


class BackwardDispatch:
    """The hooks, the readiness counts of one backward, and the waves in flight.

    From the optimizer: ``inputs(layout, exchange, commit=False)`` returns one wave's
    ``(pieces, commits)``; ``hyper(param_ids)`` the settings those depend on;
    ``before(param_ids)`` lands any update still deferred on those parameters.
    """

    def __init__(self, inputs: Callable, hyper: Callable[[set], tuple], before: Callable[[set], None]):
        self._inputs = inputs
        self._hyper = hyper
        self._before = before
        self._handles: list = []
        self._armed_for: Optional[tuple] = None
        self._waves: List[Wave] = []
        self._waves_of: Dict[int, List[int]] = {}
        self._remaining: List[int] = []
        self._seen: set = set()
        self._early: Dict[int, _Early] = {}  # wave index -> in flight
        self._settle_queued = False
        self.dispatched = 0  # waves dispatched from backward and used by the last step
        self.redone = 0  # steps whose early dispatches were stale and redone at step()

    # -- set-up -----------------------------------------------------------------------------
    def arm(self, waves: List[Wave]) -> None:
        """Hook the parameters of ``waves`` (the exchanges the last step used)."""
        sig = tuple((w.key, id(w.exchange)) for w in waves)
        if sig == self._armed_for:
            return
        self.disarm()
        self._armed_for = sig
        self._waves = waves
        for k, w in enumerate(waves):
            for pid in w.params:
                self._waves_of.setdefault(pid, []).append(k)
        hooked = {}
        for w in waves:
            hooked.update(w.params)
        me = weakref.ref(self)  # an optimizer dropped without disarming must not dispatch

        def hook(p):
            live = me()
            if live is not None:
                live._on_grad(p)

        for p in hooked.values():
            self._handles.append(p.register_post_accumulate_grad_hook(hook))
        self._reset()

    def disarm(self) -> None:
        self.drain()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._armed_for = None
        self._waves, self._waves_of = [], {}
        self._reset()

    def _reset(self) -> None:
        self._remaining = [len(w.params) for w in self._waves]
        self._seen = set()

    # -- backward -----------------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        pid = id(p)
        if pid in self._seen:  # accumulation, or a backward whose step never came
            self.drain()
        if not self._settle_queued:
            self._settle_queued = True
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._settle)
            except RuntimeError:  # not inside a backward: the snapshots taken at dispatch stand
                self._settle_queued = False
        self._seen.add(pid)
        for k in self._waves_of.get(pid, ()):
            self._remaining[k] -= 1
            if self._remaining[k] == 0:
                self._dispatch(k)

    def _dispatch(self, k: int) -> None:
        w = self._waves[k]
        self._before(set(w.params))
        pieces, commits = self._inputs(w.layout, w.exchange, commit=False)
        seen = None if self._settle_queued else _snapshot(w.params)  # else taken when backward ends
        self._early[k] = _Early(w.exchange.gather_start(pieces), commits, seen, self._hyper(set(w.params)))

    def _settle(self) -> None:
        """At the end of backward, what later changes are measured against: the gradients of
        one FSDP unit share a version counter, which its later parameters' reductions move."""
        self._settle_queued = False
        for k, e in self._early.items():
            e.seen = _snapshot(self._waves[k].params)

    # -- step -----------------------------------------------------------------------------------
    def stale(self, minmax: Dict[int, torch.Tensor]):
        """Did anything an early dispatch read change since the end of backward?  ``minmax``
        holds each local gradient's (min, max) as the step computed them.  (Local; the
        optimizer agrees on the answer across ranks in its gradient check.)  A bool, or a
        0-d tensor on the gradients' device when only the extremes can tell: the check
        reads it with everything else, in its one device-to-host read."""
        before, now = [], []
        for k, e in self._early.items():
            if e.seen is None or self._hyper(set(self._waves[k].params)) != e.hyper:
                return True
            for q, grad_id, versions, extremes in e.seen:
                if q.grad is None or id(q.grad) != grad_id or _versions(q) != versions:
                    return True
                if extremes is not None:
                    if id(q) not in minmax:
                        return True
                    before.append(extremes)
                    now.append(minmax[id(q)])
        if not before:
            return False
        # != also flags NaN extremes (NaN is unequal to itself), as torch.equal did
        return (torch.stack(before) != torch.stack(now)).any()

    def claim(self, exchanges: List[object]) -> Dict[int, tuple]:
        """The in-flight gathers of these exchanges (by id), with their momentum committed;
        every other early dispatch is waited out and dropped.  Ends this backward's round."""
        wanted = {id(ex) for ex in exchanges}
        out = {}
        for k, e in self._early.items():
            ex = self._waves[k].exchange
            if id(ex) in wanted:
                for buf, new in e.commits:
                    if new.is_cuda:  # made on FSDP's reduce-scatter stream, read on this one
                        new.record_stream(torch.cuda.current_stream(new.device))
                    buf.copy_(new)
                out[id(ex)] = e.pending
            else:
                ex.gather_finish(e.pending)
        self._early = {}
        self.dispatched = len(out)
        self._reset()
        return out

    def redo(self) -> None:
        """Every rank found an early dispatch stale: wait them out; step() gathers afresh."""
        self.redone += 1
        self.drain()

    def drain(self) -> None:
        """Wait out every early gather (every rank issued the same ones) and forget them."""
        for k, e in self._early.items():
            self._waves[k].exchange.gather_finish(e.pending)
        self._early = {}
        self._reset()

    @property
    def in_flight(self) -> int:
        return len(self._early)


def _snapshot(params: Dict[int, torch.Tensor]) -> List[tuple]:
    """What would show a later change: the gradient object, the version counters of gradient
    and parameter (a DTensor's wrapper and local tensor each miss some in-place ops: foreach
    ops on DTensors move neither), and the gradient's min and max (scaling, as clipping and
    unscaling do, moves them)."""
    out = []
    for q in params.values():
        local = local_shard(q.grad)
        extremes = torch.stack(torch.aminmax(local)) if local.numel() else None
        out.append((q, id(q.grad), _versions(q), extremes))
    return out


def _versions(q: torch.Tensor) -> tuple:
    return (q.grad._version, local_shard(q.grad)._version, q._version, local_shard(q)._version)

