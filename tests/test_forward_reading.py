"""Generated classes for the model map read from the forward (issue 49), each held to a reference computed
another way:

- **views**: a raw 2-, 3- or 4-D parameter, stored in a drawn layout, turned by a drawn chain of views (slice,
  index, ``flatten``/``unflatten``, ``view``, ``reshape``, ``permute``, ``.T``/``mT``, ``unbind``, ``chunk``)
  into the matrices a drawn op applies (``F.linear``, ``matmul``, ``@``, ``einsum``, ``bmm``).  The reference
  is the same model written with one ``[out, in]`` ``nn.Parameter`` per applied matrix, given the same
  gradients: one step must leave every stored element where the reference's matrix has it (so the decision,
  the orientation through the shape scale and the stack members are the forward's), bitwise.  A seeded sample
  also runs under DDP and FSDP2, ``torch.equal`` to one process.
- **finals**: drawn ops between the last weights and the output (stack, cat, soft-caps, ``where``,
  ``masked_fill``, casts, ``sort``, ``gather``, a custom ``autograd.Function``; list, dict and dataclass
  outputs, several at once, a buffer each head's output is written into): the heads take AdamW and every other matrix Muon, the reference being the final
  layers read from the autograd graph of a real forward (``tools/census.final_layers``).
- **two ways**: the same computation written two ways gets the same decisions.

``DS_MUON_FORWARD_DRAWS=N`` draws N per class (CI: a seeded sample); ``DS_MUON_FORWARD_SEED`` moves the seed.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import warnings
from typing import Callable, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dist_harness
import ds_muon

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))

DRAWS = int(os.environ.get("DS_MUON_FORWARD_DRAWS", "0"))
SEED = int(os.environ.get("DS_MUON_FORWARD_SEED", "0"))
VOCAB, BATCH, TOKENS = 11, 2, 3


@pytest.fixture(autouse=True)
def _one_thread():
    with dist_harness.one_thread():
        yield


# -- the views class ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class ViewCase:
    """A stored parameter, the forward's use of it, and the ``[out, in]`` matrices that use applies."""

    label: str
    in_features: int
    shape: tuple
    apply: Callable  # (P, h) -> y of out_features
    matrices: Callable  # P -> list of [out, in] views of P, in the order ``apply`` concatenates their outputs

    @property
    def out_features(self) -> int:
        return sum(int(m.shape[0]) for m in self.matrices(torch.empty(self.shape)))


def _single(rng: random.Random) -> ViewCase:
    """One matrix ``[O, I]`` (``O = o1·o2``, ``I = i1·i2``) in one of six stored layouts, read by a drawn chain."""
    o1, o2, i1, i2 = (rng.randint(2, 4) for _ in range(4))
    O, I = o1 * o2, i1 * i2
    layouts = {  # stored shape, the [O, I] matrix as a view, and chains that reach it another way
        "[O,I]": ((O, I), lambda P: P, [lambda P: P.view(O, I), lambda P: P.T.T, lambda P: P.reshape(O, -1),
                                        lambda P: P[:, :], lambda P: P.unflatten(0, (o1, o2)).flatten(0, 1)]),
        "[I,O]": ((I, O), lambda P: P.T, [lambda P: P.mT, lambda P: P.transpose(0, 1), lambda P: P.permute(1, 0),
                                          lambda P: P.t()]),
        "[o1,o2,I]": ((o1, o2, I), lambda P: P.flatten(0, 1), [lambda P: P.reshape(O, I), lambda P: P.view(-1, I)]),
        "[O,i1,i2]": ((O, i1, i2), lambda P: P.flatten(1), [lambda P: P.reshape(O, -1), lambda P: P.view(O, I)]),
        "[i1,i2,O]": ((i1, i2, O), lambda P: P.flatten(0, 1).T, [lambda P: P.reshape(I, O).t(),
                                                                  lambda P: P.view(I, O).mT]),
        "[I,o1,o2]": ((I, o1, o2), lambda P: P.flatten(1).T, [lambda P: P.reshape(I, O).T]),
    }
    einsums = {  # the same maps as one equation on the stored tensor, no view first
        "[o1,o2,I]": lambda P, h: torch.einsum("bti,xyi->btxy", h, P).flatten(-2),
        "[O,i1,i2]": lambda P, h: torch.einsum("btxy,oxy->bto", h.unflatten(-1, (i1, i2)), P),
        "[i1,i2,O]": lambda P, h: torch.einsum("btxy,xyo->bto", h.unflatten(-1, (i1, i2)), P),
        "[I,o1,o2]": lambda P, h: torch.einsum("bti,ixy->btxy", h, P).flatten(-2),
        "[I,O]": lambda P, h: torch.einsum("bti,io->bto", h, P),
        "[O,I]": lambda P, h: torch.einsum("bti,oi->bto", h, P),
    }
    name = rng.choice(sorted(layouts))
    shape, canonical, chains = layouts[name]
    chain = rng.choice([canonical] + chains)
    ops = {
        "linear": lambda W, h: F.linear(h, W),
        "matmul": lambda W, h: torch.matmul(h, W.T),
        "@": lambda W, h: h @ W.mT,
        "rmatmul": lambda W, h: (W @ h.mT).mT,
        "einsum(oi)": lambda W, h: torch.einsum("bti,oi->bto", h, W),
    }
    op = rng.choice(sorted(ops) + ["einsum(stored)"])
    if op == "einsum(stored)":
        apply = einsums[name]
    else:
        apply = lambda P, h: ops[op](chain(P), h)  # noqa: E731
    return ViewCase(f"{name} {op}", I, shape, apply, lambda P: [canonical(P)])


