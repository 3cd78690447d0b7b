"""One step through the stages, in order: what ``Muon.step`` runs after its own checks.

:class:`StepRuntime` owns everything a step caches or hooks (bindings, layouts, compiled
exchanges, process groups, the agreement, wave pieces, the overlap hooks) and reads the
optimizer's ``param_groups``, ``state`` and settings through the optimizer it is given.
:meth:`StepRuntime.run`'s stages (every stack goes through the same path):

1. check (:mod:`~ds_muon.engine.agreement.check`), before anything changes: gradient presence
   agrees across ranks and every gradient is finite (one small all_reduce), with the optimizer's
   failed local checks (:class:`~ds_muon.engine.agreement.local_failure.LocalFailure`) raised on every rank;
2. active matrices: which matrices of each layout (one per process group) step;
3. plan (:mod:`~ds_muon.engine.plan.compile`): homes, wire dtypes and waves, compiled once into
   :class:`~ds_muon.engine.exchange.all_to_all.Exchange` objects;
4. AdamW (:mod:`~ds_muon.rules.adamw`) on ``use_muon=False`` tensors and the AdamW slices of mixed flat
   shards, after stages 2-3 (which write nothing and may refuse), so a refused step changes nothing;
5. per batch of waves: gather (momentum on local pieces, :mod:`~ds_muon.rules.update`, then the
   matrices travel whole to their homes), orthogonalize (NS at home, batched by shape; NorMuon), apply
   (each rank's pieces of the results, in place, or by the next forward);
6. arm (``overlap=True``): the next backward sends the gathers whose gradients are final then.

(Over 400 lines, as one class: every stage reads the same caches, bindings, layouts, compiled exchanges,
wave pieces and overlap hooks, and a stage split off would only be handed them back; what needs none of
them is beside it: :mod:`.binding`, :mod:`.state`, :mod:`~ds_muon.rules.adamw`.)
"""

from __future__ import annotations

import warnings
import weakref
from typing import Callable, Dict, Hashable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from ..rules.adamw import adamw_
from .agreement.check import Agreement
from .agreement.fingerprints import settings_of
from .agreement.local_failure import LocalFailure
from .binding import bind_all, layouts_of, param_name, signature
from .exchange.all_to_all import Exchange
from .exchange.layout import Layout, ParamBinding, local_shard
from .exchange.pieces import WavePieces
from .exchange.row_moments import RowMoments, agree_after_load, is_normuon
from .overlap import Wave
from .plan.compile import ExchangeCache, ExchangeGroups, NSSettings, compile_exchanges, exchange_key
from .plan.team import TeamGroups
from .state import fill_state, state_key

DEFAULT_ADAM_LR = 3e-4  # for the AdamW slices of mixed flat shards without "adam_lr" (as muon_param_groups)


class Job(NamedTuple):
    """One wave's exchange and what the step needs to run it."""

    key: tuple  # the compiled exchanges it belongs to (see ds_muon.engine.plan.compile.exchange_key)
    layout: Layout
    exchange: Exchange
    ns_of: Dict[Hashable, NSSettings]  # per stack of same-shape matrices at this rank


def params_of(layout: Layout, idx) -> Dict[int, torch.Tensor]:
    """The parameters holding matrices ``idx`` of ``layout``, by id, in order."""
    return {id(layout.local[i][0].param): layout.local[i][0].param for i in idx}


