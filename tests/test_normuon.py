"""NorMuon (``variant="normuon"``, arXiv 2510.05491): the rule against its formula, its settings,
its second moment in checkpoints, and sharded runs bitwise equal to one process on every stack.

The reference here is written from the paper's formula (float64), on ds_muon's own Newton–Schulz
output (the orthogonalization is Muon's, tested elsewhere): per output neuron
``v ← β₂·v + (1 − β₂)·mean_cols(O⊙O)``, ``O' = O / (√v + ε)``, ``O' ← O' · ‖O‖_F / ‖O'‖_F``,
then the usual ``p ← p − lr·scale·O'``.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn as nn

import ds_muon
from ds_muon.rules.newton_schulz import newton_schulz
from ds_muon.rules.scaling import get_muon_scale_factor

KEY = "normuon_v"


class Net(nn.Module):
    """One of each kind of matrix the engine cuts differently: a plain [out, in] weight, one stored
    [in, out] (its neurons are columns), row blocks orthogonalized apart (split_rows), an expert
    stack (each expert its own matrix) and a conv kernel (flattened to [out, in·k·k])."""

    def __init__(self):
        super().__init__()
        self.plain = nn.Parameter(torch.randn(12, 7))
        self.stored_in_out = ds_muon.transposed(nn.Parameter(torch.randn(9, 5)))  # in=9, out=5
        self.fused = ds_muon.split_rows(nn.Parameter(torch.randn(10, 6)), [4, 6])
        self.experts = ds_muon.expert_weight(nn.Parameter(torch.randn(3, 5, 8)))
        self.conv = nn.Parameter(torch.randn(4, 3, 2, 2))
        self.bias = nn.Parameter(torch.randn(5))  # AdamW


def _matrices(name, p):
    """(stored [rows, cols] view of each logical matrix, transposed?) of parameter ``name``."""
    if name == "fused":
        return [(p[:4], False), (p[4:], False)]
    if name == "experts":
        return [(p[e], False) for e in range(p.shape[0])]
    if name == "conv":
        return [(p.reshape(p.shape[0], -1), False)]
    return [(p, name == "stored_in_out")]


def _reference(model, grads, steps, lr, momentum, beta2, ns_kw, nesterov=True):
    """NorMuon from the formula, float64 after NS; returns (parameters, {name: [v per matrix]})."""
    params = {n: p.detach().clone() for n, p in model.named_parameters() if n != "bias"}
    bufs = {n: torch.zeros_like(p) for n, p in params.items()}
    vs = {}
    for t in range(steps):
        for n, p in params.items():
            g = grads[t][n]
            bufs[n].lerp_(g, 1 - momentum)
            u = g.lerp(bufs[n], momentum) if nesterov else bufs[n].clone()
            new = p.clone()
            for k, ((um, tr), (pm, _)) in enumerate(zip(_matrices(n, u), _matrices(n, new))):
                o = newton_schulz(um[None], **ns_kw)[0].double()
                on = o.t() if tr else o  # output neurons first
                v = vs.setdefault(n, {}).get(k, torch.zeros(on.shape[0], dtype=torch.float64))
                v = beta2 * v + (1 - beta2) * (on * on).mean(dim=1)
                vs[n][k] = v
                y = on / (v.sqrt() + 1e-8)[:, None]
                y = y * (torch.linalg.norm(o) / torch.linalg.norm(y))
                y = y.t() if tr else y
                out, inp = (pm.shape[1], pm.shape[0]) if tr else pm.shape
                pm.sub_((lr * get_muon_scale_factor(out, inp) * y).to(pm.dtype))
            params[n] = new
    return params, {n: [vs[n][k] for k in sorted(vs[n])] for n in vs}


def _groups(model):
    """Muon for every matrix, AdamW for the rest (bare parameters: named here, not guessed)."""
    named = list(model.named_parameters())
    adam = [(n, p) for n, p in named if p.dim() < 2]
    return [{"params": [p for _, p in named if p.dim() >= 2], "param_names": [n for n, p in named if p.dim() >= 2]}
            ] + ([{"params": [p for _, p in adam], "param_names": [n for n, _ in adam], "use_muon": False,
                   "lr": 1e-3}] if adam else [])


def _train(model, grads, steps, **kw):
    groups = _groups(model)
    opt = ds_muon.Muon(groups, log_summary=False, **kw)
    for t in range(steps):
        for n, p in model.named_parameters():
            p.grad = grads[t][n].to(p.dtype)
        opt.step()
    return opt


def _grads(model, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()} for _ in range(steps)]


def test_single_process_equals_formula():
    """fp32 NS: parameters within 2e-6 (absolute, lr 0.02) and every matrix's v within 1e-5
    (relative) of the float64 formula after 3 steps, for each kind of matrix; the moment is
    one float32 per output neuron (columns of the [in, out] weight); and the result is not plain
    Muon's (the normalization moved every matrix by more than 100x the tolerance)."""
    torch.manual_seed(0)
    model, steps, lr = Net(), 3, 0.02
    start = copy.deepcopy(model)
    grads = _grads(model, steps)
    ns_kw = dict(steps=5, coefficients="keller", dtype=torch.float32, eps=1e-7)
    opt = _train(model, grads, steps, lr=lr, momentum=0.9, variant="normuon", normuon_beta2=0.9, ns_dtype=torch.float32)
    want, want_v = _reference(start, grads, steps, lr, 0.9, 0.9, ns_kw)
    plain = copy.deepcopy(start)
    _train(plain, grads, steps, lr=lr, momentum=0.9, ns_dtype=torch.float32)
    for n, p in model.named_parameters():
        if n == "bias":
            assert KEY not in opt.state[p]
            continue
        torch.testing.assert_close(p.detach(), want[n], rtol=0, atol=2e-6, msg=n)
        assert float((p.detach() - dict(plain.named_parameters())[n].detach()).abs().max()) > 2e-4, n
        v = opt.state[p][KEY]
        assert v.dtype == torch.float32 and v.dim() == 1
        assert v.numel() == sum(t.numel() for t in want_v[n]), n
        torch.testing.assert_close(v.double(), torch.cat(want_v[n]), rtol=1e-5, atol=0, msg=n)
    assert opt.state[model.stored_in_out][KEY].numel() == 5  # out = columns of the [in, out] weight