def _members(rng: random.Random) -> ViewCase:
    """A stack ``[K, O, I]`` (or ``[K, I, O]``) whose members the forward applies one by one or some flattened
    together (modded-nanogpt's ``qkvo_w[:3].flatten(end_dim=1)`` and ``qkvo_w[3]``)."""
    K, O, I = rng.randint(2, 4), rng.randint(2, 6), rng.randint(2, 6)
    while O == I:
        I = rng.randint(2, 6)
    stored_in_out = rng.random() < 0.5
    shape = (K, I, O) if stored_in_out else (K, O, I)
    member = (lambda P, k: P[k].T) if stored_in_out else (lambda P, k: P[k])

    def pieces(P):  # drawn once per case: how the forward cuts the stack into members
        return {
            "select": lambda: [P[k] for k in range(K)],
            "unbind": lambda: list(P.unbind(0)),
            "chunk": lambda: [c.squeeze(0) for c in P.chunk(K, dim=0)],
            "narrow": lambda: [P.narrow(0, k, 1)[0] for k in range(K)],
        }

    how = rng.choice(["select", "unbind", "chunk", "narrow", "flatten-head"])
    if how == "flatten-head" and not stored_in_out:
        def apply(P, h):
            return torch.cat([F.linear(h, P[:K - 1].flatten(end_dim=1)), F.linear(h, P[K - 1])], dim=-1)
    elif how == "flatten-head":
        how = "bmm"

        def apply(P, h):  # every member at once: a batched product over the stack
            x = h.reshape(1, -1, I).expand(K, -1, -1)
            return torch.bmm(x, P).permute(1, 0, 2).reshape(*h.shape[:-1], K * O)
    else:
        def apply(P, h):
            ms = pieces(P)[how]()
            return torch.cat([h @ m if stored_in_out else F.linear(h, m) for m in ms], dim=-1)
    layout = "[K,I,O]" if stored_in_out else "[K,O,I]"
    return ViewCase(f"{layout} {how}", I, shape, apply, lambda P: [member(P, k) for k in range(K)])


def draw_view_case(seed: int) -> ViewCase:
    rng = random.Random(seed)
    return (_single if rng.random() < 0.6 else _members)(rng)


class Raw(nn.Module):
    """The parameter as stored, applied through the case's views."""

    def __init__(self, case: ViewCase):
        super().__init__()
        self.case = case
        self.embed = nn.Embedding(VOCAB, case.in_features)
        self.w = nn.Parameter(torch.randn(case.shape) / case.in_features ** 0.5)
        self.head = nn.Linear(case.out_features, VOCAB)

    def forward(self, idx):
        return self.head(self.case.apply(self.w, self.embed(idx)))


