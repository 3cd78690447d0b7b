"""A seeded generator of small models, optimizer settings and stacks, for differential tests.

Every case is a pure function of ``(seed, index, stack, world)``: each spawned rank and the
single-process reference regenerate the same case from those numbers, so nothing but the
results has to cross a process boundary.  ``draw_case`` is the one entry point;
``tests/test_fuzz.py`` runs the cases (``tests/fuzz_stacks.py`` wraps them in each stack).

The models are *gradient probes*: every leaf module is a subclass of the torch module it
stands for (so ``ds_muon.muon_param_groups`` reads it as what it is), and its forward returns
``sum(param * G)`` for gradients ``G`` passed in as the input.  The gradient of every tensor is
then exactly the drawn ``G`` (or the sum of two for a tied weight), on a grid of multiples of
12 * 2^-11 in [-1, 1]: sums, and divisions by 2, 3 or 4 before or after them (DDP divides each
rank's gradient by the world size first), are exact in fp32, so every stack's
reduced gradient is bitwise the one-process gradient at every world size, uneven shards
included, and any difference after a step is the optimizer's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

import ds_muon

GRID = 12 * 2.0 ** -11  # gradient values are k * GRID in [-1, 1]: exact in sums of a few and divided by 2, 3, 4


# -- probe modules ---------------------------------------------------------------------------
def _probe(module: nn.Module, grads: Dict[str, torch.Tensor]) -> torch.Tensor:
    """sum(param * G) over the module's own parameters (G looked up by ``module.usage``)."""
    total = None
    for pname in module.probe_names:  # names, not named_parameters(): FSDP1 swaps them for plain views
        term = (getattr(module, pname) * grads[f"{module.usage}.{pname}"]).sum()
        total = term if total is None else total + term
    if total is None:  # a module whose tensors were all tied away (cannot happen today)
        raise AssertionError(f"{module.usage}: no parameters")
    return total


class ProbeLinear(nn.Linear):
    def forward(self, grads):
        return _probe(self, grads)


class ProbeConv2d(nn.Conv2d):
    def forward(self, grads):
        return _probe(self, grads)


class ProbeEmbedding(nn.Embedding):
    def forward(self, grads):
        return _probe(self, grads)


class ProbeLayerNorm(nn.LayerNorm):
    def forward(self, grads):
        return _probe(self, grads)


class ProbeExperts(nn.Module):
    """A fused ``[E, out, in]`` expert stack, tagged :func:`ds_muon.expert_weight` (re-tag after a
    stack swaps the tensor: :func:`tag_experts`)."""

    def __init__(self, experts: int, out: int, inp: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out, inp))
        ds_muon.expert_weight(self.weight)

    def forward(self, grads):
        return _probe(self, grads)


class FuzzUnit(nn.Module):
    """One block of a fuzz model (an FSDP unit when the stack wraps it): its leaves in order."""

    def __init__(self, leaves: List[Tuple[str, nn.Module]]):
        super().__init__()
        self.order = [name for name, _ in leaves]
        for name, leaf in leaves:
            setattr(self, name, leaf)

    def forward(self, grads):
        total = None
        for name in self.order:
            leaf = getattr(self, name)
            if f"{leaf.usage}.{leaf.probe_names[0]}" not in grads:  # absent this step (Case.absent)
                continue
            term = leaf(grads)
            total = term if total is None else total + term
        return total


class FuzzNet(nn.Module):
    """Units in order; the loss is the sum of their probes (a scalar, for any stack's backward)."""

    def __init__(self, units: List[FuzzUnit]):
        super().__init__()
        self.units = nn.ModuleList(units)

    def forward(self, grads):
        total = None
        for unit in self.units:
            term = unit(grads)
            if term is not None:
                total = term if total is None else total + term
        return total


