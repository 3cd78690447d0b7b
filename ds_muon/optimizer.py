"""``Muon``: a torch.optim.Optimizer that orthogonalizes each weight matrix once, at one home rank.

The step's stages, in :meth:`Muon.step`'s order (every stack goes through the same path):

1. check (:mod:`~ds_muon.engine.agreement.check`), before anything changes: gradient presence
   agrees across ranks and every gradient is finite (one small all_reduce); every
   state tensor fits its parameter (:mod:`~ds_muon.engine.agreement.state_check`);
2. AdamW, through torch's own functional AdamW, on tensors of ``use_muon=False``
   groups (and on the non-matrix slices of mixed flat shards), run once stages 3–4
   (which write nothing) have planned, so a step refused there changes nothing;
3. layouts: which matrices of each layout (one per process group) step;
4. plan (:mod:`~ds_muon.engine.plan.compile`): homes (:mod:`~ds_muon.engine.plan.planner`), wire dtypes and
   waves, compiled once into :class:`~ds_muon.engine.exchange.all_to_all.Exchange` objects;
5. momentum on local pieces only (:mod:`~ds_muon.rules.update`: weight decay, momentum,
   Nesterov), then each wave's gather brings its matrices whole to their homes;
6. NS at home, batched by shape, then the scatter sends results back;
7. apply: each rank's pieces of the results, in place (:mod:`~ds_muon.rules.update`).

With ``overlap=True`` (:mod:`~ds_muon.engine.overlap`) the exchange runs in waves; under
FSDP2 a wave's momentum and gather may already have left during backward (its
momentum committed after stage 1).  Every update has landed when ``step()`` returns,
unless ``apply_in_forward=True`` opts into applying them by the next forward.

How tensors are laid out across ranks comes from :mod:`~ds_muon.integrations`
as :class:`~ds_muon.engine.exchange.layout.ParamBinding` objects; nothing here depends on the stack.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Callable, Dict, Hashable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim.adamw import adamw as functional_adamw

from .engine.agreement.check import Agreement
from .engine.agreement.fingerprints import settings_of
from .engine.agreement.local_failure import LocalFailure
from .engine.plan.compile import ExchangeCache, ExchangeGroups, NSSettings, compile_exchanges, exchange_key
from .engine.exchange.all_to_all import Exchange
from .engine.agreement.identity import next_ordinal
from .engine.agreement.settings import (TORCH_ADDED_DEFAULTS, as_dtype, check_boolean, check_edited_keys, check_given_keys,
                            check_keyword_booleans, check_loaded_groups, check_settings, drop_filled_defaults, drop_old_defaults,
                            dtype_name, fill_group_defaults, loaded_group, validate_group)
from .engine.exchange.layout import _DTENSOR_OR_NONE, Layout, ParamBinding, build_layout, local_shard
from .engine.memory.offload import accelerator
from .engine.overlap import OverlapSettings, Wave
from .engine.exchange.pieces import WavePieces
from .engine.plan.cost_model import CostModel
from .engine.plan.planner import STRATEGIES
from .engine.exchange.row_moments import (KEY as NORMUON_V, RowMoments, agree_after_load, check_loaded_moments,
                                 check_moments, fsdp1_moments,
                                 is_normuon, new_moment, restore_moments, split_moments)
from .engine.agreement.state_check import check_loaded_state, check_state
from .engine.report.rows import Summary
from .engine.report.summary import log_first_step, summarize, summarize_planned
from .engine.exchange.tag_keys import restore_tags
from .engine.plan.team import TeamGroups
from .integrations.base import HOW_TO_BIND, BindContext, StackAdapter
from .integrations.default import default_adapter
from .rules.decay import adamw_decay_

MODES = ("sharded", "duplicated")
DEFAULT_ADAM_LR = 3e-4  # for the AdamW slices of mixed flat shards without "adam_lr" (as muon_param_groups)
NONFINITE = ("raise", "skip")


class _Job(NamedTuple):
    """One wave's exchange and what the step needs to run it."""

    key: tuple  # the compiled exchanges it belongs to (see ds_muon.engine.plan.compile.exchange_key)
    layout: Layout
    exchange: Exchange
    ns_of: Dict[Hashable, NSSettings]  # per stack of same-shape matrices at this rank


def _params_of(layout: Layout, idx) -> Dict[int, torch.Tensor]:
    """The parameters holding matrices ``idx`` of ``layout``, by id, in order."""
    return {id(layout.local[i][0].param): layout.local[i][0].param for i in idx}