class Written(nn.Module):
    """The reference: each matrix the forward applies, its own ``[out, in]`` parameter through ``F.linear``."""

    def __init__(self, case: ViewCase, raw: Raw):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, case.in_features)
        self.mats = nn.ParameterList([nn.Parameter(m.detach().clone().contiguous()) for m in case.matrices(raw.w)])
        self.head = nn.Linear(case.out_features, VOCAB)
        self.embed.load_state_dict(raw.embed.state_dict())
        self.head.load_state_dict(raw.head.state_dict())

    def forward(self, idx):
        h = self.embed(idx)
        return self.head(torch.cat([F.linear(h, m) for m in self.mats], dim=-1))


def _tokens(seed=1):
    return torch.randint(0, VOCAB, (BATCH, TOKENS), generator=torch.Generator().manual_seed(seed))


def _muon(model, ns_dtype=torch.float32):
    groups = ds_muon.muon_param_groups(model, example_inputs=(_tokens(),), lr=0.05, adam_lr=0.01)
    return ds_muon.Muon(groups, ns_dtype=ns_dtype, log_summary=False), groups


def _decision(groups, name):
    for g in groups:
        for n, reason in zip(g["param_names"], g["param_reasons"]):
            if n == name:
                return g["use_muon"], reason
    raise KeyError(name)


def check_view_case(seed: int) -> str:
    """'' where the raw model's step equals the written reference's, else what differs."""
    try:
        return _check_view_case(seed)
    except Exception as e:  # noqa: BLE001 - a refusal is a failure of the case, reported with the others
        return f"{draw_view_case(seed).label}: {type(e).__name__}: {str(e)[:200]}"


def _check_view_case(seed: int) -> str:
    case = draw_view_case(seed)
    torch.manual_seed(seed)
    raw = Raw(case)
    ref = Written(case, raw)
    opt_raw, groups = _muon(raw)
    opt_ref, _ = _muon(ref)
    muon, reason = _decision(groups, "w")
    if not muon:
        return f"{case.label}: w on AdamW ({reason})"
    for step in range(2):
        ref.zero_grad()
        F.cross_entropy(ref(_tokens(step)).flatten(0, 1), _tokens(step + 7).flatten()).backward()
        raw.zero_grad()  # the same gradients, each element where the stored tensor has it
        raw.w.grad = torch.zeros_like(raw.w)
        for view, m in zip(case.matrices(raw.w.grad), ref.mats):
            view.copy_(m.grad)
        raw.embed.weight.grad = ref.embed.weight.grad.clone()
        raw.head.weight.grad, raw.head.bias.grad = ref.head.weight.grad.clone(), ref.head.bias.grad.clone()
        opt_raw.step()
        opt_ref.step()
    for k, (view, m) in enumerate(zip(case.matrices(raw.w.detach()), ref.mats)):
        # bitwise where the stored matrix is laid out as the reference's; otherwise the products see the other
        # memory order (last bits), while a wrong orientation or member split moves the shape scale by >= 10%
        exact = view.is_contiguous()
        if not (torch.equal(view, m) if exact else torch.allclose(view, m, rtol=0, atol=1e-4 * float(m.abs().max()))):
            return (f"{case.label}: matrix {k} differs from the written reference by {(view - m).abs().max():.2e}"
                    f" ({'bitwise' if exact else 'to 1e-4 of its max'} expected)")
    return ""


def _seeds(n_ci: int) -> List[int]:
    n = DRAWS or n_ci
    return [SEED * 100_003 + k for k in range(n)]


def test_views_of_raw_parameters_step_as_the_matrices_the_forward_applies():
    failed = [f for f in (check_view_case(s) for s in _seeds(40)) if f]
    print(f"views class: {len(_seeds(40)) - len(failed)} of {len(_seeds(40))} hold")
    assert not failed, "\n".join(failed[:12])


def test_every_layout_and_op_is_drawn():
    """The sample reaches every stored layout and every op (so a layout cannot drop out of CI unseen)."""
    labels = {draw_view_case(s).label for s in _seeds(40)}
    layouts = {lb.split()[0] for lb in labels}
    assert layouts >= {"[O,I]", "[I,O]", "[o1,o2,I]", "[O,i1,i2]", "[i1,i2,O]", "[I,o1,o2]", "[K,O,I]", "[K,I,O]"}, \
        layouts