# -- what a model is made of ------------------------------------------------------------------
@dataclass(frozen=True)
class Leaf:
    """One leaf module.  ``kind``: linear | tied (two Linears sharing one weight) | conv |
    experts | norm | embed | head (a Linear named ``lm_head``).  ``dims``: (out, in) for
    linear/tied/head, (out, in, k) for conv, (E, out, in) for experts, (d,) for norm,
    (vocab, d) for embed."""

    kind: str
    dims: Tuple[int, ...]
    bias: bool = False
    frozen: bool = False

    def describe(self) -> str:
        flags = ("+bias" if self.bias else "") + (" frozen" if self.frozen else "")
        return f"{self.kind}{list(self.dims)}{flags}"


@dataclass(frozen=True)
class ModelSpec:
    units: Tuple[Tuple[Leaf, ...], ...]

    def describe(self) -> str:
        return " | ".join(", ".join(leaf.describe() for leaf in unit) for unit in self.units)


def _leaf_modules(leaf: Leaf, name: str) -> List[Tuple[str, nn.Module]]:
    k, d = leaf.kind, leaf.dims
    if k in ("linear", "head"):
        mods = [(name if k == "linear" else "lm_head", ProbeLinear(d[1], d[0], bias=leaf.bias))]
    elif k == "tied":
        a, b = ProbeLinear(d[1], d[0], bias=leaf.bias), ProbeLinear(d[1], d[0], bias=False)
        b.weight = a.weight
        mods = [(name, a), (name + "_tied", b)]
    elif k == "conv":
        mods = [(name, ProbeConv2d(d[1], d[0], d[2], bias=leaf.bias))]
    elif k == "experts":
        mods = [(name, ProbeExperts(*d))]
    elif k == "norm":
        mods = [(name, ProbeLayerNorm(d[0]))]
    elif k == "embed":
        mods = [(name, ProbeEmbedding(*d))]
    else:
        raise ValueError(f"unknown leaf kind {k!r}")
    if leaf.frozen:
        for _, m in mods:
            for p in m.parameters(recurse=False):
                p.requires_grad_(False)
    return mods


def build_model(spec: ModelSpec, seed: int) -> FuzzNet:
    """The model of ``spec`` with parameters drawn from ``seed`` (the same on every rank)."""
    units = []
    for ui, leaves in enumerate(spec.units):
        mods = []
        for li, leaf in enumerate(leaves):
            mods += _leaf_modules(leaf, f"l{li}")
        unit = FuzzUnit(mods)
        for name, m in mods:
            m.usage = f"units.{ui}.{name}"
            m.probe_names = [pname for pname, _ in m.named_parameters(recurse=False)]
        units.append(unit)
    model = FuzzNet(units)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():  # named_parameters drops the tied duplicate
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def tag_experts(model: nn.Module) -> None:
    """Tag every expert stack again (a stack that swaps parameters, FSDP2, drops the tag)."""
    for m in model.modules():
        if isinstance(m, ProbeExperts):
            ds_muon.expert_weight(m.weight)


def usages(model: nn.Module) -> Dict[str, Tuple[int, ...]]:
    """Every gradient key the model's forward reads, with its shape (sorted by key); read
    from the unwrapped model (shapes as built)."""
    out = {}
    for m in model.modules():
        usage = getattr(m, "usage", None)
        if usage is not None:
            for pname, p in m.named_parameters(recurse=False):
                out[f"{usage}.{pname}"] = tuple(p.shape)
    return dict(sorted(out.items()))


