"""Generated einsum cases (issue 40): random equations over random parameter ranks, each Muon step against
a hand Newton–Schulz of the matrix the equation applies.

Each case draws the roles of a raw parameter's stored axes (2-D ``[in, out]`` / ``[out, in]``; 3-D one
matrix ``[in, out, out]`` / ``[out, in, in]`` such as ``wq: [D, H, hd]``, ``[out, out, in]`` / ``[in, in, out]``
such as ``wo: [H, hd, D]`` (rows a run of leading axes: ``ds_muon.row_axes``), 4-D ones; a head or expert stack
``[S, out, in]`` / ``[S, in, out]`` whose stack axis is shared with the input; and layouts no
``[prod(shape[:k]), rest]`` view holds: interleaved roles, a stack axis inside), random sizes, letters, operand order and output order, and how it is applied (``einsum``,
``tensordot``, ``F.linear`` of a permuted and reshaped view, ``x @ W``).  A model applies it to its input and a Linear
reads the result (so it is no output layer).  The reference is built here from the drawn roles alone: the
gradient permuted to ``[stack…, out…, in…]``, reshaped, ``newton_schulz`` per stack member, scaled by
``get_muon_scale_factor(out, in)`` and laid back.  Layouts the engine cannot hold must stay on AdamW saying why.

``DS_MUON_EINSUM_CASES`` (default 32) and ``DS_MUON_EINSUM_SEED`` widen the run.
"""

from __future__ import annotations

import os
import random
import string
import warnings
from dataclasses import dataclass
from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_muon

CASES = int(os.environ.get("DS_MUON_EINSUM_CASES", "32"))
SEED = int(os.environ.get("DS_MUON_EINSUM_SEED", "0"))
LR = 0.02
HELD = [("out", "in"), ("in", "out"), ("in", "out", "out"), ("out", "in", "in"), ("stack", "out", "in"),
        ("stack", "in", "out"), ("out", "out", "in"), ("in", "in", "out"), ("in", "in", "out", "out"),
        ("stack", "out", "out", "in")]
NOT_HELD = [("out", "stack", "in"), ("out", "in", "out"), ("in", "out", "in")]


@dataclass
class Case:
    roles: Tuple[str, ...]
    sizes: Tuple[int, ...]
    how: str  # "einsum", "tensordot", "linear"
    equation: str
    param_first: bool
    x_shape: Tuple[int, ...]
    held: bool


def draw(rng: random.Random) -> Case:
    held = rng.random() < 0.8
    roles = rng.choice(HELD if held else NOT_HELD)
    sizes = [rng.randint(2, 6) for _ in roles]
    outs = [s for s, r in zip(sizes, roles) if r == "out"]
    ins = [s for s, r in zip(sizes, roles) if r == "in"]
    while _prod(outs) == _prod(ins):  # non-square: the orientation shows in the scale
        i = roles.index("out")
        sizes[i] += 1
        outs = [s for s, r in zip(sizes, roles) if r == "out"]
    stack = "stack" in roles
    how = "einsum" if stack else rng.choice(["einsum", "einsum", "tensordot", "linear"] + ["matmul"] * (len(roles) == 2))
    letters = rng.sample(string.ascii_lowercase, len(roles) + 2)
    p_letters, batch = letters[:len(roles)], letters[len(roles):]
    x_letters = batch + [c for c, r in zip(p_letters, roles) if r in ("in", "stack")]
    x_sizes = [rng.randint(1, 3) for _ in batch] + [s for s, r in zip(sizes, roles) if r in ("in", "stack")]
    order = list(range(len(x_letters)))
    if how == "einsum":
        rng.shuffle(order)
    x_letters, x_sizes = [x_letters[i] for i in order], [x_sizes[i] for i in order]
    out_letters = batch + [c for c, r in zip(p_letters, roles) if r in ("out", "stack")]
    if how == "einsum":
        rng.shuffle(out_letters)
    param_first = how == "einsum" and rng.random() < 0.5
    ops = [p_letters, x_letters] if param_first else [x_letters, p_letters]
    eq = ",".join("".join(o) for o in ops) + "->" + "".join(out_letters)
    return Case(tuple(roles), tuple(sizes), how, eq, param_first, tuple(x_sizes), held)


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


