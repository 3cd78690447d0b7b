"""``Muon``: a torch.optim.Optimizer that orthogonalizes each weight matrix once, at one home rank.

This class is the torch.optim face (settings, groups, ``state_dict``, copies); one step's mechanics
live in :class:`~ds_muon.engine.runtime.StepRuntime` (``opt.runtime``).  :meth:`Muon.step`:

1. preflight, before anything changes: every group's settings (:mod:`~ds_muon.engine.agreement.settings`)
   and a copy's lost bindings; then, the tensors bound and their state filled, every state tensor fits
   its parameter (:mod:`~ds_muon.engine.agreement.state_check`) and QK-clip's q/k weights are Muon
   matrices; a failed check becomes a :class:`~ds_muon.engine.agreement.local_failure.LocalFailure`, raised on
   every rank by the runtime's check (a rank failing alone cannot leave the others waiting);
2. the runtime's stages (:mod:`~ds_muon.engine.runtime`): the check (gradient presence and finiteness
   agreed by every rank, one small all_reduce) → active matrices → plan (homes, wire dtypes, waves) →
   AdamW (:mod:`~ds_muon.rules.adamw`) → per batch of waves: gather (momentum on local pieces) →
   orthogonalize (NS at home) → apply (:mod:`~ds_muon.rules.update`) → arm (gathers from backward);
3. QK-clip on the q/k rows (a step not skipped), and the first step's summary line.

With ``overlap=True`` (:mod:`~ds_muon.engine.overlap`) the exchange runs in waves; under
FSDP2 a wave's momentum and gather may already have left during backward (its
momentum committed after the check).  Every update has landed when ``step()`` returns,
unless ``apply_in_forward=True`` opts into applying them by the next forward.

How tensors are laid out across ranks comes from :mod:`~ds_muon.integrations`
as :class:`~ds_muon.engine.exchange.layout.ParamBinding` objects; nothing here depends on the stack.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from .engine.agreement.local_failure import LocalFailure
from .engine.agreement.identity import next_ordinal
from .engine.agreement.settings import (TORCH_ADDED_DEFAULTS, as_dtype, check_boolean, check_edited_keys,
                                        check_given_keys, check_keyword_booleans, check_loaded_groups, check_settings,
                                        check_variant_keys, drop_filled_defaults, loaded_group, ns_dtype_name,
                                        validate_group)
from .engine.agreement.state_check import check_loaded_state, check_state, check_state_listed
from .engine.pickling import carried, check_not_carried, restored, upgrade_groups
from .engine.exchange.all_to_all import Exchange
from .engine.exchange.row_moments import (check_loaded_moments, check_moments, fsdp1_moments, restore_moments,
                                          split_moments)
from .engine.memory.offload import accelerator
from .engine.overlap import OverlapSettings
from .engine.plan.cost_model import CostModel
from .engine.plan.planner import STRATEGIES
from .engine.report.rows import Summary
from .engine.report.summary import log_first_step, summarize, summarize_planned
from .engine.runtime import StepRuntime
from .integrations.base import HOW_TO_BIND, BindContext, StackAdapter
from .integrations.default import default_adapter

MODES = ("sharded", "duplicated")
NONFINITE = ("raise", "skip")


class Muon(Optimizer):
    """Muon for hidden weight matrices, AdamW for everything else, sharded or not.

    Param groups carry ``use_muon`` (default True); build them with :func:`ds_muon.muon_param_groups`.
    The keywords are the defaults of the groups where they act (README: "A setting that does nothing
    is an error"):

    * Muon's rule (:mod:`~ds_muon.rules.update`): ``lr``, ``momentum``, ``nesterov``, ``weight_decay`` and
      ``weight_decay_mode`` (``"decoupled"``, ``"l2"``, ``"independent"``, ``"cautious"``: :mod:`~ds_muon.rules.decay`);
      ``variant="normuon"`` divides each output row of the NS result by the root of its running mean
      square (``normuon_beta2``) and restores the matrix's norm (:mod:`~ds_muon.rules.normuon`);
      ``scale_mode`` and ``extra_scale_factor`` scale the update per shape (:mod:`~ds_muon.rules.scaling`);
    * Newton–Schulz (:mod:`~ds_muon.rules.newton_schulz`): ``ns_steps``, ``ns_coefficients``, ``ns_method``,
      ``ns_dtype``, ``eps`` (the NS floor; AdamW groups: Adam's eps), ``compile`` (torch.compile the NS);
      ``ns_dtype="auto"`` and ``ns_method="auto"`` (the defaults) take the machine's fastest exact choice
      (:mod:`~ds_muon.rules.ns_auto`: bf16 where the device multiplies it natively, else fp32; the Gram
      iteration where it saves FLOPs and runs at full rate), the same on every rank (the step's agreement
      checks it); an explicit dtype or method always wins;
    * AdamW groups use their ``lr``, ``betas`` (default ``adam_betas``), ``eps`` (default ``adam_eps``) and
      ``weight_decay``;
    * where NS runs: ``mode="duplicated"`` is the baseline that runs every NS on every rank; ``planner``
      picks the homes (:mod:`~ds_muon.engine.plan.planner`): ``"auto"`` (default) gives replicated matrices
      (DDP, HSDP replica groups) extra homes where the cost model (``cost_model``, default
      :meth:`planning_cost_model`) says running NS again beats sending the result, else the one-home
      ``"locality"`` plan; with ``team_ns=True`` it also runs a matrix whose NS bounds the step as a team
      of ranks (:mod:`~ds_muon.engine.plan.team`; not bitwise equal to one process: docs/PERFORMANCE.md);
      ``comm_dtype`` (default: lossless) can be forced narrower, which breaks bitwise parity;
    * the stack: ``adapter`` describes where each tensor's shards live (default: picked per tensor for no
      wrapper/DDP, FSDP1 and FSDP2; DeepSpeed's is attached later, :meth:`attach`); ``process_group``:
      the group to plan in (default the adapter's data-parallel group); ``model``: the wrapped model
      (overlap hooks; FSDP1 ``use_orig_params=True``);
    * ``overlap``, ``waves``, ``dispatch_in_backward``, ``apply_in_forward``: :mod:`~ds_muon.engine.overlap`;
    * ``nonfinite="raise"`` (default) or ``"skip"`` a step with a non-finite gradient (``nonfinite_skips``);
    * ``qk_clip``: a :class:`ds_muon.QKClip` scaling the q/k rows of heads whose logits exceeded its
      ``tau`` after each step that was not skipped (:mod:`ds_muon.qk_clip`);
    * ``log_summary`` (default True): :meth:`summary`'s counts logged once after the first step, at INFO on
      logger ``"ds_muon"`` (rank 0).
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, weight_decay_mode: str = "decoupled", variant: str = "muon",
                 normuon_beta2: float = 0.95, ns_steps: int = 5, ns_coefficients="keller", ns_method: str = "auto",
                 ns_dtype="auto", eps: float = 1e-7, scale_mode: str = "shape_scaling",
                 extra_scale_factor: float = 1.0, adam_betas: Tuple[float, float] = (0.9, 0.95), adam_eps: float = 1e-8,
                 process_group: Optional[dist.ProcessGroup] = None, mode: str = "sharded",
                 model: Optional[torch.nn.Module] = None, nonfinite: str = "raise", comm_dtype=None,
                 planner: str = "auto", cost_model: Optional[CostModel] = None, team_ns: bool = True,
                 overlap: bool = False, waves: int = 4, dispatch_in_backward: bool = True,
                 apply_in_forward: bool = False,
                 adapter: Optional[StackAdapter] = None, log_summary: bool = True, compile: bool = False, qk_clip=None):
        check_keyword_booleans(Muon.__init__, locals())
        self.overlap_settings = _check_keywords(mode, nonfinite, planner, model, qk_clip,
                                                (bool(overlap), waves, bool(dispatch_in_backward), apply_in_forward))
        self.qk_clip = qk_clip  # ds_muon.QKClip: q/k rows scaled after each step (ds_muon.qk_clip)
        self.mode = mode
        self.nonfinite = nonfinite
        self.adapter: StackAdapter = adapter if adapter is not None else default_adapter()
        self._adapter_chosen = adapter is not None  # a chosen adapter is not carried by copies
        self.process_group = process_group if process_group is not None else self.adapter.data_parallel_group
        self.model = model
        self.comm_dtype = None if comm_dtype is None else as_dtype(comm_dtype, "comm_dtype")
        self.planner = planner
        self.team_ns = team_ns  # planner="auto" may run a step-bounding NS as a team (ds_muon.engine.plan.team)
        self.cost_model = cost_model  # None: CostModel.for_device of where NS runs (planning_cost_model)
        self.adam_betas = tuple(adam_betas)
        self.adam_eps = adam_eps
        self.nonfinite_skips = 0
        self.log_summary = bool(log_summary)  # one INFO line (logger "ds_muon") after the first step, rank 0
        self._not_carried: Tuple[str, ...] = ()  # what a copy lost and must be given again (see __getstate__)
        self.runtime = StepRuntime(self, BindContext)  # the step's caches and hooks (ds_muon.engine.runtime)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        weight_decay_mode=weight_decay_mode, ns_steps=ns_steps, ns_coefficients=ns_coefficients,
                        ns_method=ns_method, compile=compile, ns_dtype=ns_dtype_name(ns_dtype), eps=eps,
                        scale_mode=scale_mode, extra_scale_factor=extra_scale_factor, use_muon=True,
                        variant=variant, normuon_beta2=normuon_beta2)  # NorMuon (ds_muon.rules.normuon)
        super().__init__(params, defaults)
        self._ordinal = next_ordinal(self.param_groups)  # which of this process's optimizers (ds_muon.engine.agreement.identity)

    # -- overlap settings (the keywords Muon takes), read-only ---------------------
    overlap = property(lambda self: self.overlap_settings.enabled)
    waves = property(lambda self: self.overlap_settings.wave_count, doc="Waves per exchange (1 without overlap).")
    dispatch_in_backward = property(lambda self: self.overlap_settings.dispatch_in_backward)
    apply_in_forward = property(lambda self: self.overlap_settings.apply_in_forward,
                                doc="Updates may wait for the next forward (opt-in; ds_muon.engine.overlap.forward).")

    # -- copies, pickling and loading (ds_muon.engine.pickling) --------------------
    team_ns = True  # (an optimizer pickled before team NS existed reads the default)
    qk_clip = None  # (an optimizer pickled before QK-clip existed reads the default)

    def __getstate__(self) -> dict:
        """What ``copy.deepcopy`` and pickle carry: torch's ``defaults``, ``state`` and ``param_groups`` plus
        ds_muon's settings (:mod:`~ds_muon.engine.pickling`).  Not carried: ``model``, ``process_group``, ``qk_clip``,
        a chosen ``adapter`` (a DeepSpeed binding; a copy refuses to step until given the ones it needs again:
        ``copy.process_group = ...``, ``ds_muon.deepspeed.bind(engine)``), the runtime's caches and
        hooks (rebuilt at the first step; a copy steps without overlap hooks, same results)."""
        return {**super().__getstate__(), "ds_muon": carried(self)}

    def __setstate__(self, state: dict) -> None:
        """Pickle/deepcopy (with ds_muon's settings) and torch's ``load_state_dict`` (``state`` and
        ``param_groups`` only) both land here; either way the groups are brought up to date."""
        settings = state.pop("ds_muon", None)
        super().__setstate__(state)
        if getattr(self, "runtime", None) is not None:
            self.runtime.state_replaced()
        if settings is not None:
            settings, self._not_carried = restored(settings)
            self.__dict__.update(settings)
            self.model = self.process_group = self.qk_clip = None
            self.adapter, self._adapter_chosen = default_adapter(), False
            self._ordinal = next_ordinal(self.param_groups)  # a copy is one more optimizer of this process
            self.runtime = StepRuntime(self, BindContext)
        self._upgrade_groups()

    def _upgrade_groups(self) -> None:
        """Fill what older ds_muon state dicts lack (:func:`~ds_muon.engine.pickling.upgrade_groups`)."""
        upgrade_groups(self.param_groups, self.state, self.defaults, self.adam_betas, self.adam_eps)

    def _check_not_carried(self) -> None:
        """A copy (deepcopy/pickle) that lost a process group, QK-clip or a stack binding refuses to step."""
        check_not_carried(self, HOW_TO_BIND)

    # -- groups ----------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """torch's, after refusing a key that would do nothing on the group's kind (``ns_steps`` on an AdamW
        group, ``betas`` on a Muon group: :data:`~ds_muon.engine.agreement.settings.SCOPE`); the optimizer's defaults
        are filled in only where they act."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        # a copy: the defaults filled in below stay out of the caller's dict, so the same dicts build a second
        # optimizer (a resume script, a sweep) with what the caller wrote, not with this one's defaults as if given
        param_group = dict(param_group)
        if not param_group.get("use_muon", True):
            param_group.setdefault("betas", self.adam_betas)
            param_group.setdefault("eps", self.adam_eps)
        given = set(param_group)  # what the caller wrote; torch fills the defaults in next
        check_given_keys(param_group, len(self.param_groups), given)  # a key that would do nothing here
        check_variant_keys(param_group, len(self.param_groups), self.defaults, given)  # normuon_beta2, variant="muon"
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for k in TORCH_ADDED_DEFAULTS:  # in defaults after a load (torch's __setstate__), no setting of ours
            if k not in given:
                group.pop(k, None)
        drop_filled_defaults(group, given)  # Muon-only defaults stay out of AdamW groups
        validate_group(group, len(self.param_groups) - 1)
        if hasattr(self, "runtime"):
            self.invalidate_layouts()

    # -- the stack ---------------------------------------------------------------
    def attach(self, adapter: StackAdapter) -> None:
        """Describe the tensors with ``adapter`` from now on: for a stack that exists only
        after the optimizer (DeepSpeed, through ``ds_muon.deepspeed.bind``).
        Plans in the adapter's data-parallel group when no ``process_group`` was given."""
        self.adapter, self._adapter_chosen = adapter, True
        if self.process_group is None:
            self.process_group = adapter.data_parallel_group
        self.invalidate_layouts()

    def invalidate_layouts(self) -> None:
        """Forget every binding, layout and compiled exchange (after re-sharding)."""
        self.runtime.invalidate()

    def planning_cost_model(self) -> CostModel:
        """The rates the planner uses: ``cost_model`` if given, else :meth:`CostModel.for_device`
        of the device Newton–Schulz runs on (the parameters' device, or the accelerator when
        optimizer state is offloaded to the host)."""
        if self.cost_model is not None:
            return self.cost_model
        device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
        if device.type == "cpu" and getattr(self.adapter, "offload", False) and accelerator() is not None:
            device = accelerator()
        return CostModel.for_device(device.type)

    # -- the step -------------------------------------------------------------
    @torch.compiler.disable  # eager even inside a compiled training step (see the note below)
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step: settings and state are checked first, so a bad value (edited into ``param_groups``,
        or loaded) raises before anything changes; then the runtime's stages (:meth:`.StepRuntime.run`).
        Under ``torch.compile`` it runs eagerly (a graph break): it mutates parameters and state through views
        and caches and runs collectives, which dynamo would trace into a graph that silently drops the updates."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # a check that fails here on one rank only is carried to the agreement (LocalFailure), so
        # every rank raises, instead of the others waiting in its all_reduce
        failed = LocalFailure.catch(lambda: [(check_settings(g, gi), check_edited_keys(g, gi, self.defaults))
                                             for gi, g in enumerate(self.param_groups)])
        if self._not_carried:
            self._check_not_carried()
        runtime = self.runtime
        runtime.prepare()  # the previous step's deferred updates land; tensors bound, state filled
        failed = failed or LocalFailure.catch(  # every state tensor fits, before any write
            lambda: (check_state(self.param_groups, self.state, runtime.name),
                     check_moments(self.param_groups, self.state, runtime.bindings, runtime.name)))
        if self.qk_clip is not None:  # its layouts are known and its q/k weights are Muon matrices
            failed = failed or LocalFailure.catch(lambda: self.qk_clip.check(self))
        skips = self.nonfinite_skips
        runtime.run(failed)
        if self.qk_clip is not None and self.nonfinite_skips == skips:
            self.qk_clip.after_step(self)  # q/k rows of heads over tau, on this rank's pieces (ds_muon.qk_clip)
        if not runtime.summary_logged and getattr(self, "log_summary", True):  # absent from older pickles
            runtime.summary_logged = log_first_step(self)
        return loss

    def flush(self) -> None:
        """Apply every update still waiting for a forward (``overlap=True``); a no-op otherwise."""
        self.runtime.flush()

    # -- state dicts -------------------------------------------------------------
    def state_dict(self):
        """torch's state dict; NorMuon's ``normuon_v`` of an FSDP1 flat parameter as a tuple of floats
        (see :func:`~ds_muon.engine.exchange.row_moments.fsdp1_moments`: FSDP1's optimizer state dicts take every
        state tensor with a dimension for a shard of the flat parameter)."""
        self.flush()
        check_state_listed(self.param_groups, self.state, deepspeed=self.adapter.applies_in_step)
        return fsdp1_moments(super().state_dict(), self.param_groups)

    def load_state_dict(self, state_dict) -> None:
        """torch's load, after checking that the saved groups match these (same algorithm, same tensor
        names) and hold valid settings; older ds_muon state dicts are brought up to date."""
        runtime, name = self.runtime, self.runtime.name
        # keys that would do nothing on their group's kind: refused, or dropped when filled (an older ds_muon)
        state_dict = {**state_dict, "param_groups": [loaded_group(g, gi, self.defaults)
                                                     for gi, g in enumerate(state_dict["param_groups"])]}
        check_loaded_groups(self.param_groups, state_dict["param_groups"], self.defaults, self.adam_betas, self.adam_eps)
        check_loaded_state(self.param_groups, state_dict, name)
        check_loaded_moments(self.param_groups, state_dict["param_groups"], state_dict["state"],
                             runtime.local_bindings(), name, self.defaults)  # the step's check, now
        check_loaded = getattr(self.adapter, "check_loaded", None)  # the stack's own refusals (optional)
        if check_loaded is not None:
            check_loaded(self.param_groups, state_dict, name, self.model)
        self.flush()
        runtime.drain_early()  # their momentum was computed from the state being replaced
        moments, state_dict = split_moments(state_dict)  # NorMuon's v stays float32 (torch casts state)
        super().load_state_dict(state_dict)
        restore_moments(self.param_groups, state_dict["param_groups"], moments, self.state)
        runtime.moments_loaded = set()  # layouts whose v the ranks have agreed on since (exchange.row_moments)
        runtime.exchanges.clear()  # compiled for the old state's dtypes (a load casts state to the parameters')

    # -- introspection --------------------------------------------------------
    def summary(self, all_ranks: bool = False) -> Summary:
        """Per tensor: Muon or AdamW and why, its matrices (after splits, experts and tensor-parallel tags) with
        scale factors and home ranks; per rank: NS FLOPs and bytes moved per step (``str()``: a table; rank 0 has
        every rank's columns).  Any rank may call it alone at any time: before the first step of a multi-rank
        run, it says "planned at the first step" for homes and per-rank costs (placing pieces is a collective);
        ``all_ranks=True``, on every rank, binds now for the exact plan (:mod:`ds_muon.engine.report.summary`)."""
        check_boolean(all_ranks, "all_ranks")
        runtime = self.runtime
        if all_ranks or not runtime.binding_is_collective():
            return summarize(self)
        if self.adapter.applies_in_step and runtime.resolved:  # DeepSpeed, after a step: each group it stepped
            return summarize(self, sets=list(runtime.resolved.values()))
        return summarize_planned(self, runtime.bind_all)

    def exchanges(self) -> List[Exchange]:
        """The compiled exchanges now cached (for reports and tests)."""
        return self.runtime.exchanges.exchanges()


def _check_keywords(mode, nonfinite, planner, model, qk_clip, overlap: tuple) -> OverlapSettings:
    """ValueError for a keyword of :class:`Muon` that is unknown or needs another; returns the
    :class:`~ds_muon.engine.overlap.OverlapSettings` of ``overlap`` (its keywords, in order)."""
    for value, name, choices in ((mode, "mode", MODES), (nonfinite, "nonfinite", NONFINITE),
                                 (planner, "planner", STRATEGIES)):
        if value not in choices:
            raise ValueError(f"{name}={value!r} is unknown; use one of {list(choices)}")
    overlap = OverlapSettings(*overlap)
    if overlap.apply_in_forward and model is None:
        raise ValueError("apply_in_forward=True lands updates in the model's forward pre-hooks: pass model= too")
    if qk_clip is not None and not callable(getattr(qk_clip, "after_step", None)):
        raise ValueError(f"qk_clip={qk_clip!r} must be a ds_muon.QKClip(model, tau=..., alpha=...)")
    if qk_clip is not None and overlap.apply_in_forward:
        raise ValueError("qk_clip with apply_in_forward=True: QK-clip scales the q/k rows after the update lands, "
                         "and apply_in_forward defers the update to the next forward; use one or the other")
    return overlap