def step_grads(shapes: Dict[str, Tuple[int, ...]], seed: int, step: int) -> Dict[str, torch.Tensor]:
    """The forward's input at ``step``: one gradient per usage, on the exact grid (see module doc)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    limit = int(1 / GRID)  # 170
    return {k: torch.randint(-limit, limit + 1, s, generator=g).float() * GRID for k, s in shapes.items()}


# -- settings -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """Everything a case passes to :class:`ds_muon.Muon` and to its param groups.  ``muon`` are the
    maths (the reference gets them too); ``equivalent`` are settings that must not change the
    result (overlap, waves, mode, planner): the reference runs without them."""

    muon: Tuple[Tuple[str, object], ...]
    equivalent: Tuple[Tuple[str, object], ...]
    lr: float
    adam_lr: float
    weight_decay: float
    adam_weight_decay: float

    def muon_kwargs(self, reference: bool = False) -> dict:
        kw = dict(self.muon)
        if not reference:
            kw.update(self.equivalent)
        return kw

    def group_kwargs(self) -> dict:
        return dict(lr=self.lr, adam_lr=self.adam_lr, weight_decay=self.weight_decay,
                    adam_weight_decay=self.adam_weight_decay)

    def describe(self) -> str:
        parts = [f"{k}={v!r}" for k, v in self.muon + self.equivalent]
        parts += [f"{k}={v!r}" for k, v in self.group_kwargs().items()]
        return ", ".join(parts)


@dataclass(frozen=True)
class Stack:
    """``kind``: single | ddp | fsdp2 | fsdp1 | zero.  ``options``: fsdp2 (which units get their own
    ``fully_shard``, reshard_after_forward), fsdp1 (use_orig_params, nested), zero (stage)."""

    kind: str
    world: int
    options: Tuple[Tuple[str, object], ...] = ()

    def option(self, key, default=None):
        return dict(self.options).get(key, default)

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options)
        return f"{self.kind} W={self.world}" + (f" ({opts})" if opts else "")


@dataclass(frozen=True)
class Case:
    seed: int
    index: int
    model: ModelSpec
    settings: Settings
    stack: Stack
    steps: int = 3
    roundtrip_after: int = 2  # opt.load_state_dict(deepcopy(opt.state_dict())) after this many steps
    notes: Tuple[str, ...] = field(default=())
    # a second Muon group: every other Muon tensor moves there, with these settings
    second_group: Tuple[Tuple[str, object], ...] = ()
    # (step, unit): that unit is not run at that step, so its tensors have no gradient (on every rank)
    absent: Tuple[Tuple[int, int], ...] = ()

    def grads(self, shapes: Dict[str, Tuple[int, ...]], step: int) -> Dict[str, torch.Tensor]:
        """The forward's input at ``step`` (absent units left out)."""
        gone = tuple(f"units.{u}." for t, u in self.absent if t == step)
        return {k: v for k, v in step_grads(shapes, self.model_seed, step).items() if not k.startswith(gone)}

    @property
    def model_seed(self) -> int:
        return self.seed * 7919 + self.index

    def describe(self) -> str:
        extra = "".join(f"\n  {k}: {v}" for k, v in (("second Muon group", dict(self.second_group)),
                                                        ("absent (step, unit)", self.absent),
                                                        ("notes", self.notes)) if v)
        return (f"case {self.index} (seed {self.seed}) on {self.stack.describe()}\n"
                f"  model: {self.model.describe()}\n  settings: {self.settings.describe()}{extra}")


# -- drawing --------------------------------------------------------------------------------------
SIZES = (0, 1, 2, 3, 4, 5, 7, 8, 12, 16, 17, 24, 33)


def _size(rng: random.Random, low: int = 0) -> int:
    return rng.choice([s for s in SIZES if s >= low])


def _matrix(rng: random.Random, low: int = 0) -> Tuple[int, int]:
    shape = rng.choice(("square", "tall", "wide", "any"))
    a, b = _size(rng, low), _size(rng, low)
    if shape == "square":
        return a, a
    if shape == "tall":
        return max(a, b), min(a, b)
    if shape == "wide":
        return min(a, b), max(a, b)
    return a, b


def draw_leaf(rng: random.Random, stack: Stack) -> Leaf:
    kinds = ["linear"] * 5 + ["tied", "conv", "experts", "norm", "embed", "head"]
    kind = rng.choice(kinds)
    frozen = rng.random() < 0.1
    if kind in ("linear", "tied", "head"):
        return Leaf(kind, _matrix(rng), bias=rng.random() < 0.4, frozen=frozen and kind == "linear")
    if kind == "conv":
        return Leaf(kind, (_size(rng, 1), rng.choice((1, 2, 3)), rng.choice((1, 2, 3))), bias=rng.random() < 0.3)
    if kind == "experts":
        return Leaf(kind, (rng.choice((1, 2, 3)),) + _matrix(rng, 1))
    if kind == "norm":
        return Leaf(kind, (_size(rng, 1),))
    return Leaf(kind, (_size(rng, 1), _size(rng, 1)))