# -- the views class under DDP and FSDP2 ----------------------------------------------------------------------
def _train_raw(seed: int, stack: str, world: int):
    case = draw_view_case(seed)
    torch.manual_seed(seed)
    model = Raw(case)
    if stack == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
    elif stack == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt, _ = _muon(model)
    for step in range(2):  # every rank the same batch: the reduced gradient is each rank's, exactly
        F.cross_entropy(model(_tokens(step)).flatten(0, 1), _tokens(step + 7).flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    inner = model.module if stack == "ddp" else model
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in inner.named_parameters()}


def _stack_worker(rank, world, seeds):
    return {(s, stack): _train_raw(s, stack, world) for s in seeds for stack in ("ddp", "fsdp2")}


def test_views_class_under_ddp_and_fsdp2_equals_one_process():
    seeds = _seeds(40)
    seeds = seeds[: (DRAWS or 6) if DRAWS < 12 else 12]
    refs = {s: _train_raw(s, "single", 1) for s in seeds}
    for out in dist_harness.run(_stack_worker, 2, seeds, timeout=300):
        for (s, stack), params in out.items():
            for n, ref in refs[s].items():
                assert torch.equal(params[n], ref), (draw_view_case(s).label, stack, n)


# -- the finals class --------------------------------------------------------------------------------------------
class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: torch.Tensor


def _written(ts):
    out = ts[0].new_zeros((len(ts), *ts[0].shape))
    for k, t in enumerate(ts):
        out[k] = t
    return out


def _combine(rng: random.Random):
    """A drawn chain of ops between the heads' outputs and the model's output, and the output container."""
    unary = {
        "softcap-tanh": lambda t: 30 * torch.tanh(t / 30),
        "softcap-sigmoid": lambda t: 30 * torch.sigmoid(t / 7.5),
        "float": lambda t: t.float(),
        "where": lambda t: torch.where(t > 0, t, 0.1 * t),
        "masked_fill": lambda t: t.masked_fill(t > 5, 5.0),
        "sort": lambda t: t.sort(dim=-1).values,
        "gather": lambda t: t.gather(-1, torch.zeros_like(t, dtype=torch.long)),
        "function": _Twice.apply,
        "clone": lambda t: t.clone(),
    }
    joins = {
        "stack": lambda ts: torch.stack(ts, dim=1),
        "cat": lambda ts: torch.cat(ts, dim=-1),
        "list": lambda ts: list(ts),
        "dict": lambda ts: {f"k{i}": t for i, t in enumerate(ts)},
        "dataclass": lambda ts: Out(ts[0], torch.stack(ts[1:] or ts, 0)),
        "tuple+hidden": None,  # the heads' outputs and the last hidden state beside them: several outputs
        "written": _written,  # each head's output written into one buffer (``out[:, k] = head(h)``), returned
    }
    ops = [rng.choice(sorted(unary)) for _ in range(rng.randint(0, 3))]
    join = rng.choice(sorted(joins))
    return ops, join, unary, joins


class Heads(nn.Module):
    """An embedding, hidden Linears, K heads, and drawn ops between the heads and the output."""

    def __init__(self, seed: int):
        super().__init__()
        rng = random.Random(seed)
        d = rng.randint(4, 8)
        self.embed = nn.Embedding(VOCAB, d)
        self.heads = nn.ModuleList(nn.Linear(d, VOCAB) for _ in range(rng.randint(1, 3)))
        self.ops, self.join, self._unary, self._joins = _combine(rng)
        # a hidden matrix stays hidden even where the last hidden state is returned beside the heads
        self.hidden = nn.ModuleList(nn.Linear(d, d) for _ in range(rng.randint(1, 2) + (self.join == "tuple+hidden")))
        self.label = f"{len(self.heads)} heads, {'/'.join(self.ops) or 'no op'}, {self.join}"

    def forward(self, idx):
        h = self.embed(idx)
        for layer in self.hidden:
            h = torch.relu(layer(h))
        outs = [head(h) for head in self.heads]
        for op in self.ops:
            outs = [self._unary[op](t) for t in outs]
        if self.join == "tuple+hidden":
            return (*outs, h)
        return self._joins[self.join](outs)