class Applies(nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        self.case = case
        self.w = nn.Parameter(torch.randn(case.sizes) / 3)
        n_out = _prod([s for s, r in zip(case.sizes, case.roles) if r == "out"])
        self.pre = nn.Linear(case.x_shape[-1], case.x_shape[-1])  # the input layer: the parameter is a hidden map
        self.read = nn.Linear(1, 3)  # reads the result: the parameter is no output layer
        self.out = nn.Linear(3, 2)
        self.n_out = n_out

    def forward(self, x):
        c, w = self.case, self.w
        x = self.pre(x)
        if c.how == "einsum":
            y = torch.einsum(c.equation, w, x) if c.param_first else torch.einsum(c.equation, x, w)
        elif c.how == "tensordot":
            ins = [i for i, r in enumerate(c.roles) if r == "in"]
            k = len(ins)
            y = torch.tensordot(x, w, dims=(list(range(x.ndim - k, x.ndim)), ins))
        elif c.how == "matmul":  # x @ W of a 2-D tensor ([in, out]), or of its transpose
            y = x @ (w if c.roles == ("in", "out") else w.T)
        else:  # F.linear of the [out, in] view of the stored tensor
            perm = [i for i, r in enumerate(c.roles) if r == "out"] + [i for i, r in enumerate(c.roles) if r == "in"]
            ins = _prod([s for s, r in zip(c.sizes, c.roles) if r == "in"])
            y = F.linear(x.reshape(*x.shape[:x.ndim - sum(r == "in" for r in c.roles)], ins),
                         w.permute(perm).reshape(self.n_out, ins))
        return self.out(F.gelu(self.read(y.reshape(-1, 1))))


def _reference(case: Case, w0: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``w0`` after one Muon step (momentum 0) of the matrices the drawn roles say the equation applies."""
    roles = case.roles
    order = [i for r in ("stack", "out", "in") for i, x in enumerate(roles) if x == r]
    g = grad.permute(order)
    s = _prod([grad.shape[i] for i, r in enumerate(roles) if r == "stack"])
    o = _prod([grad.shape[i] for i, r in enumerate(roles) if r == "out"])
    n = _prod([grad.shape[i] for i, r in enumerate(roles) if r == "in"])
    mats = g.reshape(s, o, n)
    upd = torch.stack([ds_muon.newton_schulz(mats[k], dtype=torch.float32, method="auto") for k in range(s)])
    back = torch.empty_like(grad).permute(order)
    back.copy_(upd.reshape(back.shape))
    inverse = back.permute([order.index(i) for i in range(len(order))])
    return w0.clone().add_(inverse, alpha=-LR * ds_muon.get_muon_scale_factor(o, n))


def _cases() -> List[Case]:
    rng = random.Random(SEED)
    return [draw(rng) for _ in range(CASES)]


@pytest.mark.parametrize("k", range(CASES))
def test_generated_equation_against_hand_newton_schulz(k):
    case = _cases()[k]
    torch.manual_seed(k)
    model = Applies(case)
    x = torch.randn(case.x_shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        groups = ds_muon.muon_param_groups(model, lr=LR, example_inputs=(x,))
    muon = {n for g in groups if g["use_muon"] for n in g["param_names"]}
    reason = {n: r for g in groups for n, r in zip(g["param_names"], g["param_reasons"])}["w"]
    if not case.held:  # said why, where the equation is read (F.linear of a permuted copy is not a view of w)
        assert "w" not in muon and (case.how == "linear" or "no [rows, columns] view" in reason), (case, reason)
        return
    assert "w" in muon, (case, reason)
    opt = ds_muon.Muon(groups, momentum=0.0, nesterov=False, ns_dtype=torch.float32, ns_method="standard")
    model(x).square().sum().backward()
    w0, grad = model.w.detach().clone(), model.w.grad.detach().clone()
    assert grad.abs().max() > 0, case
    opt.step()
    want = _reference(case, w0, grad)
    tol = 1e-3 * float((want - w0).abs().max())  # fp32 NS in another order (its rounding grown by the iteration
    # on small singular values); a wrong orientation moves the update by its scale ratio, >= 2% here
    assert torch.allclose(model.w.detach(), want, rtol=0, atol=tol), (case, reason)
    roles = case.roles
    o = _prod([s for s, r in zip(case.sizes, roles) if r == "out"])
    n = _prod([s for s, r in zip(case.sizes, roles) if r == "in"])
    if ds_muon.get_muon_scale_factor(o, n) != ds_muon.get_muon_scale_factor(n, o):  # the orientation, seen
        wrong = w0 + (want - w0) * (ds_muon.get_muon_scale_factor(n, o) / ds_muon.get_muon_scale_factor(o, n))
        assert not torch.allclose(model.w.detach(), wrong, rtol=0, atol=tol), case


def test_the_draws_cover_every_layout():
    drawn = {c.roles for c in _cases()} | {c.how for c in _cases()}
    if CASES >= 32:
        assert {"einsum", "tensordot", "linear", "matmul"} <= drawn and sum(r in drawn for r in HELD) >= 7, drawn