def draw_model(rng: random.Random, stack: Stack) -> ModelSpec:
    units = []
    for _ in range(rng.randint(1, 4)):
        units.append(tuple(draw_leaf(rng, stack) for _ in range(rng.randint(1, 3))))
    # at least one trainable Muon matrix, so the case steps Muon (muon_param_groups refuses otherwise)
    units[0] = units[0] + (Leaf("linear", _matrix(rng, 1)),)
    return ModelSpec(tuple(units))


COEFFICIENTS = ("keller", "quintic", "polar_express", "triple", "triples")
# triples drawn singly or as schedules: published ones that keep the iteration bounded (a random
# triple, or a schedule's middle triple first, diverges to inf/NaN).  No c = 0
# triple (cubic): torch 2.13's CPU baddbmm(alpha=0) is wrong in bf16 from ~31x31 up — issue 25's
# c = 0 guard, the kernels engineer's; add (1.5, -0.5, 0.0) here once it has landed.
# Any 6 of these in any order keep singular values in [0, 1] below 1.25; Quintic's first triple
# (peak 1.27) then Keller's (repelling fixed point near 1.25) diverges.
TRIPLES = ((3.4445, -4.7750, 2.0315), (3.7418, -5.5913, 2.3037), (2.8366, -3.0525, 1.2012), (1.875, -1.25, 0.375))


def draw_settings(rng: random.Random, stack: Stack) -> Settings:
    from ds_muon.engine.agreement.settings import WEIGHT_DECAY_MODES
    from ds_muon.rules.newton_schulz import NS_METHODS
    from ds_muon.engine.plan.planner import STRATEGIES
    from ds_muon.rules.scaling import SCALE_MODES

    coeff = rng.choice(COEFFICIENTS)
    if coeff == "triple":
        coeff = rng.choice(TRIPLES)
    elif coeff == "triples":
        coeff = [rng.choice(TRIPLES) for _ in range(rng.randint(1, 3))]
    muon = dict(
        momentum=rng.choice((0.0, 0.5, 0.9, 0.95)),
        nesterov=rng.random() < 0.6,
        weight_decay_mode=rng.choice(WEIGHT_DECAY_MODES),
        ns_steps=rng.randint(1, 6),
        ns_coefficients=coeff,
        ns_method=rng.choice(NS_METHODS),
        ns_dtype=rng.choice((torch.float32, torch.bfloat16)),
        scale_mode=rng.choice(SCALE_MODES),
        extra_scale_factor=rng.choice((1.0, 1.0, 0.2)),
        adam_betas=rng.choice(((0.9, 0.95), (0.8, 0.99))),
        adam_eps=rng.choice((1e-8, 1e-6)),
        variant=rng.choice(("muon", "muon", "normuon")),  # the rules of issue 28: NorMuon's row moment
        normuon_beta2=rng.choice((0.95, 0.5)),
    )
    if muon["ns_method"] == "gram" and muon["ns_dtype"] == torch.bfloat16:
        # EXCLUDED (NS kernels, not fixed here): the Gram iteration asked for in bf16 (it runs in fp16)
        # rounds a matrix differently with the other matrices of its batch, e.g.
        # newton_schulz(G[3, 16, 33], method="gram") != cat(newton_schulz(G[:1]), newton_schulz(G[1:])),
        # so overlap's waves (and homes batching other subsets) change the bits: seed 2 case 2 of
        # test_fuzz_one_process, shrunk to linear[12, 12] | experts[3, 33, 16], overlap waves=3.
        muon["ns_method"] = "standard"
    if stack.kind == "torch":  # torch.optim.Muon's maths (see torch_comparable), the rest still drawn
        muon.update(ns_dtype=torch.bfloat16, ns_method=rng.choice(("standard", "auto")), scale_mode="shape_scaling",
                    extra_scale_factor=1.0, weight_decay_mode="decoupled", variant="muon",
                    ns_coefficients=coeff if isinstance(coeff, tuple) else "keller")
    overlap = rng.random() < 0.4
    equivalent = dict(mode=rng.choice(("sharded", "sharded", "duplicated")), planner=rng.choice(STRATEGIES))
    if overlap:
        equivalent.update(overlap=True, waves=rng.randint(1, 4), dispatch_in_backward=rng.random() < 0.7)
        if stack.kind == "zero":  # DeepSpeed's gradients are final only inside its reduction (a refused setting)
            equivalent["dispatch_in_backward"] = False
    return Settings(
        muon=tuple(muon.items()), equivalent=tuple(equivalent.items()),
        lr=rng.choice((0.02, 0.05)), adam_lr=rng.choice((1e-3, 3e-3)),
        weight_decay=rng.choice((0.0, 0.0, 0.1)), adam_weight_decay=rng.choice((0.0, 0.01)),
    )