def check_finals_case(seed: int) -> str:
    import census

    torch.manual_seed(seed)
    model = Heads(seed)
    try:
        groups = ds_muon.muon_param_groups(model, example_inputs=(_tokens(),))
    except ValueError as e:
        return f"{model.label}: {str(e)[:200]}"
    finals, error = census.final_layers(model, ((_tokens(),), {}, None))  # from the autograd graph
    if error:
        return f"{model.label}: the autograd reference failed: {error}"
    wrong = []
    for g in groups:
        for n, p in zip(g["param_names"], g["params"]):
            if p.ndim < 2 or n.startswith("embed"):
                continue
            if g["use_muon"] == (n in finals):
                wrong.append(f"{n} on {'Muon' if g['use_muon'] else 'AdamW'}")
    heads = {f"heads.{k}.weight" for k in range(len(model.heads))}
    if model.join == "tuple+hidden":  # the last hidden state is an output too: its layer is a final one
        heads.add(f"hidden.{len(model.hidden) - 1}.weight")
    if finals != heads:  # the reference itself must see the heads (else the test proves nothing)
        wrong.append(f"autograd finals {sorted(finals)}")
    return f"{model.label}: {', '.join(wrong)}" if wrong else ""


def test_ops_between_the_heads_and_the_output_keep_the_heads_final():
    seeds = _seeds(40)
    failed = [f for f in (check_finals_case(s) for s in seeds) if f]
    print(f"finals class: {len(seeds) - len(failed)} of {len(seeds)} hold")
    assert not failed, "\n".join(failed[:12])


# -- the same computation two ways -------------------------------------------------------------------------------
class PatchConv(nn.Module):
    def __init__(self, c=3, p=2, d=8, n=5):
        super().__init__()
        self.proj = nn.Conv2d(c, d, p, stride=p)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, n)

    def forward(self, x):
        h = self.proj(x).flatten(2).transpose(1, 2)
        return self.head(torch.relu(self.mid(h))).mean(1)


class PatchLinear(nn.Module):
    def __init__(self, c=3, p=2, d=8, n=5):
        super().__init__()
        self.p = p
        self.proj = nn.Linear(c * p * p, d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, n)

    def forward(self, x):
        b, c, hh, ww = x.shape
        p = self.p
        patches = x.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * p * p)
        return self.head(torch.relu(self.mid(self.proj(patches)))).mean(1)


class Obs(nn.Module):
    """An actor-critic trunk: observations in (features, not tokens), a hidden layer, two heads."""

    def __init__(self, raw: bool):
        super().__init__()
        self.raw = raw
        if raw:
            self.w_in = nn.Parameter(torch.randn(16, 6))
        else:
            self.inp = nn.Linear(6, 16, bias=False)
        self.mid = nn.Linear(16, 16)
        self.pi, self.v = nn.Linear(16, 4), nn.Linear(16, 1)

    def forward(self, obs):
        h = torch.tanh(F.linear(obs, self.w_in) if self.raw else self.inp(obs))
        h = torch.tanh(self.mid(h))
        return self.pi(h), self.v(h)