class Muon(Optimizer):
    """Muon for hidden weight matrices, AdamW for everything else, sharded or not.

    Param groups carry ``use_muon`` (default True); build them with
    :func:`ds_muon.muon_param_groups`.  AdamW groups use their ``lr``, ``betas``
    (default ``adam_betas``), ``eps`` (default ``adam_eps``) and ``weight_decay``.
    ``mode="duplicated"`` is the baseline that runs every NS on every rank.
    ``comm_dtype`` (default: lossless — the NS dtype where NS would cast to it
    anyway) can be forced narrower, which breaks bitwise parity.
    ``adapter`` describes where each tensor's shards live (default: picked per tensor
    for no wrapper/DDP, FSDP1 and FSDP2; see :mod:`ds_muon.integrations`); DeepSpeed's
    is attached after ``deepspeed.initialize`` (:meth:`attach`).
    ``planner`` picks the Newton–Schulz home ranks (:mod:`~ds_muon.engine.plan.planner`): ``"auto"`` (default)
    gives replicated matrices (DDP, HSDP replica groups) extra homes where the cost model says
    running NS again beats sending the result, and is the one-home ``"locality"`` plan otherwise;
    with ``team_ns=True`` (default) it also runs a matrix whose NS bounds the step as a *team* of
    ranks, each orthogonalizing a column block (:mod:`~ds_muon.engine.plan.team`; not bitwise equal to one
    process: the bound is in docs/PERFORMANCE.md).  ``team_ns=False`` or another planner never does.
    ``variant="normuon"`` (per group too; default ``"muon"``) divides each output neuron's row of the NS
    result by the root of its running mean square (``normuon_beta2``) and restores the matrix's norm
    (:mod:`~ds_muon.rules.normuon`; its state, ``normuon_v``: :mod:`~ds_muon.engine.exchange.row_moments`).
    ``qk_clip``: a :class:`ds_muon.QKClip` (QK-clip, MuonClip) that scales the q/k rows of every attention
    head whose logits exceeded its ``tau`` after each step that was not skipped (:mod:`ds_muon.qk_clip`).
    :meth:`summary` tells what it does with each tensor; ``log_summary`` (default True)
    logs its counts once, after the first step, at INFO on logger ``"ds_muon"`` (rank 0).
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        weight_decay_mode: str = "decoupled",
        variant: str = "muon",
        normuon_beta2: float = 0.95,
        ns_steps: int = 5,
        ns_coefficients="keller",
        ns_method: str = "standard",
        ns_dtype=torch.bfloat16,
        eps: float = 1e-7,
        scale_mode: str = "shape_scaling",
        extra_scale_factor: float = 1.0,
        adam_betas: Tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        process_group: Optional[dist.ProcessGroup] = None,
        mode: str = "sharded",
        model: Optional[torch.nn.Module] = None,
        nonfinite: str = "raise",
        comm_dtype=None,
        planner: str = "auto",
        cost_model: Optional[CostModel] = None,
        team_ns: bool = True,
        overlap: bool = False,
        waves: int = 4,
        dispatch_in_backward: bool = True,
        apply_in_forward: bool = False,
        adapter: Optional[StackAdapter] = None,
        log_summary: bool = True,
        compile: bool = False,
        qk_clip=None,
    ):
        check_keyword_booleans(Muon.__init__, locals())
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is unknown; use one of {list(MODES)}")
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite={nonfinite!r} is unknown; use one of {list(NONFINITE)}")
        if planner not in STRATEGIES:
            raise ValueError(f"planner={planner!r} is unknown; use one of {list(STRATEGIES)}")
        self.overlap_settings = OverlapSettings(bool(overlap), waves, bool(dispatch_in_backward), apply_in_forward)
        if apply_in_forward and model is None:
            raise ValueError("apply_in_forward=True lands updates in the model's forward pre-hooks: pass model= too")
        if qk_clip is not None and not callable(getattr(qk_clip, "after_step", None)):
            raise ValueError(f"qk_clip={qk_clip!r} must be a ds_muon.QKClip(model, tau=..., alpha=...)")
        if qk_clip is not None and apply_in_forward:
            raise ValueError("qk_clip with apply_in_forward=True: QK-clip scales the q/k rows after the update lands, "
                             "and apply_in_forward defers the update to the next forward; use one or the other")
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
        self._reset_runtime()
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            weight_decay_mode=weight_decay_mode, ns_steps=ns_steps, ns_coefficients=ns_coefficients,
            ns_method=ns_method, compile=compile,
            ns_dtype=dtype_name(ns_dtype, "ns_dtype"), eps=eps, scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor, use_muon=True,
            variant=variant, normuon_beta2=normuon_beta2,  # NorMuon (ds_muon.rules.normuon)
        )
        super().__init__(params, defaults)
        self._ordinal = next_ordinal(self.param_groups)  # which of this process's optimizers (ds_muon.engine.agreement.identity)

    def _reset_runtime(self) -> None:
        """Caches and hooks, all rebuilt lazily: bindings, layouts, compiled exchanges, and
        (``overlap=True`` with a model) the deferred-apply and backward-dispatch hooks."""
        self._deferred, self._dispatch = self.overlap_settings.hooks(self.model, self._wave_inputs, self._hyper,
                                                                     self._land)
        self._bindings: Dict[int, ParamBinding] = {}
        self._binding_sig: Optional[tuple] = None
        self._state_key: Optional[tuple] = None  # what _init_state last filled (see there)
        self._settled: set = set()  # ids of Muon tensors whose state needs only a momentum buffer (see _init_state)
        self._layouts: List[Layout] = []
        self._resolved: Dict[tuple, tuple] = {}
        self._exchanges = ExchangeCache()
        self._exchange_groups = ExchangeGroups()  # the exchange's own process groups, kept across re-sharding
        self._team_groups = TeamGroups()  # team NS's process groups (one per member set), kept likewise
        self._agreement = Agreement()  # the step's check (caches rows and the mesh group)
        self._final_grads: Optional[tuple] = None  # (binding signature, ids whose grad hooks see final grads)
        self._pieces: "weakref.WeakKeyDictionary[Exchange, WavePieces]" = weakref.WeakKeyDictionary()
        self._step_token: Optional[object] = None
        self._pieces_members: Optional[tuple] = None  # (id, size) of each param group the pieces were sorted by
        self._summary_logged = False  # the first step's log line (see summary.log_first_step)

    # -- overlap settings (the keywords Muon takes), read-only ---------------------
    @property
    def overlap(self) -> bool:
        return self.overlap_settings.enabled

    @property
    def waves(self) -> int:
        """Waves per exchange (1 without overlap)."""
        return self.overlap_settings.wave_count

    @property
    def dispatch_in_backward(self) -> bool:
        return self.overlap_settings.dispatch_in_backward

    @property
    def apply_in_forward(self) -> bool:
        """Updates may wait for the next forward (opt-in; see :mod:`ds_muon.engine.overlap.forward`)."""
        return self.overlap_settings.apply_in_forward

    # -- copies, pickling and loading --------------------------------------------
    team_ns = True  # (an optimizer pickled before team NS existed reads the default)
    _SETTINGS = ("mode", "overlap_settings", "nonfinite", "comm_dtype", "planner", "team_ns",
                 "cost_model", "adam_betas", "adam_eps", "nonfinite_skips", "log_summary")
    _NOT_CARRIED = ("model", "process_group", "qk_clip")
    qk_clip = None  # (an optimizer pickled before QK-clip existed reads the default)
    _moments_loaded = None  # since a load: the layouts whose NorMuon v every rank agreed on

    def __getstate__(self) -> dict:
        """What ``copy.deepcopy`` and pickle carry: torch's ``defaults``, ``state`` and
        ``param_groups`` plus ds_muon's own settings (``mode``, ``planner``, ``waves``,
        ``comm_dtype``, ``nonfinite``, ``adam_betas``, ...).

        Not carried: ``model``, ``process_group`` and a chosen ``adapter`` (a DeepSpeed
        binding), nor caches and hooks (bindings, layouts, exchanges, the overlap hooks
        on the model); caches are rebuilt at the first step.  A copy of an optimizer
        that had a ``process_group`` or a DeepSpeed binding refuses to step until it
        is given one again (``copy.process_group = ...``; ``ds_muon.integrations.
        deepspeed.bind(engine)``); a copy of one built with ``model=`` steps without
        overlap hooks (same results), and FSDP1 ``use_orig_params=True`` needs
        ``copy.model = fsdp_model``.
        """
        state = super().__getstate__()
        state["ds_muon"] = {k: getattr(self, k) for k in self._SETTINGS}
        state["ds_muon"]["_not_carried"] = tuple(
            k for k in self._NOT_CARRIED if getattr(self, k, None) is not None) + (
            ("adapter",) if self._adapter_chosen else ()) + tuple(self._not_carried)
        return state

    def __setstate__(self, state: dict) -> None:
        """Pickle/deepcopy (with ds_muon's settings) and torch's ``load_state_dict``
        (``state`` and ``param_groups`` only) both land here; either way the groups are
        brought up to date (see :meth:`_upgrade_groups`)."""
        settings = state.pop("ds_muon", None)
        super().__setstate__(state)
        self._state_key = None  # a new state dict: _init_state looks at every tensor again
        if getattr(self, "_pieces", None) is not None:
            self._pieces.clear()  # their views would keep the replaced momentum buffers alive
        if settings is not None:
            lost = settings.pop("_not_carried")
            if "overlap" in settings:  # pickled before OverlapSettings
                settings["overlap_settings"] = OverlapSettings(
                    settings.pop("overlap"), settings.pop("waves"), settings.pop("dispatch_in_backward"))
            self.__dict__.update(settings)
            self.model = self.process_group = self.qk_clip = None
            self.adapter, self._adapter_chosen = default_adapter(), False
            self._not_carried = tuple(sorted(set(lost) - {"model"}))
            self._ordinal = next_ordinal(self.param_groups)  # a copy is one more optimizer of this process
            self._reset_runtime()
        self._upgrade_groups()

    def _upgrade_groups(self) -> None:
        """Fill what older ds_muon state dicts lack, as torch's optimizers do on load:
        missing group keys from the defaults, dtypes by name, and an AdamW ``step``
        stored as a plain number as a float32 tensor."""
        for group in self.param_groups:
            fill_group_defaults(group, self.defaults, self.adam_betas, self.adam_eps)
            drop_old_defaults(group, self.defaults)  # an older ds_muon filled Muon's defaults into AdamW groups
            if "ns_dtype" in group:
                group["ns_dtype"] = dtype_name(group["ns_dtype"], "ns_dtype")  # older ones stored a torch.dtype
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st and not torch.is_tensor(st["step"]):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

    def _check_not_carried(self) -> None:
        """A copy (deepcopy/pickle) that lost a process group or a stack binding refuses to step."""
        if "adapter" in self._not_carried and not self._adapter_chosen:
            raise RuntimeError(
                "ds_muon: this Muon is a copy (copy.deepcopy / pickle) of one bound to a DeepSpeed engine; "
                "bindings are not copied and stepping it unbound would orthogonalize the wrong thing. "
                "Bind the copy to the engine that steps it: " + HOW_TO_BIND)
        if "qk_clip" in self._not_carried and self.qk_clip is None:
            raise RuntimeError(
                "ds_muon: this Muon is a copy (copy.deepcopy / pickle) of one built with qk_clip; the clip holds the "
                "model and is not copied: set copy.qk_clip = ds_muon.QKClip(model, tau=..., alpha=...)")
        if "process_group" in self._not_carried and self.process_group is None:
            raise RuntimeError(
                "ds_muon: this Muon is a copy (copy.deepcopy / pickle) of one built with a process_group; "
                "process groups are not copied: set copy.process_group to the group it should plan in")

    # -- groups ----------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """torch's, after refusing a key that would do nothing on the group's kind (``ns_steps`` on an AdamW
        group, ``betas`` on a Muon group: :data:`~ds_muon.engine.agreement.settings.SCOPE`); the optimizer's defaults
        are filled in only where they act."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        if not param_group.get("use_muon", True):
            param_group.setdefault("betas", self.adam_betas)
            param_group.setdefault("eps", self.adam_eps)
        given = set(param_group)  # what the caller wrote; torch fills the defaults in next
        check_given_keys(param_group, len(self.param_groups), given)  # a key that would do nothing here
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for k in TORCH_ADDED_DEFAULTS:  # in defaults after a load (torch's __setstate__), no setting of ours
            if k not in given:
                group.pop(k, None)
        drop_filled_defaults(group, given)  # Muon-only defaults stay out of AdamW groups
        validate_group(group, len(self.param_groups) - 1)
        if hasattr(self, "_resolved"):
            self.invalidate_layouts()

    def _name(self, gi: int, pi: int) -> str:
        names = self.param_groups[gi].get("param_names")
        return names[pi] if names else f"param_groups[{gi}]['params'][{pi}]"

    # -- bindings and layouts (rebuilt when parameters change) ----------------
    def _resolve(self) -> None:
        """Bindings and Layouts for the Muon tensors now in ``param_groups``.

        Cached per set of tensors (and their shapes; a DTensor's spec: mesh, placements, shape,
        compared as the same object first, then by value): a stack that swaps
        parameters (accelerate, FSDP2 built after the optimizer) gets new layouts;
        one that narrows ``param_groups`` per call (DeepSpeed) reuses each set's.
        """
        sig = self._signature()
        if sig == self._binding_sig:
            return
        if sig not in self._resolved:
            bindings = self._bind_all()
            by_group: Dict[object, tuple] = {}
            for b in bindings.values():
                # an empty matrix (a layer with 0 outputs or inputs) has nothing to orthogonalize
                by_group.setdefault(_group_key(b.group), (b.group, []))[1].extend(
                    (b, s) for s in b.matrices if math.prod(s.matrix_shape))
            layouts = [build_layout(entries, group) for group, entries in by_group.values()]
            self._exchange_groups.add([lay.group for lay in layouts], self._whole_world(sig))
            self._resolved[sig] = (bindings, layouts)
        self._bindings, self._layouts = self._resolved[sig]
        self._binding_sig = sig
        self._settled = set()
        self._state_key = None  # new bindings may need new state keys (AdamW slices)

    def _bind_all(self) -> Dict[int, ParamBinding]:
        """Each Muon tensor's binding, by id, in group order: where its matrices live, from this rank's
        metadata alone (no collective; the layouts built from them are one)."""
        bindings: Dict[int, ParamBinding] = {}
        for gi, g in enumerate(self.param_groups):
            if not g["use_muon"]:
                continue
            tags = g.get("param_tags")
            tags = tags if tags and len(tags) == len(g["params"]) else [None] * len(g["params"])
            context = BindContext(self.process_group, self.model, g)
            for pi, p in enumerate(g["params"]):
                restore_tags(p, tags[pi])  # a stack swapped the tensor muon_param_groups tagged
                bindings[id(p)] = self.adapter.bind(p, self._name(gi, pi), context)
        return bindings

    def _local_bindings(self) -> Dict[int, ParamBinding]:
        """The bindings of the current tensors with no collective: the bound ones, else bound now on this rank
        alone (a stack that binds only inside ``step()``, DeepSpeed's ZeRO-3: none, the step checks then)."""
        if self._binding_sig is not None and self._binding_sig == self._signature():
            return self._bindings
        try:
            return self._bind_all()
        except Exception:  # noqa: BLE001 - binding refused here: the step binds and checks (check_moments)
            return {}

    def _signature(self) -> tuple:
        """What the bindings depend on: each Muon tensor, with its shape or a DTensor's spec."""
        return tuple(  # inline (a call per tensor costs more than the rest): shape, or a DTensor's spec
            (id(p), p._spec) if isinstance(p, _DTENSOR_OR_NONE) else (id(p), p.shape)
            for g in self.param_groups if g["use_muon"] for p in g["params"]
        )

    def _whole_world(self, sig) -> bool:
        """Does every world rank step this optimizer (its step group is the world)?"""
        group, size = self._agreement.group(self.process_group, self.param_groups, sig)
        return size > 1 and size == dist.get_world_size()

    def attach(self, adapter: StackAdapter) -> None:
        """Describe the tensors with ``adapter`` from now on: for a stack that exists only
        after the optimizer (DeepSpeed, through ``ds_muon.deepspeed.bind``).
        Plans in the adapter's data-parallel group when no ``process_group`` was given."""
        self.adapter, self._adapter_chosen = adapter, True
        if self.process_group is None:
            self.process_group = adapter.data_parallel_group
        self.invalidate_layouts()

    def _stack_allows_overlap(self) -> bool:
        """May results be deferred to the next forward and gathers leave from backward?  Not
        when the stack copies results out right after ``step()`` (DeepSpeed)."""
        return not self.adapter.applies_in_step

    def invalidate_layouts(self) -> None:
        """Forget every binding, layout and compiled exchange (after re-sharding)."""
        self._resolved.clear()
        self._exchanges.clear()
        self._agreement.clear()
        self._pieces.clear()
        self._final_grads = None
        self._binding_sig = None
        if getattr(self, "_deferred", None) is not None:
            self._deferred.reset_owners()
        if getattr(self, "_dispatch", None) is not None:
            self._dispatch.disarm()

    # -- the step -------------------------------------------------------------
    @torch.compiler.disable  # eager even inside a compiled training step (see the note below)
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step.  Every group's settings are checked first, so a bad value
        (edited into ``param_groups``, or loaded) raises before anything changes.

        Under ``torch.compile`` the step runs eagerly (a graph break): it mutates
        parameters and state through views and caches and runs collectives, which
        dynamo would trace into a graph that silently drops the updates."""
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
        self.flush()  # the previous step's updates still waiting for a forward
        self._resolve()
        self._init_state()
        failed = failed or LocalFailure.catch(  # every state tensor fits, before any write
            lambda: (check_state(self.param_groups, self.state, self._name),
                     check_moments(self.param_groups, self.state, self._bindings, self._name)))
        if self.qk_clip is not None:  # its layouts are known and its q/k weights are Muon matrices
            failed = failed or LocalFailure.catch(lambda: self.qk_clip.check(self))
        self._step_token = object()  # this step's, for the views checked in it (see WavePieces)
        skips = self.nonfinite_skips
        loss = self._stages(loss, failed)
        if self.qk_clip is not None and self.nonfinite_skips == skips:
            self.qk_clip.after_step(self)  # q/k rows of heads over tau, on this rank's pieces (ds_muon.qk_clip)
        if not self._summary_logged and getattr(self, "log_summary", True):  # absent from older pickles
            self._summary_logged = log_first_step(self)
        return loss

    def _stages(self, loss, failed=None):
        """The stages of :meth:`step`, in order (see the module docstring); ``failed``: this
        rank's failed local check (:class:`~ds_muon.engine.agreement.local_failure.LocalFailure`), raised in stage 1."""
        active = self._check(failed)  # 1. which tensors step, agreed by every rank
        if active is None:
            return loss
        work = self._active_matrices(active)  # 3. layouts: each one's matrices that step
        jobs = self._plan(work) if work else []  # 4. compiled exchanges: homes, dtypes, waves
        # 2. AdamW on everything that is not a Muon matrix: after the plan (which writes nothing and
        # may refuse), so a step that raises before its first write leaves every tensor as it was
        self._adamw_all(active)
        if not work:
            self._drain_early()
            return loss
        for batch in self._batches(jobs):
            gathers = self._gather(batch)  # 5. momentum on local pieces, gathers issued
            scatters = self._orthogonalize(batch, gathers)  # 6. NS at home, scatters issued
            self._apply(batch, scatters)  # 7. results applied (or deferred to forward)
        if self._dispatch is not None and self._stack_allows_overlap():
            self._arm(jobs)  # the next backward sends the gathers whose gradients are final
        return loss

    def _init_state(self) -> None:
        """State for every tensor at once, so every rank holds the same keys (DCP needs it).

        Skipped while the state dict (``load_state_dict`` replaces it), its size and the tensors
        of every group stay those of the last call: nothing can be missing then."""
        key = (id(self.state), len(self.state),
               tuple((g["use_muon"], is_normuon(g), tuple(map(id, g["params"]))) for g in self.param_groups))
        if key == self._state_key:
            return
        self._fill_state()
        self._state_key = (id(self.state), len(self.state), key[2])

    def _fill_state(self) -> None:
        settled = self._settled  # Muon tensors that need nothing but a momentum buffer (no AdamW slices)
        for g in self.param_groups:
            muon = g["use_muon"]
            for p in g["params"]:
                st = self.state[p]
                if muon:
                    if NORMUON_V not in st and is_normuon(g) and id(p) in self._bindings:  # whole, every rank
                        st[NORMUON_V] = new_moment(self._bindings[id(p)], p)
                    buf = st.get("momentum_buffer")
                    if buf is None:
                        st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    elif buf.stride() != p.stride():  # loaded from a differently laid-out model
                        st["momentum_buffer"] = _relaid_like(buf, p, self._bindings.get(id(p)))
                    if id(p) in settled or "exp_avg" in st:
                        continue
                    b = self._bindings.get(id(p))
                    if b is not None and b.has_adam:  # mixed flat parameter (FSDP1), on every rank
                        st["step"] = torch.tensor(0.0, dtype=torch.float32)
                        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    elif _fsdp1_view(p):
                        st["exp_avg"], st["exp_avg_sq"] = _placeholder_like(p), _placeholder_like(p)
                    elif b is not None:
                        settled.add(id(p))
                elif "exp_avg" not in st:
                    st["step"] = torch.tensor(0.0, dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if _fsdp1_view(p):
                        st["momentum_buffer"] = _placeholder_like(p)

    def _step_group(self):
        """The group the step's collectives run in, and its size (see :meth:`Agreement.group`)."""
        return self._agreement.group(self.process_group, self.param_groups, self._binding_sig)

    def _check_gradients(self, failed=None) -> Optional[set]:
        """Which tensors step, agreed by every rank before anything changes
        (:class:`~ds_muon.engine.agreement.check.Agreement`).  Returns None when the step is skipped."""
        items = [(gi, pi, p) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])]
        group, world = self._step_group()
        verdict = self._agreement.check(items, self._name, group, world,
                                        settings_of(self) if world > 1 else None, self._dispatch, failed)
        if verdict.nonfinite:
            name = verdict.nonfinite[0]
            if self.nonfinite == "raise":
                raise FloatingPointError(
                    f"ds_muon: non-finite gradient in {name} (and {len(verdict.nonfinite) - 1} more); nothing "
                    "was changed. Pass nonfinite='skip' to skip such steps instead"
                )
            self.nonfinite_skips += 1
            warnings.warn(
                f"ds_muon: skipped step: non-finite gradient in {name} "
                f"({self.nonfinite_skips} step(s) skipped so far)", RuntimeWarning, stacklevel=4)
            return None
        return verdict.active

    def _adamw(self, group: dict, params: List[torch.Tensor]) -> None:
        params = self._skip_empty(params)
        if not params:
            return
        st = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        kernel = getattr(self, "adamw_kernel", None) or functional_adamw  # opt-in: ds_muon.integrations.deepspeed_cpu_adam
        weights, grads, exp_avgs = ([local_shard(p) for p in params], [local_shard(p.grad) for p in params],
                                    [local_shard(s["exp_avg"]) for s in st])
        decay = adamw_decay_(weights, grads, exp_avgs, group.get("weight_decay_mode", "decoupled"), group["lr"],
                             group["weight_decay"], beta1)  # independent/cautious here, decoupled in the kernel
        kernel(
            weights, grads, exp_avgs, [local_shard(s["exp_avg_sq"]) for s in st], [], [s["step"] for s in st],
            foreach=group.get("foreach"), amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=decay, eps=group["eps"], maximize=False,
        )

    def _skip_empty(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """Params with a gradient; a grad-less one (no local elements, FSDP1) only counts the step."""
        out = []
        for p in params:
            if p.grad is None:
                self.state[p]["step"] += 1
            else:
                out.append(p)
        return out

    def _adamw_ranges(self, group: dict, params: List[torch.Tensor]) -> None:
        """AdamW on the ``adam_ranges`` slices of mixed flat shards in a Muon group (FSDP1).

        Hyper-parameters: the group's ``adam_lr`` (default 3e-4, as in
        ``muon_param_groups``), ``adam_betas``/``adam_eps`` (default the optimizer's),
        ``adam_weight_decay`` (default 0), decayed by the optimizer's ``weight_decay_mode`` (the mode
        an AdamW group of ``muon_param_groups`` takes; :func:`ds_muon.rules.decay.adamw_decay_`).
        One step count per tensor, shared by its slices.
        """
        views = ([], [], [], [], [])
        for p in self._skip_empty([p for p in params if self._bindings[id(p)].has_adam]):
            b, st = self._bindings[id(p)], self.state[p]
            flats = [b.flat(t) for t in (p, p.grad, st["exp_avg"], st["exp_avg_sq"])]
            for off, n in b.adam_ranges:
                for lst, f in zip(views, flats):
                    lst.append(f[off:off + n])
                views[4].append(st["step"].clone())  # each slice steps its own copy ...
            st["step"] += 1  # ... and the tensor's count moves once
        if not views[0]:
            return
        beta1, beta2 = group.get("adam_betas", self.adam_betas)
        lr = group.get("adam_lr", DEFAULT_ADAM_LR)
        # the mode an AdamW group of muon_param_groups gets (the optimizer's), as for the other adam_* keys
        decay = adamw_decay_(views[0], views[1], views[2], self.defaults["weight_decay_mode"], lr,
                             group.get("adam_weight_decay", 0.0), beta1)
        functional_adamw(
            views[0], views[1], views[2], views[3], [], views[4], foreach=group.get("foreach"), amsgrad=False,
            beta1=beta1, beta2=beta2, lr=lr, weight_decay=decay, eps=group.get("adam_eps", self.adam_eps),
            maximize=False,
        )

    def _check(self, failed=None) -> Optional[set]:
        """Stage 1: the agreement (:meth:`_check_gradients`); early gathers are waited out
        when the step raises or is skipped."""
        try:
            active = self._check_gradients(failed)
        except BaseException:
            self._drain_early()
            raise
        if active is None:
            self._drain_early()
        return active

    def _adamw_all(self, active: set) -> None:
        """Stage 2: AdamW on ``use_muon=False`` groups and on the AdamW slices of mixed flat shards."""
        for g in self.param_groups:
            if not g["use_muon"]:
                self._adamw(g, [p for p in g["params"] if id(p) in active])
            elif any(b.has_adam for b in (self._bindings.get(id(p)) for p in g["params"]) if b is not None):
                self._adamw_ranges(g, [p for p in g["params"] if id(p) in active])

    def _active_matrices(self, active: set) -> List[Tuple[Layout, List[int]]]:
        """Stage 3: each layout (one per process group) with the indices of its matrices that step."""
        work = []
        for layout in self._layouts:
            todo = [i for i, (b, _) in enumerate(layout.local) if id(b.param) in active]
            if todo:
                work.append((layout, todo))
        return work

    def _plan(self, work) -> List[_Job]:
        """Stage 4: the compiled exchanges of each layout's active matrices (:mod:`~ds_muon.engine.plan.compile`),
        planned on first use and cached (a few sets of active matrices per layout) while the
        layout and NS settings stay."""
        jobs = []
        for layout, todo in work:
            key = exchange_key(layout, todo, self.param_groups)
            compiled = self._exchanges.get(key, lambda: compile_exchanges(
                layout, todo, self._muon_groups(), mode=self.mode, planner=self.planner,
                cost_model=self.planning_cost_model(),
                comm_dtype=self.comm_dtype, waves=self.waves, group=self._exchange_groups.of(layout.group),
                offload=bool(getattr(self.adapter, "offload", False)),
                team_ns=self.team_ns, team_groups=self._team_groups))
            jobs.extend(_Job(key, layout, ex, ns_of) for ex, ns_of in compiled)
        return jobs

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

    def _batches(self, jobs: List[_Job]) -> List[List[_Job]]:
        """Stages 5-7 run on all waves together (every gather issued before any NS), or, when no
        wave moves anything (one process) and none left from backward, on one wave after another:
        then one wave's transients live at a time (waves of bounded memory: ds_muon.engine.memory.budget)."""
        if self._dispatch is None and not any(j.exchange.gather_traffic or j.exchange.scatter_traffic for j in jobs):
            return [[j] for j in jobs]
        return [jobs]

    def _gather(self, jobs: List[_Job]) -> list:
        """Stage 5: every wave's gather issued (of every domain) before any is waited on; a wave's
        momentum is computed just before its gather, so one wave's NS inputs live at a time.
        Gathers a backward hook already issued are claimed (their momentum committed now)."""
        early = self._dispatch.claim([j.exchange for j in jobs]) if self._dispatch is not None else {}
        return [early[id(j.exchange)] if id(j.exchange) in early else self._gather_one(j) for j in jobs]

    def _gather_one(self, j: _Job):
        """One wave's inputs into its gather, at most the exchange's memory budget of them at a time."""
        pieces = self._pieces_of(j.layout, j.exchange)
        parts = pieces.parts(getattr(j.exchange, "memory_budget", None))  # (a team's exchange: none)
        if len(parts) == 1:
            pending = j.exchange.gather_start(self._wave_inputs(j.layout, j.exchange)[0])
            pieces.sent()  # copied into the exchange: their memory goes back
            return pending
        for part in parts:
            j.exchange.gather_fill(pieces.inputs(self.param_groups, self.state, True, self._step_token, part)[0])
            pieces.sent()
        return j.exchange.gather_start(None, filled=True)

    def _orthogonalize(self, jobs: List[_Job], gathers: list) -> list:
        """Stage 6: as each gather arrives, NS at home (batched by shape and settings), then
        NorMuon on the results of ``variant="normuon"`` matrices (:mod:`~ds_muon.engine.exchange.row_moments`),
        then its scatter is issued (and the homes' new NorMuon moments shared with every rank).
        Returns the pending scatters."""
        scatters, shared = [], []
        normuon = any(g["use_muon"] and is_normuon(g) for g in self.param_groups)
        group_of = self._muon_groups() if normuon else {}
        if normuon and self._moments_loaded is not None:  # a load: make every rank's v the saved one
            agree_after_load(self._layouts, group_of, self.state, self._moments_loaded)
        for j, pending in zip(jobs, gathers):
            stacks = j.exchange.gather_finish(pending)
            results = {key: j.ns_of[key].run(stack) for key, stack in stacks.items()}
            if normuon:
                RowMoments.at_home(j.layout, j.exchange, results, group_of, self.state)
            scatters.append(j.exchange.scatter_start(results))
            if normuon:
                shared.append(RowMoments.share_start(j.layout, j.exchange, group_of, self.state))
        for s in shared:
            if s is not None:
                s.finish()
        return scatters

    def _apply(self, jobs: List[_Job], scatters: list) -> None:
        """Stage 7: each wave's results applied in place, now or (overlap) by the next forward."""
        defer = self._deferred is not None and self._stack_allows_overlap()
        for j, pending in zip(jobs, scatters):
            apply = self._applier(j.layout, j.exchange, pending)
            if defer:
                params = _params_of(j.layout, j.exchange.active)
                self._deferred.add(list(params), apply, list(params.values()))
            else:
                apply(self._step_token)

    def _wave_inputs(self, layout: Layout, ex: Exchange, commit: bool = True):
        """This rank's pieces of one wave's Muon inputs: weight decay (L2), momentum, Nesterov,
        for all pieces of a param group at once (:func:`~ds_muon.rules.update.ns_input`).

        With ``commit=False`` (a dispatch from backward) the momentum buffers are left
        alone and ``(buffer slice, new value)`` pairs are returned for :meth:`step` to
        commit once the gradients are known to be good.  Returns ``(pieces, commits)``.
        """
        return self._pieces_of(layout, ex).inputs(self.param_groups, self.state, commit,
                                                  bound_in=self._step_token if commit else None)

    def _pieces_of(self, layout: Layout, ex: Exchange) -> WavePieces:
        """The wave's pieces with their views (:class:`~ds_muon.engine.exchange.pieces.WavePieces`), made once per
        wave while the param groups keep their members."""
        members = tuple((id(g), len(g["params"])) for g in self.param_groups)
        if members != self._pieces_members:
            self._pieces.clear()
            self._pieces_members = members
        pieces = self._pieces.get(ex)
        if pieces is None:
            index = {id(p): gi for gi, g in enumerate(self.param_groups) if g["use_muon"] for p in g["params"]}
            pieces = self._pieces[ex] = WavePieces(layout, ex.active, index, getattr(ex, "reads", None))
        return pieces

    def _muon_groups(self) -> Dict[int, dict]:
        """Each Muon tensor's param group, by id (looked up afresh: load_state_dict replaces groups)."""
        return {id(p): g for g in self.param_groups if g["use_muon"] for p in g["params"]}

    def _hyper(self, param_ids) -> tuple:
        """The settings a wave's inputs depend on (besides gradients and parameters)."""
        group_of = self._muon_groups()
        keys = ("momentum", "nesterov", "weight_decay", "weight_decay_mode")
        # a tensor no longer in a Muon group reads as None: the early dispatch is stale, not an error
        return tuple(tuple(group_of[i][k] for k in keys) if i in group_of else None for i in sorted(param_ids))

    def _arm(self, jobs: List[_Job]) -> None:
        """Hook the waves of this step's exchanges whose gradients are final in backward: as the
        adapter says (FSDP2 units: yes), and any parameter in a single process."""
        if self._final_grads is None or self._final_grads[0] != self._binding_sig:
            context = BindContext(self.process_group, self.model)
            self._final_grads = (self._binding_sig, {pid for pid, b in self._bindings.items()
                                                     if self.adapter.grad_final_at_hook(b.param, context)})
        final = self._final_grads[1]
        waves = [Wave(j.key, j.layout, j.exchange, _params_of(j.layout, j.exchange.active)) for j in jobs]
        if self._step_group()[1] > 1:  # a layout's waves are hooked only if all its gradients are final
            partial = {w.key for w in waves if not all(pid in final for pid in w.params)}
            waves = [w for w in waves if w.key not in partial]
        self._dispatch.arm(waves)

    def _land(self, param_ids: set) -> None:
        """Apply any update of the previous step still deferred on these parameters."""
        if self._deferred is not None:
            self._deferred.apply_for(param_ids)

    def _drain_early(self) -> None:
        if getattr(self, "_dispatch", None) is not None:
            self._dispatch.drain()

    def _applier(self, layout: Layout, ex: Exchange, pending) -> Callable[[], None]:
        """Finish one exchange's scatter and apply its results in place, all pieces that share
        a learning rate, decay and scale at once.  Learning rates and decay are read now, at
        step time, so a scheduler stepping before a deferred apply cannot change this step's update."""
        pieces = self._pieces_of(layout, ex)
        coefficients = pieces.coefficients(self.param_groups)

        @torch.no_grad()  # may run later, from a forward pre-hook
        def apply(bound_in=None):
            """``bound_in``: the step's token when applied within it (the views were checked this step).
            (No reference to the optimizer: a dropped optimizer's deferred updates must not keep it alive.)"""
            pieces.apply(ex.scatter_finish(pending), coefficients, bound_in)
            if hasattr(ex, "done"):  # the exchange's buffers give their memory back until the next step
                ex.done()

        return apply

    def flush(self) -> None:
        """Apply every update still waiting for a forward (``overlap=True``); a no-op otherwise."""
        if getattr(self, "_deferred", None) is not None:
            self._deferred.flush()

    def state_dict(self):
        """torch's state dict; NorMuon's ``normuon_v`` of an FSDP1 flat parameter as a tuple of floats
        (see :func:`~ds_muon.engine.exchange.row_moments.fsdp1_moments`: FSDP1's optimizer state dicts take every
        state tensor with a dimension for a shard of the flat parameter)."""
        self.flush()
        held = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) not in held for p in self.state):
            raise RuntimeError(
                "ds_muon: Muon.state_dict(): the optimizer holds state of tensors its param_groups do not list now "
                + ("(DeepSpeed ZeRO-3 hands the optimizer its partitions only inside step()): save through DeepSpeed, "
                   "engine.optimizer.state_dict() (what deepspeed.initialize returned as the optimizer; no collective) "
                   "or engine.save_checkpoint(dir) on every rank" if self.adapter.applies_in_step else
                   "(a tensor was removed from param_groups): drop its state (opt.state.pop(param)) first"))
        return fsdp1_moments(super().state_dict(), self.param_groups)

    def load_state_dict(self, state_dict) -> None:
        """torch's load, after checking that the saved groups match these (same
        algorithm, same tensor names) and hold valid settings; older ds_muon state dicts
        are brought up to date (see :meth:`_upgrade_groups`)."""
        # keys that would do nothing on their group's kind: refused, or dropped when filled (an older ds_muon)
        state_dict = {**state_dict, "param_groups": [loaded_group(g, gi, self.defaults)
                                                     for gi, g in enumerate(state_dict["param_groups"])]}
        check_loaded_groups(self.param_groups, state_dict["param_groups"], self.defaults, self.adam_betas, self.adam_eps)
        check_loaded_state(self.param_groups, state_dict, self._name)
        check_loaded_moments(self.param_groups, state_dict["param_groups"], state_dict["state"],
                             self._local_bindings(), self._name, self.defaults)  # the step's check, now
        check_loaded = getattr(self.adapter, "check_loaded", None)  # the stack's own refusals (optional)
        if check_loaded is not None:
            check_loaded(self.param_groups, state_dict, self._name, self.model)
        self.flush()
        self._drain_early()  # their momentum was computed from the state being replaced
        moments, state_dict = split_moments(state_dict)  # NorMuon's v stays float32 (torch casts state)
        super().load_state_dict(state_dict)
        restore_moments(self.param_groups, state_dict["param_groups"], moments, self.state)
        self._moments_loaded = set()  # layouts whose v the ranks have agreed on since (engine.row_moments)
        self._exchanges.clear()  # compiled for the old state's dtypes (a load casts state to the parameters')

    # -- introspection --------------------------------------------------------
    def summary(self, all_ranks: bool = False) -> Summary:
        """Per tensor: Muon or AdamW and why, its logical matrices (after splits, experts and
        tensor-parallel tags) with their scale factors and home ranks; per rank: NS FLOPs and
        bytes moved per step.  ``str()`` is a table.  Every rank computes every rank's columns
        (of the process groups it is in), so rank 0 prints the whole picture, with no collective
        once the tensors are bound (after the first step).

        Any rank may call it alone at any time (``if rank == 0: print(opt.summary())``): before the
        first step of a multi-rank run, placing every rank's pieces is a collective, so this rank
        describes what its own metadata tells (tensors, matrices, scales) and says "planned at the first
        step" for the homes and the per-rank costs.  ``all_ranks=True``, called on every rank, binds
        now and gives the exact plan (see :mod:`ds_muon.engine.report.summary`)."""
        check_boolean(all_ranks, "all_ranks")
        if all_ranks or not self._binding_is_collective():
            return summarize(self)
        if self.adapter.applies_in_step and self._resolved:  # DeepSpeed, after a step: each group it stepped
            return summarize(self, sets=list(self._resolved.values()))
        return summarize_planned(self, self._bind_all)

    def _binding_is_collective(self) -> bool:
        """Would binding the tensors now communicate (a multi-rank run whose current tensors are unbound)?"""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return False
        return self._signature() not in self._resolved

    def exchanges(self) -> List[Exchange]:
        """The compiled exchanges now cached (for reports and tests)."""
        return self._exchanges.exchanges()