def draw_stack(rng: random.Random, kind: str, world: int, units: int) -> Stack:
    if kind == "fsdp2":
        wrapped = tuple(i for i in range(units) if rng.random() < 0.7)
        return Stack(kind, world, (("wrap_units", wrapped), ("reshard_after_forward", rng.random() < 0.7)))
    if kind == "fsdp1":
        return Stack(kind, world, (("use_orig_params", rng.random() < 0.5), ("nested", rng.random() < 0.6)))
    if kind == "zero":
        # no ZeRO-3: DeepSpeed 0.19.8's stage 3 set-up of these models hung (one rank in
        # stage3's defragment, the other at its barrier: seed 0 case 6 at W=2, run alone) and
        # asserted on zero-size tensors; left out until that is understood
        return Stack(kind, world, (("stage", rng.choice((1, 2, 2))),))
    return Stack(kind, world)


def draw_case(seed: int, index: int, kind: str, world: int) -> Case:
    """Case ``index`` of ``seed`` for the stack ``kind`` at ``world`` ranks (deterministic)."""
    rng = random.Random(f"{seed}/{index}/{kind}/{world}")
    plain = Stack(kind, world)
    model = draw_model(rng, plain)
    stack = draw_stack(rng, kind, world, len(model.units))
    settings = draw_settings(rng, stack)
    second = ()
    if rng.random() < 0.3:
        second = (("lr", rng.choice((0.01, 0.03))), ("momentum", rng.choice((0.0, 0.8))),
                  ("nesterov", rng.random() < 0.5), ("ns_steps", rng.randint(1, 6)),
                  ("weight_decay", rng.choice((0.0, 0.05))), ("ns_dtype", rng.choice(("float32", "bfloat16"))))
    if second and dict(settings.muon)["ns_method"] == "gram":
        second = tuple((k, "float32" if k == "ns_dtype" else v) for k, v in second)  # see draw_settings
    absent = ()
    if rng.random() < 0.3:  # never unit 0 (it holds the case's one sure Muon matrix): every step has a loss
        absent = tuple((t, u) for t in range(3) for u in range(1, len(model.units)) if rng.random() < 0.3)
    return fit_to_stack(Case(seed, index, model, settings, stack, second_group=second, absent=absent))


