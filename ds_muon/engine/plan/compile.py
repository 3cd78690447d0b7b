"""Plan: from a Layout's active matrices to compiled :class:`~ds_muon.engine.exchange.all_to_all.Exchange` objects.

Per matrix: the dtypes that cross the wire (lossless by default: what NS would cast
to anyway), which matrices share one batched NS call (shape and NS settings), and
its homes (:func:`~ds_muon.engine.plan.planner.plan_multi_homes`: one, or several where the cost model
says duplicating NS beats sending the result; every rank in the duplicated baseline); then the matrices are cut into waves of about equal NS work.  The result
depends only on the layout, the active matrices and the settings, so the optimizer
compiles once per :func:`exchange_key` and reuses it (:class:`ExchangeCache`) while
that key keeps coming back.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, Hashable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from ..memory.budget import ChunkedNS, budget_bytes, split_by_bytes
from ..exchange.all_to_all import Exchange
from ..agreement.settings import as_dtype
from ..exchange.layout import Layout
from ..memory.offload import HostNS, accelerator, exchange_device, host_state
from ...rules.ns_auto import AUTO, group_device_type, resolve_dtype
from ...rules.newton_schulz import (compiled_newton_schulz, compute_dtype, input_dtype, newton_schulz, ns_flops,
                            resolve_coefficients, resolve_method)
from ..exchange.row_moments import is_normuon
from ..exchange.routes import replica_groups
from .cost_model import CostModel, MatrixTask
from .planner import plan_multi_homes
from .team_plan import plan_teams, rebalance_homes
from .team import TeamExchange, TeamGroups, TeamNS
from ..agreement.timeouts import new_group_like


class NSSettings(NamedTuple):
    """A group's Newton–Schulz settings, in :func:`~ds_muon.rules.newton_schulz.newton_schulz`'s order."""

    steps: int
    coefficients: object
    dtype: torch.dtype  # the dtype NS computes in (the method may pick it)
    eps: float
    method: str
    compile: bool = False  # run NS under torch.compile (not guaranteed bitwise equal to eager)
    device_type: str = "cpu"  # where NS runs: what ns_dtype/ns_method "auto" were resolved for (ns_auto)

    def method_for(self, rows: int, cols: int) -> str:
        """The iteration one (rows, cols) matrix runs: ``"auto"`` resolved for this shape and device."""
        return resolve_method(self.method, rows, cols, self.steps, self.dtype, self.device_type)

    def run(self, stack: torch.Tensor, out: Optional[torch.Tensor] = None,
            max_chunk: Optional[int] = None) -> torch.Tensor:
        """NS on ``stack``, the result contiguous: in ``out`` where given (which may be the stack's own
        memory: :class:`~ds_muon.engine.memory.budget.ChunkedNS`), ``max_chunk`` matrices at most per pass."""
        if not self.compile:
            return newton_schulz(stack, *self[:5], out=out, max_chunk=max_chunk)
        ns = compiled_newton_schulz()
        chunk = len(stack) if max_chunk is None else max(1, max_chunk)
        if chunk >= len(stack) and out is None:
            return ns(stack, *self[:5]).contiguous()
        out = torch.empty(stack.shape, dtype=self.dtype, device=stack.device) if out is None else out
        for k0 in range(0, len(stack), chunk):  # each chunk read before its results land (see ChunkedNS)
            out[k0:k0 + chunk].copy_(ns(stack[k0:k0 + chunk], *self[:5]))
        return out


def _ns_fields(group: dict) -> tuple:
    return (group["ns_steps"], group["ns_coefficients"], group["ns_dtype"], group["eps"], group["ns_method"],
            group.get("compile", False))


def ns_settings(group: dict, device_type: Optional[str] = None) -> NSSettings:
    """A group's NS settings for NS on ``device_type`` (default: where the group's tensors live, else
    this process's accelerator or CPU), ``ns_dtype="auto"`` resolved (:mod:`~ds_muon.rules.ns_auto`)."""
    steps, coefficients, dtype, eps, method, compiled = _ns_fields(group)
    if device_type is None:
        device_type = group_device_type(group)
    asked = resolve_dtype(dtype, device_type) if dtype == AUTO else as_dtype(dtype, "ns_dtype")
    return NSSettings(steps, coefficients, compute_dtype(method, asked), eps, method, bool(compiled), device_type)



def exchange_key(layout: Layout, todo: List[int], param_groups) -> tuple:
    """What compiled exchanges depend on: the layout, its active matrices, and the NS
    settings of every Muon group (they pick dtypes and stacks, and may change between steps),
    and its variant (NorMuon matrices never run as a team)."""
    return id(layout), tuple(todo), tuple(repr(_ns_fields(g) + (is_normuon(g),)) for g in param_groups if g["use_muon"])


