"""``Muon``: a torch.optim.Optimizer that orthogonalizes each weight matrix once, at one home rank.

The step's order (every stack goes through the same path):

1. check, before anything changes: gradient presence agrees across ranks and
   every gradient is finite (one small all_reduce when distributed);
2. AdamW, through torch's own functional AdamW, on tensors of ``use_muon=False``
   groups (and on the non-matrix slices of mixed flat shards);
3. Muon, on local pieces only: weight decay, momentum, Nesterov;
4. the :mod:`~ds_muon.exchange` brings every matrix whole to its home
   (:mod:`~ds_muon.planner`), NS runs there batched by shape, results go back;
5. each rank applies its pieces of the results in place.

With ``overlap=True`` the exchange runs in waves; under FSDP2 a wave's momentum
and gather may already have left during backward (:mod:`~ds_muon.dispatch`, its
momentum committed here after step 1), and results may be applied by the next
forward (:mod:`~ds_muon.overlap`).

How tensors are laid out across ranks comes from :mod:`~ds_muon.integrations`
as :class:`~ds_muon.layout.ParamBinding` objects; nothing here depends on the stack.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Dict, Hashable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim.adamw import adamw as functional_adamw

from . import agreement
from .dispatch import BackwardDispatch, Wave, final_grad_params
from .exchange import Exchange
from .groups import as_dtype, check_loaded_groups, check_settings, dtype_name, fill_group_defaults, validate_group
from .layout import Layout, ParamBinding, build_layout, global_shape
from .layout import is_flat_shard as _is_sharded_container  # the name _resolve uses
from .newton_schulz import compute_dtype, input_dtype, newton_schulz, ns_flops, resolve_coefficients
from .overlap import DeferredApply
from .tagging import restore_tags
from .planner import STRATEGIES, CostModel, MatrixTask, plan_homes
from .update import apply_coefficients, apply_result, ns_input

MODES = ("sharded", "duplicated")
DEFAULT_ADAM_LR = 3e-4  # for the AdamW slices of mixed flat shards without "adam_lr" (as muon_param_groups)
NONFINITE = ("raise", "skip")


class Muon(Optimizer):
    """Muon for hidden weight matrices, AdamW for everything else, sharded or not.

    Param groups carry ``use_muon`` (default True); build them with
    :func:`ds_muon.muon_param_groups`.  AdamW groups use their ``lr``, ``betas``
    (default ``adam_betas``), ``eps`` (default ``adam_eps``) and ``weight_decay``.
    ``mode="duplicated"`` is the baseline that runs every NS on every rank.
    ``comm_dtype`` (default: lossless — the NS dtype where NS would cast to it
    anyway) can be forced narrower, which breaks bitwise parity.
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        weight_decay_mode: str = "decoupled",
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
        planner: str = "locality",
        cost_model: Optional[CostModel] = None,
        overlap: bool = False,
        waves: int = 4,
        dispatch_in_backward: bool = True,
    ):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is unknown; use one of {list(MODES)}")
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite={nonfinite!r} is unknown; use one of {list(NONFINITE)}")
        if planner not in STRATEGIES:
            raise ValueError(f"planner={planner!r} is unknown; use one of {list(STRATEGIES)}")
        if not isinstance(waves, int) or waves < 1:
            raise ValueError(f"waves must be an integer >= 1, got {waves!r}")
        self.mode = mode
        self.overlap = bool(overlap)
        self.waves = waves if overlap else 1
        self.dispatch_in_backward = bool(dispatch_in_backward)
        self.nonfinite = nonfinite
        self.process_group = process_group
        self.model = model
        self.comm_dtype = None if comm_dtype is None else as_dtype(comm_dtype, "comm_dtype")
        self.planner = planner
        self.cost_model = cost_model or CostModel()
        self.adam_betas = tuple(adam_betas)
        self.adam_eps = adam_eps
        self.nonfinite_skips = 0
        self.binder: Optional[Callable] = None  # set by an integration that owns the layout
        self._not_carried: Tuple[str, ...] = ()  # what a copy lost and must be given again (see __getstate__)
        self._reset_runtime()
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            weight_decay_mode=weight_decay_mode, ns_steps=ns_steps, ns_coefficients=ns_coefficients,
            ns_method=ns_method,
            ns_dtype=dtype_name(ns_dtype, "ns_dtype"), eps=eps, scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor, use_muon=True,
        )
        super().__init__(params, defaults)

    def _reset_runtime(self) -> None:
        """Caches and hooks, all rebuilt lazily: bindings, layouts, compiled exchanges, and
        (``overlap=True`` with a model) the deferred-apply and backward-dispatch hooks."""
        model = self.model
        self._deferred = DeferredApply(model) if self.overlap and model is not None else None
        self._dispatch = (BackwardDispatch(self._wave_inputs, self._hyper, self._land)
                          if self.overlap and model is not None and self.dispatch_in_backward else None)
        self._bindings: Dict[int, ParamBinding] = {}
        self._binding_sig: Optional[tuple] = None
        self._layouts: List[Layout] = []
        self._resolved: Dict[tuple, tuple] = {}
        self._exchanges: Dict[tuple, Tuple[Exchange, list]] = {}
        self._agreement: Dict[tuple, tuple] = {}  # per set of tensors: rows of the agreement all_reduce
        self._final_grads: Optional[tuple] = None  # (binding signature, ids whose grad hooks see final grads)
        self._mesh_group: Optional[tuple] = None  # (binding signature, group of the DTensors' mesh)

    # -- copies, pickling and loading --------------------------------------------
    _SETTINGS = ("mode", "overlap", "waves", "dispatch_in_backward", "nonfinite", "comm_dtype", "planner",
                 "cost_model", "adam_betas", "adam_eps", "nonfinite_skips")
    _NOT_CARRIED = ("model", "process_group", "binder")

    def __getstate__(self) -> dict:
        """What ``copy.deepcopy`` and pickle carry: torch's ``defaults``, ``state`` and
        ``param_groups`` plus ds_muon's own settings (``mode``, ``planner``, ``waves``,
        ``comm_dtype``, ``nonfinite``, ``adam_betas``, ...).

        Not carried: ``model``, ``process_group`` and a stack's ``binder`` (a DeepSpeed
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
            k for k in self._NOT_CARRIED if getattr(self, k, None) is not None) + tuple(self._not_carried)
        return state

    def __setstate__(self, state: dict) -> None:
        """Pickle/deepcopy (with ds_muon's settings) and torch's ``load_state_dict``
        (``state`` and ``param_groups`` only) both land here; either way the groups are
        brought up to date (see :meth:`_upgrade_groups`)."""
        settings = state.pop("ds_muon", None)
        super().__setstate__(state)
        if settings is not None:
            lost = settings.pop("_not_carried")
            self.__dict__.update(settings)
            self.model = self.process_group = self.binder = None
            self._not_carried = tuple(sorted(set(lost) - {"model"}))
            self._reset_runtime()
        self._upgrade_groups()

    def _upgrade_groups(self) -> None:
        """Fill what older ds_muon state dicts lack, as torch's optimizers do on load:
        missing group keys from the defaults, dtypes by name, and an AdamW ``step``
        stored as a plain number as a float32 tensor."""
        for group in self.param_groups:
            fill_group_defaults(group, self.defaults, self.adam_betas, self.adam_eps)
            group["ns_dtype"] = dtype_name(group["ns_dtype"], "ns_dtype")  # older ones stored a torch.dtype
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st and not torch.is_tensor(st["step"]):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

    def _check_not_carried(self) -> None:
        """A copy (deepcopy/pickle) that lost a process group or a stack binding refuses to step."""
        if "binder" in self._not_carried and self.binder is None:
            from .integrations.deepspeed import HOW_TO_BIND

            raise RuntimeError(
                "ds_muon: this Muon is a copy (copy.deepcopy / pickle) of one bound to a DeepSpeed engine; "
                "bindings are not copied and stepping it unbound would orthogonalize the wrong thing. "
                "Bind the copy to the engine that steps it: " + HOW_TO_BIND)
        if "process_group" in self._not_carried and self.process_group is None:
            raise RuntimeError(
                "ds_muon: this Muon is a copy (copy.deepcopy / pickle) of one built with a process_group; "
                "process groups are not copied: set copy.process_group to the group it should plan in")

    # -- groups ----------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if not param_group.get("use_muon", True):
            param_group.setdefault("betas", self.adam_betas)
            param_group.setdefault("eps", self.adam_eps)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        validate_group(group, len(self.param_groups) - 1)
        if hasattr(self, "_resolved"):
            self.invalidate_layouts()

    def _name(self, gi: int, pi: int) -> str:
        names = self.param_groups[gi].get("param_names")
        return names[pi] if names else f"param_groups[{gi}]['params'][{pi}]"

    # -- bindings and layouts (rebuilt when parameters change) ----------------
    def _resolve(self) -> None:
        """Bindings and Layouts for the Muon tensors now in ``param_groups``.

        Cached per set of tensors (and their placements): a stack that swaps
        parameters (accelerate, FSDP2 built after the optimizer) gets new layouts;
        one that narrows ``param_groups`` per call (DeepSpeed) reuses each set's.
        """
        sig = tuple(
            (id(p), _placement_sig(p)) for g in self.param_groups if g["use_muon"] for p in g["params"]
        )
        if sig == self._binding_sig:
            return
        if sig not in self._resolved:
            from .integrations import default_binder

            binder = self.binder or default_binder
            bindings: Dict[int, ParamBinding] = {}
            by_group: Dict[object, tuple] = {}
            for gi, g in enumerate(self.param_groups):
                if not g["use_muon"]:
                    continue
                tags = g.get("param_tags")
                tags = tags if tags and len(tags) == len(g["params"]) else [None] * len(g["params"])
                for pi, p in enumerate(g["params"]):
                    restore_tags(p, tags[pi])  # a stack swapped the tensor muon_param_groups tagged
                    if self.binder is None and len(global_shape(p)) < 2 and not _is_sharded_container(p):
                        raise RuntimeError(_unbound_message(self._name(gi, pi), p))
                    b = binder(self, p, self._name(gi, pi))
                    bindings[id(p)] = b
                    # an empty matrix (a layer with 0 outputs or inputs) has nothing to orthogonalize
                    by_group.setdefault(_group_key(b.group), (b.group, []))[1].extend(
                        (b, s) for s in b.matrices if math.prod(s.matrix_shape))
            layouts = [build_layout(entries, group) for group, entries in by_group.values()]
            self._resolved[sig] = (bindings, layouts)
        self._bindings, self._layouts = self._resolved[sig]
        self._binding_sig = sig

    def invalidate_layouts(self) -> None:
        """Forget every binding, layout and compiled exchange (after re-sharding)."""
        self._resolved.clear()
        self._exchanges.clear()
        self._agreement.clear()
        self._final_grads = None
        self._mesh_group = None
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
        for gi, g in enumerate(self.param_groups):
            check_settings(g, gi)
        if self._not_carried:
            self._check_not_carried()
        self.flush()
        self._resolve()
        self._init_state()
        try:
            active = self._check_gradients()
        except BaseException:
            self._drain_early()
            raise
        if active is None:
            self._drain_early()
            return loss
        for g in self.param_groups:
            if not g["use_muon"]:
                self._adamw(g, [p for p in g["params"] if id(p) in active])
            elif any(b.adam_ranges for b in (self._bindings.get(id(p)) for p in g["params"]) if b is not None):
                self._adamw_ranges(g, [p for p in g["params"] if id(p) in active])
        self._muon(active)
        return loss

    def _init_state(self) -> None:
        """State for every tensor at once, so every rank holds the same keys (DCP needs it)."""
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if g["use_muon"]:
                    if "momentum_buffer" not in st:
                        st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    elif st["momentum_buffer"].stride() != p.stride():  # loaded from a differently laid-out model
                        st["momentum_buffer"] = _relaid_like(st["momentum_buffer"], p, self._bindings.get(id(p)))
                    b = self._bindings.get(id(p))
                    if b is not None and b.adam_ranges and "exp_avg" not in st:  # mixed flat shard (FSDP1)
                        st["step"] = torch.tensor(0.0, dtype=torch.float32)
                        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    elif _fsdp1_view(p) and "exp_avg" not in st:
                        st["exp_avg"], st["exp_avg_sq"] = _placeholder_like(p), _placeholder_like(p)
                elif "exp_avg" not in st:
                    st["step"] = torch.tensor(0.0, dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if _fsdp1_view(p):
                        st["momentum_buffer"] = _placeholder_like(p)

    def _agreement_group(self):
        """The group every rank of this optimizer runs the step's collectives in: ``process_group``,
        else the ranks of the FSDP2 mesh the parameters live on (a sub-mesh need not be the world)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1
        group = self.process_group
        if group is None:
            if self._mesh_group is None or self._mesh_group[0] != self._binding_sig:
                self._mesh_group = (self._binding_sig, _mesh_group(self.param_groups))
            group = self._mesh_group[1]
        return group, dist.get_world_size(group)

    def _local_grad(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        b = self._bindings.get(id(p))
        g = p.grad
        if g is None:
            return None
        return b.flat(g) if b is not None else _local(g)

    def _local_numel(self, p: torch.Tensor) -> int:
        b = self._bindings.get(id(p))
        return b.flat(p).numel() if b is not None else _local(p).numel()

    def _check_gradients(self) -> Optional[set]:
        """Which tensors step, agreed by every rank before anything changes.

        Returns None when the step is skipped.  Raises on the first problem, the
        same error on every rank (the flags are all-reduced, not local).
        """
        items = [(gi, pi, p) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])]
        group, world = self._agreement_group()
        rows, nrows, names = self._agreement_rows(items, group, world)
        flags = [[0] * agreement.COLUMNS for _ in range(nrows)]  # see ds_muon.agreement
        checks = []  # (row, (min, max), is a replica)
        minmax = {}
        for k, (gi, pi, p) in enumerate(items):
            k = rows[k]
            g = p.grad
            if g is None:
                # FSDP1 (use_orig_params=True) gives no grad to a parameter with no local elements
                flags[k][agreement.NO_GRAD] = int(self._local_numel(p) > 0)
                continue
            if g.is_sparse:
                raise ValueError(f"ds_muon: {self._name(gi, pi)} has a sparse gradient; Muon and AdamW here need dense ones")
            flags[k][agreement.HAS_GRAD] = 1
            lg = self._local_grad(p)
            if lg.numel():
                # min and max in one pass: NaN and ±inf both show up in them
                minmax[id(p)] = torch.stack(torch.aminmax(lg))
                checks.append((k, minmax[id(p)], world > 1 and _is_replica(p)))
        if checks:
            mm = torch.stack([c for _, c, _ in checks])
            ok = torch.isfinite(mm).all(dim=1).to(torch.int64)
            host = torch.stack([ok, agreement.minmax_hash(mm)]) if world > 1 else ok.expand(2, -1)
            ok, fp = host.cpu().tolist()  # one device-to-host copy
            for (k, _, replica), good, h in zip(checks, ok, fp):
                flags[k][agreement.NONFINITE] = int(not good)
                if replica:  # its gradient must be the same on every rank
                    flags[k][agreement.N_HASHED:] = agreement.hashed_row(h)[agreement.N_HASHED:]
        # one more row: "a wave dispatched from backward read something that changed since"
        stale = [0] * agreement.COLUMNS
        stale[0] = int(self._dispatch is not None and self._dispatch.stale(minmax))
        flags.append(stale)
        if world > 1:
            settings = agreement.settings_of(self)  # and one: every rank's settings, hashed
            flags.append(agreement.hashed_row(agreement.settings_hash(settings)))
            total = torch.tensor(flags, dtype=torch.int64, device=_comm_device(group))
            dist.all_reduce(total, group=group)
            flags = total.cpu().tolist()
            if agreement.hashes_differ(flags[nrows + 1]):
                everyone = [None] * world
                dist.all_gather_object(everyone, settings, group=group)
                raise ValueError(
                    f"ds_muon: optimizer settings differ between ranks: {agreement.first_difference(everyone)}; "
                    "every rank must build Muon with the same arguments and param groups, and change them alike")
        if flags[nrows][0]:  # on every rank alike: wait out the early gathers, redo them below
            self._dispatch.redone += 1
            self._drain_early()
        for k in range(nrows):
            if flags[k][0] and flags[k][1]:
                raise RuntimeError(
                    f"ds_muon: {names[k]} has a gradient on {flags[k][0]} rank(s) and none on "
                    f"{flags[k][1]}; every rank must produce the same set of gradients (unused parameters "
                    "need the same treatment everywhere, e.g. set their grad to zeros or None on all ranks)"
                )
        drift = [k for k in range(nrows) if agreement.hashes_differ(flags[k]) and not flags[k][agreement.NONFINITE]]
        if drift:
            raise RuntimeError(
                f"ds_muon: {names[drift[0]]} (and {len(drift) - 1} more) is replicated (every rank holds all of it) "
                "but its gradient differs between ranks, so the ranks would train different models: gradients are "
                "not being averaged. Wrap the model in DDP (or FSDP / DeepSpeed) before training; with "
                "transformers' Trainer do not call trainer.evaluate() before trainer.train() (it then never wraps "
                "the model; use TrainingArguments(eval_on_start=True)). Nothing was changed")
        bad = [k for k in range(nrows) if flags[k][2]]
        if bad:
            name = names[bad[0]]
            if self.nonfinite == "raise":
                raise FloatingPointError(
                    f"ds_muon: non-finite gradient in {name} (and {len(bad) - 1} more); nothing "
                    "was changed. Pass nonfinite='skip' to skip such steps instead"
                )
            self.nonfinite_skips += 1
            warnings.warn(
                f"ds_muon: skipped step: non-finite gradient in {name} "
                f"({self.nonfinite_skips} step(s) skipped so far)", RuntimeWarning, stacklevel=3)
            return None
        return {id(p) for k, (_, _, p) in enumerate(items) if flags[rows[k]][0]}

    def _agreement_rows(self, items, group, world) -> Tuple[List[int], int, List[str]]:
        """Where each tensor's flags go in the one all_reduce of :meth:`_check_gradients`.

        Tensors without a :func:`~ds_muon.domain` tag (or whose domain is the whole
        agreement group) are the same tensors on every rank: one row each, in order.
        Tensors of a smaller domain (expert data parallelism) differ between domains,
        so each domain gets its own block of rows, written only by its members: the
        sums then count agreement within the domain, and every rank still sees every
        problem (and raises or skips alike).  The block layout is agreed once per set
        of tensors (one all_gather_object); returns (row of each item, rows, row names).
        """
        key = tuple(id(p) for _, _, p in items)
        cached = self._agreement.get(key)
        if cached is not None:
            return cached
        names = [self._name(gi, pi) for gi, pi, _ in items]
        if world == 1:
            out = (list(range(len(items))), len(items), names)
            self._agreement[key] = out
            return out
        from .tagging import domain_of

        here = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        common: List[int] = []
        mine: Dict[tuple, List[int]] = {}
        for k, (_, _, p) in enumerate(items):
            d = domain_of(p)
            ranks = None if d is None else tuple(sorted(dist.get_process_group_ranks(d)))
            if ranks is None or ranks == tuple(sorted(here)):
                common.append(k)
            else:
                if not set(ranks) <= set(here):
                    raise ValueError(
                        f"ds_muon: {names[k]} is tagged with a domain of ranks {list(ranks)}, not all of which are in "
                        f"the optimizer's process_group (ranks {sorted(here)})")
                mine.setdefault(ranks, []).append(k)
        everyone = [None] * world
        dist.all_gather_object(everyone, (len(common), {r: [names[k] for k in ks] for r, ks in mine.items()}),
                               group=group)
        if len({n for n, _ in everyone}) > 1:
            raise ValueError(
                "ds_muon: ranks list different numbers of tensors outside expert domains "
                f"({[n for n, _ in everyone]} by rank); every rank must build the optimizer over the same model")
        blocks: Dict[tuple, List[str]] = {}
        for r, (_, doms) in enumerate(everyone):
            for ranks, dnames in doms.items():
                if here[r] not in ranks:
                    raise ValueError(f"ds_muon: rank {here[r]} tags {dnames[0]} with a domain it is not in {list(ranks)}")
                if ranks in blocks and len(blocks[ranks]) != len(dnames):
                    raise ValueError(
                        f"ds_muon: the ranks of domain {list(ranks)} list different numbers of tensors in it "
                        f"({len(blocks[ranks])} and {len(dnames)}, e.g. {dnames[0]}); replicas of an expert must "
                        "hold the same tensors")
                blocks.setdefault(ranks, dnames)
        rows = [0] * len(items)
        for j, k in enumerate(common):
            rows[k] = j
        row_names = [names[k] for k in common]
        for ranks in sorted(blocks):
            for j, k in enumerate(mine.get(ranks, [])):
                rows[k] = len(row_names) + j
            row_names.extend(f"{n} (domain of ranks {list(ranks)})" for n in blocks[ranks])
        out = (rows, len(row_names), row_names)
        self._agreement[key] = out
        return out

    def _adamw(self, group: dict, params: List[torch.Tensor]) -> None:
        params = self._skip_empty(params)
        if not params:
            return
        st = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        functional_adamw(
            [_local(p) for p in params], [_local(p.grad) for p in params], [_local(s["exp_avg"]) for s in st],
            [_local(s["exp_avg_sq"]) for s in st], [], [s["step"] for s in st], foreach=group.get("foreach"),
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False,
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
        ``adam_weight_decay`` (default 0).  One step count per tensor, shared by its slices.
        """
        views = ([], [], [], [], [])
        for p in self._skip_empty([p for p in params if self._bindings[id(p)].adam_ranges]):
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
        functional_adamw(
            views[0], views[1], views[2], views[3], [], views[4], foreach=group.get("foreach"), amsgrad=False,
            beta1=beta1, beta2=beta2, lr=group.get("adam_lr", DEFAULT_ADAM_LR),
            weight_decay=group.get("adam_weight_decay", 0.0), eps=group.get("adam_eps", self.adam_eps),
            maximize=False,
        )

    def _muon(self, active: set) -> None:
        group_of = self._muon_groups()
        work = []  # (layout, active matrix indices)
        for layout in self._layouts:
            todo = [i for i, (b, _) in enumerate(layout.local) if id(b.param) in active]
            if todo:
                work.append((layout, todo))
        if not work:
            self._drain_early()
            return
        # every domain's (and wave's) exchange is issued before any is waited on
        defer = self._deferred is not None and self.binder is None
        for layout, ex, pending in self._orthogonalize_all(work, group_of):
            apply = self._applier(layout, ex, pending, group_of)
            if defer:
                params = list({id(layout.local[i][0].param): layout.local[i][0].param for i in ex.active}.values())
                self._deferred.add([id(q) for q in params], apply, params)
            else:
                apply()
        if self._dispatch is not None and self.binder is None:
            self._arm(work)

    def _wave_inputs(self, layout: Layout, ex: Exchange, commit: bool = True, group_of=None):
        """This rank's pieces of one wave's Muon inputs: weight decay (L2), momentum, Nesterov.

        With ``commit=False`` (a dispatch from backward) the momentum buffers are left
        alone and ``(buffer slice, new value)`` pairs are returned for :meth:`step` to
        commit once the gradients are known to be good.  Returns ``(pieces, commits)``.
        """
        pieces: Dict[int, torch.Tensor] = {}
        commits = []
        group_of = group_of or self._muon_groups()
        for i in ex.active:
            b, slot = layout.local[i]
            if slot.piece is None or slot.piece.numel == 0:
                continue
            p = b.param
            g = group_of[id(p)]
            sl = slice(slot.local_offset, slot.local_offset + slot.piece.numel)
            buf = b.flat(self.state[p]["momentum_buffer"])[sl]
            pieces[i], new = ns_input(b.flat(p.grad)[sl], buf, b.flat(p)[sl], g, commit)
            if not commit:
                commits.append((buf, new))
        return pieces, commits

    def _muon_groups(self) -> Dict[int, dict]:
        """Each Muon tensor's param group, by id (looked up afresh: load_state_dict replaces groups)."""
        return {id(p): g for g in self.param_groups if g["use_muon"] for p in g["params"]}

    def _hyper(self, param_ids) -> tuple:
        """The settings a wave's inputs depend on (besides gradients and parameters)."""
        group_of = self._muon_groups()
        keys = ("momentum", "nesterov", "weight_decay", "weight_decay_mode")
        # a tensor no longer in a Muon group reads as None: the early dispatch is stale, not an error
        return tuple(tuple(group_of[i][k] for k in keys) if i in group_of else None for i in sorted(param_ids))

    def _arm(self, work) -> None:
        """Hook the waves of this step's exchanges whose gradients are final in backward:
        FSDP2 parameters, and any parameter in a single process."""
        if self._final_grads is None or self._final_grads[0] != self._binding_sig:
            self._final_grads = (self._binding_sig, final_grad_params(self.model))
        final = self._final_grads[1]
        single = self._agreement_group()[1] == 1
        waves = []
        for layout, todo in work:
            key = self._exchange_key(layout, todo)
            params = {id(layout.local[i][0].param): layout.local[i][0].param for i in todo}
            if not single and not all(pid in final for pid in params):
                continue
            for ex, _ in self._exchanges[key]:
                ps = {id(layout.local[i][0].param): layout.local[i][0].param for i in ex.active}
                waves.append(Wave(key, layout, ex, ps))
        self._dispatch.arm(waves)

    def _land(self, param_ids: set) -> None:
        """Apply any update of the previous step still deferred on these parameters."""
        if self._deferred is not None:
            self._deferred.apply_for(param_ids)

    def _drain_early(self) -> None:
        if getattr(self, "_dispatch", None) is not None:
            self._dispatch.drain()

    def _applier(self, layout: Layout, ex: Exchange, pending, group_of) -> Callable[[], None]:
        """Finish one exchange's scatter and apply its results in place.  Learning rates and
        decay are read now, at step time, so a scheduler stepping before a deferred apply
        cannot change this step's update."""
        updates = []
        for i in ex.active:
            b, slot = layout.local[i]
            if slot.piece is None or slot.piece.numel == 0:
                continue
            decay, alpha = apply_coefficients(group_of[id(b.param)], slot.matrix_shape, slot.transposed)
            updates.append((i, b, slot, decay, alpha))

        @torch.no_grad()  # may run later, from a forward pre-hook
        def apply():
            results = ex.scatter_finish(pending)
            for i, b, slot, decay, alpha in updates:
                param = b.flat(b.param)[slot.local_offset:slot.local_offset + slot.piece.numel]
                apply_result(param, results[i], decay, alpha)

        return apply

    def _orthogonalize_all(self, work, group_of) -> List[tuple]:
        """Exchange in, NS at home (batched by shape and settings), exchange out, for every
        layout (domain) and wave at once: all gathers are issued before the first wait, NS
        runs as each arrives, then its scatter is issued.  Returns ``(layout, exchange,
        pending scatter)`` per exchange; the caller finishes and applies them."""
        jobs = []  # (layout, exchange, ns settings)
        for layout, todo in work:
            key = self._exchange_key(layout, todo)
            if key not in self._exchanges:
                self._exchanges[key] = self._compile(layout, todo, group_of)
            jobs.extend((layout, ex, ns_of) for ex, ns_of in self._exchanges[key])
        # gathers a backward hook already issued (momentum committed now), then the rest
        early = self._dispatch.claim([ex for _, ex, _ in jobs]) if self._dispatch is not None else {}
        pending = [early[id(ex)] if id(ex) in early else ex.gather_start(self._wave_inputs(layout, ex, group_of=group_of)[0])
                   for layout, ex, _ in jobs]
        out = []
        for (layout, ex, ns_of), p in zip(jobs, pending):
            stacks = ex.gather_finish(p)
            res = {}
            for skey, stack in stacks.items():
                steps, coeffs, dtype, eps, method = ns_of[skey]
                res[skey] = newton_schulz(stack, steps, coeffs, dtype, eps, method).contiguous()
            out.append((layout, ex, ex.scatter_start(res)))
        return out

    def flush(self) -> None:
        """Apply every update still waiting for a forward (``overlap=True``); a no-op otherwise."""
        if getattr(self, "_deferred", None) is not None:
            self._deferred.flush()

    def state_dict(self):
        self.flush()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        """torch's load, after checking that the saved groups match these (same
        algorithm, same tensor names) and hold valid settings; older ds_muon state dicts
        are brought up to date (see :meth:`_upgrade_groups`)."""
        check_loaded_groups(self.param_groups, state_dict["param_groups"], self.defaults, self.adam_betas, self.adam_eps)
        self.flush()
        self._drain_early()  # their momentum was computed from the state being replaced
        super().load_state_dict(state_dict)

    def _exchange_key(self, layout: Layout, todo: List[int]) -> tuple:
        """What a compiled exchange depends on: the layout, its active matrices, and the NS
        settings of every Muon group (they pick dtypes and stacks, and may change between steps)."""
        ns = tuple((g["ns_steps"], repr(g["ns_coefficients"]), str(g["ns_dtype"]), g["eps"], g["ns_method"])
                   for g in self.param_groups if g["use_muon"])
        return id(layout), tuple(todo), ns

    def _compile(self, layout: Layout, todo: List[int], group_of):
        """Plan homes and build one Exchange per (gather, scatter) dtype pair."""
        by_dtypes: Dict[tuple, List[int]] = {}
        stack_key: Dict[int, Hashable] = {}
        ns_of: Dict[Hashable, tuple] = {}
        device = None
        for i in todo:
            b, _ = layout.local[i]
            g = group_of[id(b.param)]
            info = layout.matrices[i]
            ns_dtype = compute_dtype(g["ns_method"], as_dtype(g["ns_dtype"], "ns_dtype"))  # stored by name
            mom_dtype = b.flat(b.param).dtype
            device = b.flat(b.param).device
            if self.comm_dtype is not None:
                dts = (self.comm_dtype, self.comm_dtype)
            else:  # lossless: NS casts its input to this dtype first anyway
                first = input_dtype(ns_dtype)
                dts = (first if first.itemsize <= mom_dtype.itemsize else mom_dtype, ns_dtype)
            by_dtypes.setdefault(dts, []).append(i)
            coeffs, _ = resolve_coefficients(g["ns_coefficients"], g["ns_steps"])
            skey = (info.rows, info.cols, g["ns_steps"], coeffs, ns_dtype, g["eps"], g["ns_method"])
            stack_key[i] = skey
            ns_of[skey] = (g["ns_steps"], g["ns_coefficients"], ns_dtype, g["eps"], g["ns_method"])
        compiled = []
        for (gdt, sdt), idx in by_dtypes.items():
            if self.mode == "duplicated":
                homes = {i: tuple(range(layout.world_size)) for i in idx}
            else:
                tasks = [
                    MatrixTask(layout.matrices[i].rows, layout.matrices[i].cols,
                               group_of[id(layout.local[i][0].param)]["ns_steps"], gdt.itemsize,
                               tuple(layout.matrices[i].held_numel(r) for r in range(layout.world_size)),
                               group_of[id(layout.local[i][0].param)]["ns_method"])
                    for i in idx
                ]
                plan = plan_homes(tasks, layout.world_size, self.planner, self.cost_model)
                homes = {i: (h,) for i, h in zip(idx, plan.homes)}
            for wave in _split_waves(idx, layout, self.waves):
                compiled.append((Exchange(layout, wave, homes, stack_key, gdt, sdt, device), ns_of))
        return compiled

    # -- introspection --------------------------------------------------------
    def exchanges(self) -> List[Exchange]:
        """The compiled exchanges (for reports and tests)."""
        return [ex for lst in self._exchanges.values() for ex, _ in lst]


def _split_waves(idx: List[int], layout: Layout, waves: int) -> List[List[int]]:
    """Contiguous runs of the matrices in model order with about equal NS work each, so
    early waves hold the parameters the next forward needs first."""
    if waves <= 1 or len(idx) <= 1:
        return [list(idx)]
    cost = [ns_flops(layout.matrices[i].rows, layout.matrices[i].cols, 5) for i in idx]
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


def _unbound_message(name: str, p: torch.Tensor) -> str:
    """A 1-D tensor in a Muon group that no integration described: a stack swapped it in."""
    from .integrations.deepspeed import HOW_TO_BIND

    return (
        f"ds_muon: a Muon group holds a 1-D tensor of {p.numel()} elements where {name} was: a training stack "
        "replaced the parameters with flat partitions ds_muon was not told about, and running Muon on them would "
        "orthogonalize the wrong thing. With DeepSpeed: " + HOW_TO_BIND
    )


def _is_replica(p: torch.Tensor) -> bool:
    """Does every rank of the agreement group hold all of ``p`` (no wrapper, DDP, DeepSpeed stage 0)?

    Shards (DTensors, FSDP1 flat parameters and views, ZeRO partitions) and
    tensor-parallel pieces differ between ranks by design."""
    from .tagging import TENSOR_PARALLEL

    return not (_is_sharded_container(p) or hasattr(p, "placements")
                or getattr(p, TENSOR_PARALLEL, None) is not None)


def _fsdp1_view(p: torch.Tensor) -> bool:
    """An original parameter FSDP1 (use_orig_params=True) flattened into a FlatParameter."""
    return getattr(p, "_fsdp_flattened", False) and not hasattr(p, "_fqns")


def _relaid_like(buf: torch.Tensor, p: torch.Tensor, binding: Optional[ParamBinding]) -> torch.Tensor:
    """``buf`` copied into ``p``'s memory layout (a channels_last weight's momentum saved
    from a contiguous model), so the binding's flat view of it is a view: the momentum
    update is written through it and must land in the state."""
    if buf.shape != p.shape or _local(p) is not p:
        return buf
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


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (no collective); any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def _placement_sig(p: torch.Tensor):
    placements = getattr(p, "placements", None)
    return (tuple(str(x) for x in placements), tuple(p.shape)) if placements is not None else tuple(p.shape)


def _mesh_group(param_groups) -> Optional[dist.ProcessGroup]:
    """With ``process_group=None``: the group spanning the device mesh of the DTensor parameters, None
    (the world) when they span the world or there are none.  Raises when it cannot be named here."""
    meshes = {}
    for g in param_groups:
        for p in g["params"]:
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                meshes.setdefault(tuple(mesh.mesh.flatten().tolist()), mesh)
    if not meshes:
        return None
    if len(meshes) > 1:
        raise ValueError(
            f"ds_muon: the DTensor parameters live on {len(meshes)} device meshes with different ranks "
            f"({sorted(meshes)[:2]} ...); pass Muon(..., process_group=) the group spanning all of them")
    ranks, mesh = next(iter(meshes.items()))
    if sorted(ranks) == list(range(dist.get_world_size())):
        return None
    if mesh.ndim == 1:
        return mesh.get_group()
    raise ValueError(
        f"ds_muon: the DTensor parameters live on a {mesh.ndim}-D device mesh over ranks {sorted(ranks)}, not the "
        "whole world; pass Muon(..., process_group=) a process group spanning exactly those ranks (one that every "
        "rank of the mesh created with torch.distributed.new_group)")


def _group_key(group):
    return None if group is None else id(group)


def _comm_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