def fit_to_stack(case: Case) -> Case:
    """Combinations a stack refuses by design, made valid (each rule says why)."""
    stack, notes = case.stack, list(case.notes)
    leaves = [leaf for unit in case.model.units for leaf in unit]
    if stack.kind == "fsdp1" and not stack.option("use_orig_params"):
        # a FlatParameter mixes frozen and trainable tensors only with use_orig_params=True (torch's
        # rule); expert_weight tags are invisible through flat parameters (docs/ADVANCED.md, "What
        # each stack supports": muon_param_groups then refuses the 3-D tensor)
        why = [w for w, hit in (("frozen tensors", any(leaf.frozen for leaf in leaves)),
                                ("expert stacks", any(leaf.kind == "experts" for leaf in leaves))) if hit]
        if why:
            stack = replace(stack, options=tuple((k, True if k == "use_orig_params" else v) for k, v in stack.options))
            notes.append("use_orig_params=True: " + ", ".join(why))
    second, absent = case.second_group, case.absent
    if second and stack.kind == "fsdp1" and not stack.option("use_orig_params"):
        second = ()  # a FlatParameter is one tensor of one group: no per-tensor groups
        notes.append("one Muon group: FSDP1 flat parameters")
    if stack.kind == "torch":
        second = ()  # run_torch builds one torch.optim.Muon with the case's settings
    if absent:
        # a tensor without a gradient is None in ds_muon's one-process reference; a stack gives the
        # same only where it owns whole units: FSDP2 units with their own fully_shard, FSDP1's nested
        # units (DDP and ZeRO fill zeros, a different optimizer input by their own design)
        if stack.kind == "fsdp2":
            absent = tuple((t, u) for t, u in absent if u in stack.option("wrap_units", ()))
        elif stack.kind == "fsdp1" and not stack.option("nested"):
            absent = ()
        elif stack.kind not in ("single", "fsdp2", "fsdp1", "torch"):
            absent = ()
    model = case.model
    if stack.kind == "fsdp1" and stack.option("nested"):
        # torch 2.13's FSDP1 asserts while wrapping a unit whose tensors all have zero elements
        # ("unsharded_start_idx: 0 unsharded_end_idx: -1", no ds_muon involved): sizes 0 become 1 there
        units = tuple(tuple(replace(leaf, dims=tuple(d or 1 for d in leaf.dims)) for leaf in unit)
                      if all(0 in leaf.dims for leaf in unit) else unit for unit in model.units)
        if units != model.units:
            model = ModelSpec(units)
            notes.append("no unit of zero-size tensors only: FSDP1 nested")
    if stack.kind in ("fsdp2", "zero") and any(0 in leaf.dims for leaf in leaves):
        # torch 2.13's FSDP2 fails the backward of any fully_shard group holding a zero-element
        # parameter ("_chunk_cat expects non-empty tensor", no ds_muon involved); DeepSpeed
        # 0.19.8's ZeRO-1/2 optimizer raises IndexError while it is built (before ds_muon binds
        # it) when a param group holds only zero-element tensors: sizes 0 become 1 there
        model = ModelSpec(tuple(tuple(replace(leaf, dims=tuple(d or 1 for d in leaf.dims)) for leaf in unit)
                                for unit in model.units))
        notes.append(f"no zero-size tensors: {stack.kind}")
    return replace(case, model=model, stack=stack, notes=tuple(notes), second_group=second, absent=absent)


def torch_comparable(case: Case) -> Optional[str]:
    """Why torch.optim.Muon (+ AdamW) cannot run ``case``'s maths, or None when it can
    (bf16 NS, one coefficient triple, the standard iteration, shape_scaling, decoupled decay)."""
    kw = case.settings.muon_kwargs(reference=True)
    coeff = kw["ns_coefficients"]
    if kw["ns_dtype"] != torch.bfloat16:
        return "torch.optim.Muon runs NS in bf16 only"
    if not (coeff == "keller" or (isinstance(coeff, tuple) and len(coeff) == 3 and not isinstance(coeff[0], tuple))):
        return "torch.optim.Muon takes one coefficient triple"
    if kw["ns_method"] == "gram":
        return "torch.optim.Muon has only the standard iteration"
    if kw["scale_mode"] != "shape_scaling" or kw["extra_scale_factor"] != 1.0:
        return "torch.optim.Muon's adjust_lr_fn='original' is shape_scaling x 1"
    if case.settings.weight_decay and kw["weight_decay_mode"] != "decoupled":
        return "torch.optim.Muon decays decoupled only"
    if kw.get("variant", "muon") != "muon":
        return "torch.optim.Muon has no NorMuon"
    if case.settings.adam_weight_decay and kw["weight_decay_mode"] in ("independent", "cautious"):
        return "torch.optim.AdamW decays decoupled only (ds_muon's AdamW tensors follow the mode)"
    return None