EXCHANGES_PER_LAYOUT = 4  # sets of active matrices kept compiled per layout


class ExchangeCache:
    """Compiled exchanges by :func:`exchange_key`, at most ``per_layout`` keys per layout.

    The set of tensors with a gradient may change every step (MoE experts that get no
    tokens, frozen parts, ``set_to_none``); each set compiles its own exchanges with
    buffers sized for it.  Keeping every set ever seen grows memory without bound, so
    the least recently used key of a layout is evicted and its buffers released (an
    exchange still in flight keeps what it uses until it finishes).  A steady set of
    active tensors stays compiled, and an evicted set simply compiles again.
    """

    def __init__(self, per_layout: int = EXCHANGES_PER_LAYOUT):
        if per_layout < 1:
            raise ValueError(f"ds_muon: ExchangeCache(per_layout={per_layout}) must keep at least 1 key per layout")
        self.per_layout = per_layout
        self._by_key: "OrderedDict[tuple, list]" = OrderedDict()  # least recently used first
        self.compiled = 0  # how many keys were compiled (a count for tests and reports)

    def get(self, key: tuple, compile_fn: Callable[[], list]) -> list:
        """The exchanges of ``key`` (``key[0]`` names the layout), compiled on a miss."""
        hit = self._by_key.get(key)
        if hit is not None:
            self._by_key.move_to_end(key)
            return hit
        self._evict_for(key[0])
        out = self._by_key[key] = compile_fn()
        self.compiled += 1
        return out

    def _evict_for(self, layout_id) -> None:
        same = [k for k in self._by_key if k[0] == layout_id]
        for k in same[:max(0, len(same) - self.per_layout + 1)]:
            for ex, _ in self._by_key.pop(k):
                ex.release()

    def clear(self) -> None:
        for lst in self._by_key.values():
            for ex, _ in lst:
                ex.release()
        self._by_key.clear()

    def __len__(self) -> int:
        return len(self._by_key)

    def exchanges(self) -> List[Exchange]:
        return [ex for lst in self._by_key.values() for ex, _ in lst]