def test_bf16_params_keep_float32_moment_through_load():
    """A bfloat16 model's v stays float32 through state_dict / load_state_dict (torch's load casts
    floating-point state to the parameter's dtype; v goes round it), bitwise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 4, bias=False)).to(torch.bfloat16)
    grads = _grads(model, 2)
    opt = _train(model, grads, 2, variant="normuon")
    saved = copy.deepcopy(opt.state_dict())
    fresh = ds_muon.Muon(_groups(model), log_summary=False, variant="normuon")
    fresh.load_state_dict(saved)
    for p in model.parameters():
        v = fresh.state[p][KEY]
        assert v.dtype == torch.float32 and torch.equal(v, opt.state[p][KEY])


def test_resume_in_fresh_optimizer_bitwise():
    """Save after step k=2, load into a fresh optimizer over a copy of the model: steps 3..5 equal
    the uninterrupted run bitwise (v included; a fresh v would differ: checked)."""
    torch.manual_seed(0)
    model = Net()
    grads = _grads(model, 5)
    kw = dict(variant="normuon", normuon_beta2=0.8, ns_dtype=torch.bfloat16)
    a = copy.deepcopy(model)
    opt_a = _train(a, grads, 2, **kw)
    saved, b, c = copy.deepcopy(opt_a.state_dict()), copy.deepcopy(a), copy.deepcopy(a)
    for t in range(2, 5):
        for n, p in a.named_parameters():
            p.grad = grads[t][n].clone()
        opt_a.step()
    for m, drop in ((b, False), (c, True)):
        opt = ds_muon.Muon(_groups(m), log_summary=False, **kw)
        sd = copy.deepcopy(saved)
        if drop:
            for st in sd["state"].values():
                st.pop(KEY, None)
        opt.load_state_dict(sd)
        for t in range(2, 5):
            for n, p in m.named_parameters():
                p.grad = grads[t][n].clone()
            opt.step()
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if n != "bias":
            assert not torch.equal(pa, pc), n


@pytest.mark.parametrize("key,value,match", [
    ("variant", "adam", r"param_groups\[1\]: variant='adam' is unknown; use one of \['muon', 'normuon'\]"),
    ("normuon_beta2", 1.0, r"param_groups\[1\]: normuon_beta2 must be a finite number in \[0.0, 1.0\)"),
    ("normuon_beta2", float("nan"), r"param_groups\[1\]: normuon_beta2 must be"),
    ("normuon_beta2", "0.9", r"param_groups\[1\]: normuon_beta2 must be"),
])
def test_bad_settings_name_group_and_key(key, value, match):
    """At construction (a per-group key), and edited into a group before a step: refused naming the
    group and the key, before anything changes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 3, bias=False))
    groups = [{"params": [model[0].weight]}, {"params": [model[1].weight], key: value}]
    with pytest.raises(ValueError, match=match):
        ds_muon.Muon(groups)
    opt = ds_muon.Muon([{"params": [model[0].weight]}, {"params": [model[1].weight]}], variant="normuon")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.param_groups[1][key] = value
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.state  # no state was made


def test_moment_of_another_model_refused_before_any_write():
    """A loaded v of the wrong length (another model's) raises at the step naming the tensor and
    the key, with every tensor unchanged; a non-1-D one is refused at load."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=True))
    opt = _train(model, _grads(model, 1), 1, variant="normuon")
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0][KEY] = torch.zeros(5)
    opt.load_state_dict(sd)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"0\.weight.*'normuon_v'.*shape \(6,\)"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    sd["state"][0][KEY] = torch.zeros(6, 1)
    with pytest.raises(ValueError, match=r"'normuon_v'.*not a 1-D"):
        opt.load_state_dict(sd)


def test_variant_is_a_per_group_setting():
    """One NorMuon group beside a Muon group: only the first gets v and its update changes; the
    Muon group's tensors are bitwise those of an all-Muon run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Linear(8, 5, bias=False))
    ref = copy.deepcopy(model)
    grads = [{"weight0": torch.randn(8, 6), "weight1": torch.randn(5, 8)} for _ in range(3)]

    def run(m, variant0):
        opt = ds_muon.Muon([{"params": [m[0].weight], "variant": variant0}, {"params": [m[1].weight]}],
                           log_summary=False)
        for g in grads:
            m[0].weight.grad, m[1].weight.grad = g["weight0"].clone(), g["weight1"].clone()
            opt.step()
        return opt
    opt = run(model, "normuon")
    run(ref, "muon")
    assert KEY in opt.state[model[0].weight] and KEY not in opt.state[model[1].weight]
    assert torch.equal(model[1].weight, ref[1].weight)
    assert not torch.equal(model[0].weight, ref[0].weight)