class StepRuntime:
    """The caches and hooks of one optimizer's steps, all rebuilt lazily, and the stages that use them.

    ``opt``: the optimizer (its ``param_groups``, ``state``, settings and ``adapter`` are read through it,
    never copied); ``context(process_group, model, options=...)``: makes the adapter's context (the
    optimizer passes its stack's ``BindContext``).  What it hooks onto parameters and modules holds it
    weakly or not at all (a deferred update is a closure over its pieces, :meth:`applier`): a dropped
    optimizer neither dispatches from backward nor is kept alive by its deferred updates."""

    def __init__(self, opt, context: Callable[..., object]):
        self.opt = opt
        self._context = context
        self.deferred, self.dispatch = opt.overlap_settings.hooks(opt.model, self.wave_inputs, self.hyper, self.land)
        self.bindings: Dict[int, ParamBinding] = {}
        self.layouts: List[Layout] = []
        self.signature: Optional[tuple] = None  # what the bindings were made for (see binding.signature)
        self.resolved: Dict[tuple, tuple] = {}  # signature -> (bindings, layouts), every set bound so far
        self.state_key: Optional[tuple] = None  # what fill_state last filled (see state.state_key)
        self.settled: set = set()  # ids of Muon tensors whose state needs only a momentum buffer
        self.exchanges = ExchangeCache()
        self.exchange_groups = ExchangeGroups()  # the exchange's own process groups, kept across re-sharding
        self.team_groups = TeamGroups()  # team NS's process groups (one per member set), kept likewise
        self.agreement = Agreement()  # the step's check (caches rows and the mesh group)
        self.final_grads: Optional[tuple] = None  # (signature, ids whose grad hooks see final grads)
        self.pieces: "weakref.WeakKeyDictionary[Exchange, WavePieces]" = weakref.WeakKeyDictionary()
        self.pieces_members: Optional[tuple] = None  # (id, size) of each param group the pieces were sorted by
        self.step_token: Optional[object] = None  # this step's, for the views checked in it (see WavePieces)
        self.moments_loaded: Optional[set] = None  # since a load: the layouts whose NorMuon v every rank agreed on
        self.summary_logged = False  # the first step's log line (see report.summary.log_first_step)
        self.summary_seen: Optional[tuple] = None  # (signatures, groups) log_first_step has seen (DeepSpeed)
        self.warned_no_grads = False  # a step that found no gradient at all warns once (see check_gradients)

    # -- bindings, layouts and state (rebuilt when parameters change) -------------------------------
    def name(self, gi: int, pi: int) -> str:
        return param_name(self.opt.param_groups, gi, pi)

    def resolve(self) -> None:
        """Bindings and layouts for the Muon tensors now in ``param_groups``, cached per set of tensors
        (and their shapes; a DTensor's spec): a stack that swaps parameters (accelerate, FSDP2 built
        after the optimizer) gets new layouts; one that narrows ``param_groups`` per call (DeepSpeed)
        reuses each set's."""
        sig = signature(self.opt.param_groups)
        if sig == self.signature:
            return
        if sig not in self.resolved:
            bindings = self.bind_all()
            layouts = layouts_of(bindings)
            self.exchange_groups.add([lay.group for lay in layouts], self.whole_world(sig))
            self.resolved[sig] = (bindings, layouts)
        self.bindings, self.layouts = self.resolved[sig]
        self.signature = sig
        self.settled = set()
        self.state_key = None  # new bindings may need new state keys (AdamW slices)

    def bind_all(self) -> Dict[int, ParamBinding]:
        """Each Muon tensor's binding from this rank's metadata alone (see :func:`.binding.bind_all`)."""
        opt = self.opt
        return bind_all(opt.param_groups, opt.adapter, lambda g: self._context(opt.process_group, opt.model, g))

    def local_bindings(self) -> Dict[int, ParamBinding]:
        """The bindings of the current tensors with no collective: the bound ones, else bound now on this rank
        alone (a stack that binds only inside ``step()``, DeepSpeed's ZeRO-3: none, the step checks then)."""
        if self.signature is not None and self.signature == signature(self.opt.param_groups):
            return self.bindings
        try:
            return self.bind_all()
        except Exception:  # noqa: BLE001 - binding refused here: the step binds and checks (check_moments)
            return {}

    def binding_is_collective(self) -> bool:
        """Would binding the tensors now communicate (a multi-rank run whose current tensors are unbound)?"""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return False
        return signature(self.opt.param_groups) not in self.resolved

    def step_group(self):
        """The group the step's collectives run in, and its size (see :meth:`Agreement.group`)."""
        return self.agreement.group(self.opt.process_group, self.opt.param_groups, self.signature)

    def whole_world(self, sig) -> bool:
        """Does every world rank step this optimizer (its step group is the world)?"""
        group, size = self.agreement.group(self.opt.process_group, self.opt.param_groups, sig)
        return size > 1 and size == dist.get_world_size()

    def stack_allows_overlap(self) -> bool:
        """May results be deferred to the next forward and gathers leave from backward?  Not
        when the stack copies results out right after ``step()`` (DeepSpeed)."""
        return not self.opt.adapter.applies_in_step

    def invalidate(self) -> None:
        """Forget every binding, layout and compiled exchange (after re-sharding)."""
        self.resolved.clear()
        self.exchanges.clear()
        self.agreement.clear()
        self.pieces.clear()
        self.final_grads = None
        self.signature = None
        if self.deferred is not None:
            self.deferred.reset_owners()
        if self.dispatch is not None:
            self.dispatch.disarm()

    def state_replaced(self) -> None:
        """A new state dict (a load): every tensor's state is looked at again, and the pieces' views of
        the old momentum buffers go (they would keep them alive)."""
        self.state_key = None
        self.pieces.clear()

    def init_state(self) -> None:
        """State for every tensor at once (:mod:`.state`), skipped while nothing can be missing."""
        key = state_key(self.opt.param_groups, self.opt.state)
        if key == self.state_key:
            return
        self.fill_state()
        self.state_key = (id(self.opt.state), len(self.opt.state), key[2])

    def fill_state(self) -> None:
        fill_state(self.opt.param_groups, self.opt.state, self.bindings, self.settled)

    def prepare(self) -> None:
        """Before the optimizer's state checks: the previous step's deferred updates land, and the
        current tensors are bound and hold every state key."""
        self.flush()
        self.resolve()
        self.init_state()

    # -- the step -------------------------------------------------------------------------------------
    def run(self, failed: Optional[Exception] = None) -> None:
        """The stages, in order (see the module docstring); ``failed``: this rank's failed local check
        (:class:`~ds_muon.engine.agreement.local_failure.LocalFailure`), raised on every rank in stage 1."""
        self.step_token = object()
        active = self.check(failed)  # 1. which tensors step, agreed by every rank
        if active is None:
            return
        work = self.active_matrices(active)  # 2. each layout's matrices that step
        jobs = self.plan(work) if work else []  # 3. compiled exchanges: homes, dtypes, waves
        self.adamw(active)  # 4. after the plan, so a step that raises before its first write changes nothing
        if not work:
            self.drain_early()
            return
        for batch in self.batches(jobs):  # 5.
            gathers = self.gather(batch)  # momentum on local pieces, gathers issued
            scatters = self.orthogonalize(batch, gathers)  # NS at home, scatters issued
            self.apply(batch, scatters)  # results applied (or deferred to forward)
        if self.dispatch is not None and self.stack_allows_overlap():
            self.arm(jobs)  # 6. the next backward sends the gathers whose gradients are final

    def check(self, failed=None) -> Optional[set]:
        """Stage 1: the agreement (:meth:`check_gradients`); early gathers are waited out
        when the step raises or is skipped."""
        try:
            active = self.check_gradients(failed)
        except BaseException:
            self.drain_early()
            raise
        if active is None:
            self.drain_early()
        return active

    def check_gradients(self, failed=None) -> Optional[set]:
        """Which tensors step, agreed by every rank before anything changes
        (:class:`~ds_muon.engine.agreement.check.Agreement`).  Returns None when the step is skipped."""
        opt = self.opt
        items = [(gi, pi, p) for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])]
        place = getattr(opt.adapter, "place_grads", None)  # the stack's gradients laid out like their params
        if place is not None:  # a gradient refused on one rank is refused on every rank, through the agreement
            failed = failed or LocalFailure.catch(lambda: place(items, self.name))
        group, world = self.step_group()
        verdict = self.agreement.check(items, self.name, group, world,
                                       settings_of(opt) if world > 1 else None, self.dispatch, failed)
        if verdict.nonfinite:
            name = verdict.nonfinite[0]
            if opt.nonfinite == "raise":
                raise FloatingPointError(
                    f"ds_muon: non-finite gradient in {name} (and {len(verdict.nonfinite) - 1} more); nothing "
                    "was changed. Pass nonfinite='skip' to skip such steps instead"
                )
            opt.nonfinite_skips += 1
            warnings.warn(
                f"ds_muon: skipped step: non-finite gradient in {name} "
                f"({opt.nonfinite_skips} step(s) skipped so far)", RuntimeWarning, stacklevel=4)
            return None
        if not verdict.active and items:
            self.warn_no_gradients(len(items), group, world)
        return verdict.active

    def warn_no_gradients(self, count: int, group, world: int) -> None:
        """Once, on the step group's rank 0: no tensor of this Muon had a gradient on any rank (the agreement's
        all_reduce says so), so nothing trained.  A Muon built on tensors a stack replaced after (Fabric or
        ``fully_shard`` sharding the model after the optimizer was built) steps nothing, silently, every step."""
        if self.warned_no_grads:
            return
        self.warned_no_grads = True
        if world > 1 and dist.get_rank(group) != 0:
            return
        warnings.warn(
            f"ds_muon: a step found no gradient on any of this Muon's {count} tensor(s), so nothing was updated; the "
            "tensors it holds are not the ones backward reached. Build the optimizer after the model is sharded "
            "(fully_shard, Fabric's setup replace the parameters), on the model's own parameters, and call step() "
            "after backward. (Warned once.)", RuntimeWarning, stacklevel=5)

    def active_matrices(self, active: set) -> List[Tuple[Layout, List[int]]]:
        """Stage 2: each layout (one per process group) with the indices of its matrices that step."""
        work = []
        for layout in self.layouts:
            todo = [i for i, (b, _) in enumerate(layout.local) if id(b.param) in active]
            if todo:
                work.append((layout, todo))
        return work

    def plan(self, work) -> List[Job]:
        """Stage 3: the compiled exchanges of each layout's active matrices (:mod:`~ds_muon.engine.plan.compile`),
        planned on first use and cached (a few sets of active matrices per layout) while the
        layout and NS settings stay."""
        opt, jobs = self.opt, []
        for layout, todo in work:
            key = exchange_key(layout, todo, opt.param_groups)
            compiled = self.exchanges.get(key, lambda: compile_exchanges(
                layout, todo, self.muon_groups(), mode=opt.mode, planner=opt.planner,
                cost_model=opt.planning_cost_model(),
                comm_dtype=opt.comm_dtype, waves=opt.waves, group=self.exchange_groups.of(layout.group),
                offload=bool(getattr(opt.adapter, "offload", False)),
                team_ns=opt.team_ns, team_groups=self.team_groups))
            jobs.extend(Job(key, layout, ex, ns_of) for ex, ns_of in compiled)
        return jobs

    def adamw(self, active: set) -> None:
        """Stage 4: AdamW (:func:`~ds_muon.rules.adamw.adamw_`) on the local shards of ``use_muon=False``
        groups and on the ``adam_ranges`` slices of mixed flat shards in Muon groups (FSDP1)."""
        opt = self.opt
        for g in opt.param_groups:
            if not g["use_muon"]:
                params = self._with_gradients([p for p in g["params"] if id(p) in active])
                st = [opt.state[p] for p in params]
                adamw_([local_shard(p) for p in params], [local_shard(p.grad) for p in params],
                       [local_shard(s["exp_avg"]) for s in st], [local_shard(s["exp_avg_sq"]) for s in st],
                       [s["step"] for s in st], lr=g["lr"], betas=g["betas"], eps=g["eps"],
                       weight_decay=g["weight_decay"], weight_decay_mode=g.get("weight_decay_mode", "decoupled"),
                       foreach=g.get("foreach"),
                       kernel=getattr(opt, "adamw_kernel", None))  # opt-in: ds_muon.integrations.deepspeed_cpu_adam
            elif any(b.has_adam for b in (self.bindings.get(id(p)) for p in g["params"]) if b is not None):
                self._adamw_ranges(g, [p for p in g["params"] if id(p) in active])

    def _adamw_ranges(self, group: dict, params: List[torch.Tensor]) -> None:
        """AdamW on the ``adam_ranges`` slices of mixed flat shards in a Muon group (FSDP1).

        Hyper-parameters: the group's ``adam_lr`` (default 3e-4, as in ``muon_param_groups``),
        ``adam_betas``/``adam_eps`` (default the optimizer's), ``adam_weight_decay`` (default 0),
        decayed by the optimizer's ``weight_decay_mode`` (the mode an AdamW group of
        ``muon_param_groups`` takes).  One step count per tensor, shared by its slices."""
        opt, views = self.opt, ([], [], [], [], [])
        for p in self._with_gradients([p for p in params if self.bindings[id(p)].has_adam]):
            b, st = self.bindings[id(p)], opt.state[p]
            flats = [b.flat(t) for t in (p, p.grad, st["exp_avg"], st["exp_avg_sq"])]
            for off, n in b.adam_ranges:
                for lst, f in zip(views, flats):
                    lst.append(f[off:off + n])
                views[4].append(st["step"].clone())  # each slice steps its own copy ...
            st["step"] += 1  # ... and the tensor's count moves once
        adamw_(*views, lr=group.get("adam_lr", DEFAULT_ADAM_LR), betas=group.get("adam_betas", opt.adam_betas),
               eps=group.get("adam_eps", opt.adam_eps), weight_decay=group.get("adam_weight_decay", 0.0),
               weight_decay_mode=opt.defaults["weight_decay_mode"], foreach=group.get("foreach"))

    def _with_gradients(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """Params with a gradient; a grad-less one (no local elements, FSDP1) only counts the step."""
        out = []
        for p in params:
            if p.grad is None:
                self.opt.state[p]["step"] += 1
            else:
                out.append(p)
        return out

    def batches(self, jobs: List[Job]) -> List[List[Job]]:
        """Stage 5 runs on all waves together (every gather issued before any NS), or, when no
        wave moves anything (one process) and none left from backward, on one wave after another:
        then one wave's transients live at a time (waves of bounded memory: ds_muon.engine.memory.budget)."""
        if self.dispatch is None and not any(j.exchange.gather_traffic or j.exchange.scatter_traffic for j in jobs):
            return [[j] for j in jobs]
        return [jobs]

    def gather(self, jobs: List[Job]) -> list:
        """Every wave's gather issued (of every domain) before any is waited on; a wave's momentum is
        computed just before its gather, so one wave's NS inputs live at a time.  Gathers a backward
        hook already issued are claimed (their momentum committed now)."""
        early = self.dispatch.claim([j.exchange for j in jobs]) if self.dispatch is not None else {}
        return [early[id(j.exchange)] if id(j.exchange) in early else self._gather_one(j) for j in jobs]

    def _gather_one(self, j: Job):
        """One wave's inputs into its gather, at most the exchange's memory budget of them at a time."""
        pieces = self.pieces_of(j.layout, j.exchange)
        parts = pieces.parts(getattr(j.exchange, "memory_budget", None))  # (a team's exchange: none)
        if len(parts) == 1:
            into = j.exchange.home_destinations() if hasattr(j.exchange, "home_destinations") else None
            pending = j.exchange.gather_start(pieces.inputs(self.opt.param_groups, self.opt.state, True,
                                                            self.step_token, into=into)[0])
            pieces.sent()  # copied into the exchange: their memory goes back
            return pending
        for part in parts:
            j.exchange.gather_fill(pieces.inputs(self.opt.param_groups, self.opt.state, True, self.step_token,
                                                 part)[0])
            pieces.sent()
        return j.exchange.gather_start(None, filled=True)

    def orthogonalize(self, jobs: List[Job], gathers: list) -> list:
        """As each gather arrives, NS at home (batched by shape and settings), then NorMuon on the results
        of ``variant="normuon"`` matrices (:mod:`~ds_muon.engine.exchange.row_moments`), then its scatter is
        issued (and the homes' new NorMuon moments shared with every rank).  Returns the pending scatters."""
        opt, scatters, shared = self.opt, [], []
        normuon = any(g["use_muon"] and is_normuon(g) for g in opt.param_groups)
        group_of = self.muon_groups() if normuon else {}
        if normuon and self.moments_loaded is not None:  # a load: make every rank's v the saved one
            agree_after_load(self.layouts, group_of, opt.state, self.moments_loaded)
        for j, pending in zip(jobs, gathers):
            stacks = j.exchange.gather_finish(pending)
            results = {key: j.ns_of[key].run(stack) for key, stack in stacks.items()}
            if normuon:
                RowMoments.at_home(j.layout, j.exchange, results, group_of, opt.state)
            scatters.append(j.exchange.scatter_start(results))
            if normuon:
                shared.append(RowMoments.share_start(j.layout, j.exchange, group_of, opt.state))
        for s in shared:
            if s is not None:
                s.finish()
        return scatters

    def apply(self, jobs: List[Job], scatters: list) -> None:
        """Each wave's results applied in place, now or (``apply_in_forward``) by the next forward."""
        defer = self.deferred is not None and self.stack_allows_overlap()
        for j, pending in zip(jobs, scatters):
            apply = self.applier(j.layout, j.exchange, pending)
            if defer:
                params = params_of(j.layout, j.exchange.active)
                self.deferred.add(list(params), apply, list(params.values()))
            else:
                apply(self.step_token)

    def applier(self, layout: Layout, ex: Exchange, pending) -> Callable[[], None]:
        """Finish one exchange's scatter and apply its results in place, all pieces that share
        a learning rate, decay and scale at once.  Learning rates and decay are read now, at
        step time, so a scheduler stepping before a deferred apply cannot change this step's update."""
        pieces = self.pieces_of(layout, ex)
        coefficients = pieces.coefficients(self.opt.param_groups)

        @torch.no_grad()  # may run later, from a forward pre-hook
        def apply(bound_in=None):
            """``bound_in``: the step's token when applied within it (the views were checked this step).
            (No reference to the runtime or the optimizer: a dropped optimizer's deferred updates must
            not keep it alive.)"""
            pieces.apply(ex.scatter_finish(pending), coefficients, bound_in)
            if hasattr(ex, "done"):  # the exchange's buffers give their memory back until the next step
                ex.done()

        return apply

    def arm(self, jobs: List[Job]) -> None:
        """Stage 6: hook the waves of this step's exchanges whose gradients are final in backward: as
        the adapter says (FSDP2 units: yes), and any parameter in a single process."""
        opt = self.opt
        if self.final_grads is None or self.final_grads[0] != self.signature:
            context = self._context(opt.process_group, opt.model)
            self.final_grads = (self.signature, {pid for pid, b in self.bindings.items()
                                                 if opt.adapter.grad_final_at_hook(b.param, context)})
        final = self.final_grads[1]
        waves = [Wave(j.key, j.layout, j.exchange, params_of(j.layout, j.exchange.active)) for j in jobs]
        if self.step_group()[1] > 1:  # a layout's waves are hooked only if all its gradients are final
            partial = {w.key for w in waves if not all(pid in final for pid in w.params)}
            waves = [w for w in waves if w.key not in partial]
        self.dispatch.arm(waves)

    # -- what the overlap hooks call (see ds_muon.engine.overlap.backward.BackwardDispatch) ---------------
    def wave_inputs(self, layout: Layout, ex: Exchange, commit: bool = True):
        """This rank's pieces of one wave's Muon inputs: weight decay (L2), momentum, Nesterov,
        for all pieces of a param group at once (:func:`~ds_muon.rules.update.ns_input`).

        With ``commit=False`` (a dispatch from backward) the momentum buffers are left
        alone and ``(buffer slice, new value)`` pairs are returned for the step to
        commit once the gradients are known to be good.  Returns ``(pieces, commits)``."""
        return self.pieces_of(layout, ex).inputs(self.opt.param_groups, self.opt.state, commit,
                                                 bound_in=self.step_token if commit else None)

    def hyper(self, param_ids) -> tuple:
        """The settings a wave's inputs depend on (besides gradients and parameters)."""
        group_of = self.muon_groups()
        keys = ("momentum", "nesterov", "weight_decay", "weight_decay_mode")
        # a tensor no longer in a Muon group reads as None: the early dispatch is stale, not an error
        return tuple(tuple(group_of[i][k] for k in keys) if i in group_of else None for i in sorted(param_ids))

    def land(self, param_ids: set) -> None:
        """Apply any update of the previous step still deferred on these parameters."""
        if self.deferred is not None:
            self.deferred.apply_for(param_ids)

    def pieces_of(self, layout: Layout, ex: Exchange) -> WavePieces:
        """The wave's pieces with their views (:class:`~ds_muon.engine.exchange.pieces.WavePieces`), made once
        per wave while the param groups keep their members."""
        groups = self.opt.param_groups
        members = tuple((id(g), len(g["params"])) for g in groups)
        if members != self.pieces_members:
            self.pieces.clear()
            self.pieces_members = members
        pieces = self.pieces.get(ex)
        if pieces is None:
            index = {id(p): gi for gi, g in enumerate(groups) if g["use_muon"] for p in g["params"]}
            pieces = self.pieces[ex] = WavePieces(layout, ex.active, index, getattr(ex, "reads", None))
        return pieces

    def muon_groups(self) -> Dict[int, dict]:
        """Each Muon tensor's param group, by id (looked up afresh: load_state_dict replaces groups)."""
        return {id(p): g for g in self.opt.param_groups if g["use_muon"] for p in g["params"]}

    def drain_early(self) -> None:
        """Wait out and drop the gathers sent from backward (the step raised, skipped or was replaced)."""
        if self.dispatch is not None:
            self.dispatch.drain()

    def flush(self) -> None:
        """Apply every update still waiting for a forward."""
        if self.deferred is not None:
            self.deferred.flush()