class ExchangeGroups:
    """The exchange's own process groups: one per set of ranks (and backend) a layout plans in.

    NCCL runs one communicator's collectives in issue order, so an exchange sharing
    FSDP's group would hold up the next forward's all-gathers (scatters) and the
    backward's reduce-scatters (gathers sent from backward).  ``dist.new_group`` is
    collective over the *world*: every world rank must call it for every group, in the
    same order, members or not.  :meth:`add` is called right after the layouts are
    built, so

    * a layout group spanning the world (every world rank just built that layout, in
      the same order) gets its own group with no further talk;
    * smaller groups (MoE expert domains, HSDP shard groups) get theirs only when every
      world rank steps this optimizer (``whole_world``): then all ranks list the groups
      they plan in (one ``all_gather_object`` per set of tensors, as the agreement does)
      and create the union in sorted order.  Otherwise (one pipeline stage's optimizer,
      a sub-mesh) ranks outside never get here, and the layout's own group is used.
    """

    def __init__(self):
        self._made: Dict[tuple, Optional[dist.ProcessGroup]] = {}  # (ranks, backend) -> group (None: keep)

    def add(self, groups: List[Optional[dist.ProcessGroup]], whole_world: bool) -> None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        world = dist.get_world_size()
        parents = {_ident(g): g for g in groups}  # a group made for these ranks inherits its timeout
        wanted = [w for w in parents if len(w[0]) > 1]
        if whole_world:
            everyone = [None] * world
            dist.all_gather_object(everyone, wanted)
            wanted = [w for theirs in everyone for w in theirs]
        else:
            wanted = [w for w in wanted if len(w[0]) == world]
        for ranks, backend in sorted(set(wanted)):
            if (ranks, backend) not in self._made:
                # new_group numbers ranks in sorted order; another order would move the exchange's ranks
                ok = list(ranks) == sorted(ranks)
                self._made[(ranks, backend)] = new_group_like(list(ranks), backend, parents.get((ranks, backend))) \
                    if ok else None

    def of(self, group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
        """The exchange's group for a layout of ``group`` (``group`` itself when none was made)."""
        if not (dist.is_available() and dist.is_initialized()):
            return group
        own = self._made.get(_ident(group))
        return own if own is not None else group


def _ident(group) -> Tuple[Tuple[int, ...], str]:
    """A group as every rank can name it: its global ranks in group-rank order, and its backend."""
    size = dist.get_world_size(group)
    ranks = tuple(dist.get_global_rank(group, r) if group is not None else r for r in range(size))
    return ranks, str(dist.get_backend(group))


def planner_task(layout: Layout, i: int, ns: NSSettings, wire_bytes: int) -> MatrixTask:
    """What the planner is told of matrix ``i`` of ``layout``: shape, NS cost, bytes per element on
    the wire, elements each rank holds and its replica groups (HSDP).  :func:`compile_exchanges`
    plans on it and :meth:`ds_muon.Muon.summary` reports it, so the two cannot drift apart."""
    info = layout.matrices[i]
    return MatrixTask(info.rows, info.cols, ns.steps, wire_bytes,
                      tuple(info.held_numel(r) for r in range(layout.world_size)), ns.method_for(info.rows, info.cols),
                      replica_groups([h for _, h in info.distinct_pieces()]))


def compile_exchanges(layout: Layout, todo: List[int], group_of: Dict[int, dict], *, mode: str, planner: str,
                      cost_model: CostModel, comm_dtype: Optional[torch.dtype], waves: int,
                      group: Optional[dist.ProcessGroup] = None,
                      offload: bool = False, team_ns: bool = False,
                      team_groups: Optional[TeamGroups] = None) -> List[Tuple[Exchange, Dict[Hashable, NSSettings]]]:
    """Plan homes and build one Exchange per (gather, scatter) dtype pair and wave; each
    comes with the NS settings of its stacks.  ``group_of`` maps a tensor's id to its group;
    ``group`` (default the layout's) is where the all_to_alls run (:class:`ExchangeGroups`).
    Pieces offloaded to host memory (``offload``, or :func:`~ds_muon.engine.memory.offload.host_state`) are
    orthogonalized on the accelerator (:mod:`~ds_muon.engine.memory.offload`).
    ``team_ns`` (with ``planner="auto"``): matrices whose NS bounds the step may run as a team of
    ranks (:func:`~ds_muon.engine.plan.team_plan.plan_teams`, :mod:`~ds_muon.engine.plan.team`), one :class:`TeamExchange`
    per dtype pair before the waves; ``team_groups`` makes their process groups (collective: the
    optimizer's; None, as in :meth:`ds_muon.Muon.summary`, plans the same teams without groups)."""
    by_dtypes: Dict[tuple, List[int]] = {}
    stack_key: Dict[int, Hashable] = {}
    ns_of: Dict[Hashable, NSSettings] = {}
    ns_at: Dict[int, NSSettings] = {}
    device, offloaded = None, False
    nbytes: Dict[int, int] = {}  # each matrix's bytes in its momentum's dtype (the memory budget's unit)
    for i in todo:
        b, _ = layout.local[i]
        info = layout.matrices[i]
        mom_dtype = b.flat(b.param).dtype
        nbytes[i] = layout.matrices[i].numel * mom_dtype.itemsize
        device = b.flat(b.param).device
        offloaded = host_state(b.param, offload)
        ns_device = device.type if not (offloaded and accelerator() is not None) else accelerator().type
        ns = ns_at[i] = ns_settings(group_of[id(b.param)], ns_device)
        if comm_dtype is not None:
            dts = (comm_dtype, comm_dtype)
        else:  # lossless: NS casts its input to this dtype first anyway
            first = input_dtype(ns.dtype)
            dts = (first if first.itemsize <= mom_dtype.itemsize else mom_dtype, ns.dtype)
        by_dtypes.setdefault(dts, []).append(i)
        coeffs, _ = resolve_coefficients(ns.coefficients, ns.steps)
        skey = (info.rows, info.cols, ns.steps, coeffs, ns.dtype, ns.eps, ns.method, ns.compile)
        stack_key[i] = skey
        ns_of[skey] = ns
    if todo and offloaded:
        host, device = device, exchange_device(device, group if group is not None else layout.group)
        if device == host:  # stacks assembled on the host: NS in chunks on the accelerator
            ns_of = {k: HostNS(ns) for k, ns in ns_of.items()}
    budget = budget_bytes(list(nbytes.values()))  # transients of a wave and of an NS call (ds_muon.engine.memory.budget)
    ns_of = {k: ns if isinstance(ns, HostNS) else ChunkedNS(ns, budget) for k, ns in ns_of.items()}
    compiled = []
    for (gdt, sdt), idx in by_dtypes.items():
        if mode == "duplicated":
            homes = {i: tuple(range(layout.world_size)) for i in idx}
        else:
            tasks = [planner_task(layout, i, ns_at[i], gdt.itemsize) for i in idx]
            planned = plan_multi_homes(tasks, layout.world_size, cost_model, planner)
            homes = dict(zip(idx, planned))
            if team_ns and planner == "auto" and not offloaded and _spans_world(layout):
                # NorMuon needs each row's whole mean square and the matrix's norm at one rank (and a
                # team is not bitwise): its matrices keep one home
                eligible = [team_eligible(layout, i, ns_at[i], device)
                            and not is_normuon(group_of[id(layout.local[i][0].param)]) for i in idx]
                at = plan_teams(tasks, layout.world_size, planned, cost_model, eligible)
                teams = {idx[p]: hs for p, hs in at.items()}
                if teams:  # the other matrices' homes, balanced around the teams
                    homes = dict(zip(idx, rebalance_homes(tasks, layout.world_size, planned, at, cost_model)))
                    compiled.append(_team_exchange(layout, teams, ns_at, gdt, sdt, device, group, team_groups))
                    idx = [i for i in idx if i not in teams]
        cost = [ns_flops(layout.matrices[i].rows, layout.matrices[i].cols, ns_at[i].steps,
                         ns_at[i].method_for(layout.matrices[i].rows, layout.matrices[i].cols)) for i in idx]
        cut = split_waves(idx, cost, waves) if idx else []
        if layout.world_size == 1:  # nothing to overlap: waves of bounded memory, each run whole in turn
            cut = split_by_bytes(cut, nbytes, budget)
        for wave in cut:
            ex = Exchange(layout, wave, homes, stack_key, gdt, sdt, device, group, transport=cost_model.transport)
            ex.memory_budget = budget
            compiled.append((ex, ns_of))
    return compiled


def team_eligible(layout: Layout, i: int, ns: NSSettings, device) -> bool:
    """May matrix ``i`` run as a team?  Its pieces are contiguous ranges (a tensor-parallel column
    block is not: :class:`~ds_muon.engine.plan.team.TeamExchange` cuts ranges), it runs eagerly, and its
    iteration is the standard one or ``"auto"``'s to choose: a team iterates the standard way, so a matrix
    ``"auto"`` would give the Gram iteration at one home is teamed where the cost model finds the team's
    step shorter than Gram's at one home (:func:`~.team_plan.plan_teams` costs the home at the method it
    resolves to); a pinned ``ns_method="gram"`` keeps its iteration (and its home)."""
    info = layout.matrices[i]
    method = resolve_method(ns.method, info.rows, info.cols, ns.steps, ns.dtype, ns.device_type)
    return ((method == "standard" or ns.method == "auto") and not ns.compile
            and all(p is None or p.numel == 0 or p.contiguous for p in info.pieces))


def _spans_world(layout: Layout) -> bool:
    """Teams need groups of their own, and ``dist.new_group`` is collective over the world: only
    a layout whose group is the world (every rank compiles its plan at the same step) gets teams."""
    if layout.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return False
    return layout.world_size == dist.get_world_size()


def _team_exchange(layout: Layout, teams: Dict[int, Tuple[int, ...]], ns_at: Dict[int, NSSettings], gdt, sdt,
                   device, group, team_groups: Optional[TeamGroups]):
    """The :class:`TeamExchange` of ``teams`` and each member's :class:`TeamNS`, keyed by its block.
    Team groups hold global ranks; they are made (collectively) here, in one sorted order."""
    def global_ranks(members):
        if layout.group is None:
            return tuple(members)
        return tuple(dist.get_global_rank(layout.group, r) for r in members)

    if team_groups is not None:
        team_groups.make([global_ranks(hs) for hs in teams.values()], layout.group)
    ex = TeamExchange(layout, sorted(teams), teams, gdt, sdt, device, group)
    info = layout.matrices
    ns_of = {("team", i): TeamNS(ns_at[i], info[i].rows, info[i].cols,
                                 team_groups.get(global_ranks(teams[i])) if team_groups is not None else None)
             for i in ex.blocks}
    return ex, ns_of


def split_waves(idx: List[int], cost: List[float], waves: int) -> List[List[int]]:
    """Contiguous runs of the matrices in model order with about equal NS work (``cost``)
    each, so early waves hold the parameters the next forward needs first."""
    if waves <= 1 or len(idx) <= 1:
        return [list(idx)]
    total, out, cur, acc = sum(cost), [], [], 0.0
    for i, c in zip(idx, cost):
        cur.append(i)
        acc += c
        if acc >= total * (len(out) + 1) / waves and len(out) < waves - 1:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out