class Attn(nn.Module):
    def __init__(self, stacked: bool, d=8, hd=8):
        super().__init__()
        self.stacked = stacked
        self.embed = nn.Embedding(VOCAB, d)
        if stacked:
            self.qkvo_w = nn.Parameter(torch.randn(4, hd, d) / d ** 0.5)
        else:
            self.q, self.k, self.v, self.o = (nn.Linear(d, hd, bias=False) for _ in range(4))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        if self.stacked:
            q, k, v = F.linear(x, self.qkvo_w[:3].flatten(end_dim=1)).chunk(3, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = F.linear(y, self.qkvo_w[3]) if self.stacked else self.o(y)  # as modded-nanogpt (hd == d)
        return self.head(x + y)


def _muon_elements(model, inputs) -> List[bool]:
    """Per stored element of every 2-D-or-more parameter, in a fixed order: on Muon?  (Layout-free: the same
    computation stored otherwise compares equal where each element takes the same optimizer.)"""
    groups = ds_muon.muon_param_groups(model, example_inputs=inputs)
    on = {id(p): g["use_muon"] for g in groups for p in g["params"]}
    return sorted((n.split(".")[-2] if "." in n else n, on[id(p)]) for n, p in model.named_parameters() if p.ndim >= 2)


def test_the_same_computation_written_two_ways_gets_the_same_decisions():
    img = torch.randn(2, 3, 4, 4)
    conv, lin = _muon_elements(PatchConv(), (img,)), _muon_elements(PatchLinear(), (img,))
    assert [m for _, m in conv] == [m for _, m in lin] == [False, True, False], (conv, lin)  # head, mid, proj
    obs = torch.randn(3, 6)
    a, b = _muon_elements(Obs(raw=False), (obs,)), _muon_elements(Obs(raw=True), (obs,))
    assert dict(a) == {"inp": False, "mid": True, "pi": False, "v": False}, a
    assert dict(b) == {"w_in": False, "mid": True, "pi": False, "v": False}, b
    four, one = _muon_elements(Attn(False), (_tokens(),)), _muon_elements(Attn(True), (_tokens(),))
    assert dict(four) == {"embed": False, "head": False, "q": True, "k": True, "v": True, "o": True}, four
    assert dict(one) == {"embed": False, "head": False, "qkvo_w": True}, one


# -- the finals and two-ways classes under DDP and FSDP2 ------------------------------------------------------------
def _outputs(out) -> List[torch.Tensor]:
    """Every tensor of a model's output, whatever the container (tuple, list, dict, dataclass)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if dataclasses.is_dataclass(out):
        out = [getattr(out, f.name) for f in dataclasses.fields(out)]
    elif isinstance(out, dict):
        out = list(out.values())
    return [t for o in out for t in _outputs(o)]


def _wrapped_models():
    """(label, build, inputs): a seeded sample of the finals class and every two-ways pair."""
    img, obs = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(3)), torch.randn(
        3, 6, generator=torch.Generator().manual_seed(4))
    cases = [(f"finals {s}", lambda s=s: Heads(s), (_tokens(),)) for s in _seeds(40)[:4]]
    cases += [("patch conv", PatchConv, (img,)), ("patch linear", PatchLinear, (img,)),
              ("obs linear", lambda: Obs(raw=False), (obs,)), ("obs raw", lambda: Obs(raw=True), (obs,)),
              ("four linears", lambda: Attn(False), (_tokens(),)), ("qkvo stack", lambda: Attn(True), (_tokens(),))]
    return cases


def _train_wrapped(k: int, stack: str, world: int):
    """The decisions (name -> on Muon) and the parameters after two steps of case ``k`` on ``stack``."""
    label, build, inputs = _wrapped_models()[k]
    torch.manual_seed(k)
    model = build()
    if stack == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
    elif stack == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    groups = ds_muon.muon_param_groups(model, example_inputs=inputs, lr=0.05, adam_lr=0.01)
    decisions = {n: g["use_muon"] for g in groups for n in g["param_names"]}
    opt = ds_muon.Muon(groups, ns_dtype=torch.float32, log_summary=False)
    for _ in range(2):  # every rank the same batch: the reduced gradient is each rank's, exactly
        sum(t.float().square().mean() for t in _outputs(model(*inputs))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    inner = model.module if stack == "ddp" else model
    return decisions, {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                       for n, p in inner.named_parameters()}


def _wrapped_worker(rank, world):
    return {(k, stack): _train_wrapped(k, stack, world)
            for k in range(len(_wrapped_models())) for stack in ("ddp", "fsdp2")}


def test_finals_and_two_ways_decide_and_step_the_same_under_ddp_and_fsdp2():
    """The wrapped model is read as the bare one (a DDP ``module.`` prefix, FSDP2's DTensors) and steps as it."""
    refs = {k: _train_wrapped(k, "single", 1) for k in range(len(_wrapped_models()))}
    for out in dist_harness.run(_wrapped_worker, 2, timeout=300):
        for (k, stack), (decisions, params) in out.items():
            label = _wrapped_models()[k][0]
            bare_decisions, bare_params = refs[k]
            strip = {n.removeprefix("module."): m for n, m in decisions.items()}
            assert strip == bare_decisions, (label, stack, strip, bare_decisions)
            for n, ref in bare_params.items():
                assert torch.equal(params[n], ref), (label, stack, n)