def _fsdp1_view(p: torch.Tensor) -> bool:
    """An original parameter FSDP1 (use_orig_params=True) flattened into a FlatParameter."""
    return getattr(p, "_fsdp_flattened", False) and not hasattr(p, "_fqns")


def _relaid_like(buf: torch.Tensor, p: torch.Tensor, binding: Optional[ParamBinding]) -> torch.Tensor:
    """``buf`` copied into ``p``'s memory layout (a channels_last weight's momentum saved
    from a contiguous model), so the binding's flat view of it is a view: the momentum
    update is written through it and must land in the state."""
    if buf.shape != p.shape or local_shard(p) is not p or binding is not None and binding.copied:
        return buf  # (a tensor with no flat view keeps a contiguous buffer: see ParamBinding.copied)
    out = torch.empty_like(p, dtype=buf.dtype, memory_format=torch.preserve_format).copy_(buf)
    if binding is not None:
        assert binding.flat(out).data_ptr() == out.data_ptr() and binding.flat(out)._base is not None, \
            "ds_muon: a momentum buffer laid out like its parameter must flatten to a view"
    return out


def _placeholder_like(p: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``p`` that take no memory (stride 0), for state keys a tensor never uses.

    FSDP1's optim_state_dict (use_orig_params=True) gathers each state key over all
    tensors of a FlatParameter, so Muon and AdamW tensors sharing one must hold the
    same keys (momentum_buffer, exp_avg, exp_avg_sq).
    """
    return torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)


def _group_key(group):
    return None if group is None else id(group)
