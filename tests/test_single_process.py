"""Single-process maths: the numbers every sharded run must reproduce bitwise."""

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import ds_muon

import dist_harness


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 10))


def train(model, opts, steps=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 24, generator=g)
        y = torch.randn(16, 10, generator=g)
        for o in opts:
            o.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for o in opts:
            o.step()


# -- parity with torch's own optimizers ---------------------------------------------------------

@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_torch_muon(nesterov, wd):
    with dist_harness.one_thread():
        a, b = mlp(), mlp()
        mats_a = [p for p in a.parameters() if p.ndim == 2]
        mats_b = [p for p in b.parameters() if p.ndim == 2]
        ours = ds_muon.Muon(mats_a, lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=wd,
                            ns_dtype=torch.bfloat16, ns_method="standard")  # torch's NS, whatever auto picks
        ref = torch.optim.Muon(mats_b, lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=wd,
                               adjust_lr_fn="original")
        train(a, [ours])
        train(b, [ref])
    for (name, pa), pb in zip(((n, p) for n, p in a.named_parameters() if p.ndim == 2), mats_b):
        assert torch.equal(pa, pb), name  # the same bf16 iteration, the same bits


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_nesterov_written_into_the_home_stack_changes_no_bit(ns_dtype, monkeypatch):
    """Where the home stack has the gradients' dtype, the Nesterov input is written there directly
    (``Exchange.home_destinations``; bf16 stacks are cast on the copy instead): 4 steps equal, bit for bit,
    the same steps with every input copied in from the kept buffer."""
    from ds_muon.engine.exchange import all_to_all

    written = []  # per gather: how many of its pieces already are their home stack's bytes
    real_destinations, real_gather = all_to_all.Exchange.home_destinations, all_to_all.Exchange.gather_start

    def gather_start(self, local, filled=False):
        homes = {i: d.data_ptr() for i, d in real_destinations(self).items()}
        written.append(sum(homes.get(i) == t.data_ptr() for i, t in (local or {}).items()))
        return real_gather(self, local, filled)

    def run(destinations):
        monkeypatch.setattr(all_to_all.Exchange, "home_destinations",
                            real_destinations if destinations else (lambda self: {}))
        monkeypatch.setattr(all_to_all.Exchange, "gather_start", gather_start)
        written.clear()
        with dist_harness.one_thread():
            model = mlp()
            opt = ds_muon.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02, ns_dtype=ns_dtype)
            train(model, [opt])
        return [p.detach().clone() for p in model.parameters()], list(written)

    (direct, written_direct), (copied, written_copied) = run(True), run(False)
    assert written_direct and written_copied and not any(written_copied)
    # fp32 stacks: each of the 3 matrices' inputs is written in place; bf16 stacks: none (the copy casts)
    assert set(written_direct) == ({3} if ns_dtype == torch.float32 else {0}), written_direct
    assert all(torch.equal(a, b) for a, b in zip(direct, copied))


def test_adamw_groups_bitwise_equal_torch_adamw():
    a, b = mlp(), mlp()
    groups = ds_muon.muon_param_groups(a, lr=0.02, adam_lr=1e-3, adam_weight_decay=0.05)
    ours = ds_muon.Muon(groups, adam_betas=(0.9, 0.99), adam_eps=1e-7)
    muon = {n for g in groups if g["use_muon"] for n in g["param_names"]}  # the output layer: AdamW
    vecs_b = [p for n, p in b.named_parameters() if n not in muon]
    mats_b = [p for n, p in b.named_parameters() if n in muon]
    ref_adam = torch.optim.AdamW(vecs_b, lr=1e-3, betas=(0.9, 0.99), eps=1e-7, weight_decay=0.05)
    ref_muon = ds_muon.Muon(mats_b, lr=0.02)
    train(a, [ours])
    train(b, [ref_adam, ref_muon])
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


def test_param_groups_rules():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.proj = nn.Linear(16, 16)
            self.norm = nn.LayerNorm(16)
            self.conv = nn.Conv1d(16, 8, 3)
            self.lm_head = nn.Linear(16, 50, bias=False)
            self.classifier = nn.Linear(16, 3)

    m = Tiny()
    muon, adam = ds_muon.muon_param_groups(m, lr=0.01, adam_lr=1e-3)
    assert muon["use_muon"] and not adam["use_muon"]
    assert muon["param_names"] == ["proj.weight", "conv.weight"]
    assert set(adam["param_names"]) == {"embed.weight", "proj.bias", "norm.weight", "norm.bias", "conv.bias",
                                        "lm_head.weight", "classifier.weight", "classifier.bias"}
    assert muon["lr"] == 0.01 and adam["lr"] == 1e-3
    # tied head: the weight shared with the embedding goes to AdamW whatever its module is called
    m.proj2 = nn.Linear(16, 50, bias=False)
    m.proj2.weight = m.embed.weight
    muon, adam = ds_muon.muon_param_groups(m)
    assert "embed.weight" in adam["param_names"] and all(p is not m.embed.weight for p in muon["params"])
    # head names are overridable
    muon, _ = ds_muon.muon_param_groups(m, head_names=("classifier",))
    assert "lm_head.weight" in muon["param_names"]


def test_conv_weight_orthogonalized_as_matrix():
    conv = nn.Conv2d(4, 6, 3)
    p = conv.weight
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    opt = ds_muon.Muon([p], lr=0.1, momentum=0.0, nesterov=False, ns_dtype=torch.float32)
    opt.step()
    expected = before - 0.1 * ds_muon.newton_schulz(p.grad.reshape(6, 36), dtype=torch.float32).reshape(p.shape)
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)


# -- scale factors ------------------------------------------------------------------------

def test_scale_factors():
    f = ds_muon.get_muon_scale_factor
    assert f(1024, 256) == 2.0 and f(256, 1024) == 1.0
    assert f(1024, 256, "spectral") == 32.0
    assert f(1024, 256, "spectral", 0.2) == pytest.approx(6.4)
    assert f(256, 1024, "unit_rms_norm") == 0.5
    assert f(7, 3, "none", 3.0) == 3.0
    with pytest.raises(ValueError, match="scale_mode"):
        f(4, 4, "bogus")


def test_scale_applied_from_logical_shape():
    p = nn.Parameter(torch.zeros(64, 16))
    p.grad = torch.randn(64, 16)
    opt = ds_muon.Muon([p], lr=1.0, momentum=0.0, nesterov=False, scale_mode="spectral",
                       extra_scale_factor=0.5, ns_dtype=torch.float32)
    opt.step()
    O = ds_muon.newton_schulz(p.grad, dtype=torch.float32, method="auto")  # Muon's default method
    torch.testing.assert_close(p.detach(), -0.5 * 8.0 * O, rtol=0, atol=1e-6)


# -- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-1.0), "lr"),
    (dict(momentum=1.0), "momentum"),
    (dict(momentum=-0.1), "momentum"),
    (dict(ns_steps=0), "ns_steps"),
    (dict(scale_mode="huge"), "scale_mode"),
    (dict(ns_coefficients="magic"), "ns_coefficients"),
    (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients"),
    (dict(weight_decay_mode="l1"), "weight_decay_mode"),
    (dict(mode="fast"), "mode"),
    (dict(ns_dtype="int8"), "ns_dtype"),
    (dict(nonfinite="ignore"), "nonfinite"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ds_muon.Muon([nn.Parameter(torch.zeros(3, 3))], **kwargs)


def test_vector_in_muon_group_names_shape_and_helper():
    with pytest.raises(ValueError, match=r"\(7,\).*muon_param_groups"):
        ds_muon.Muon([nn.Parameter(torch.zeros(7))])


def test_complex_and_sparse_rejected():
    with pytest.raises(ValueError, match="complex"):
        ds_muon.Muon([nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64))])
    p = nn.Parameter(torch.zeros(4, 3))
    opt = ds_muon.Muon([p])
    p.grad = torch.zeros(4, 3).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()


# -- non-finite gradients: atomic ------------------------------------------------------------

def _nan_setup():
    model = mlp()
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=1e-3))
    train(model, [opt], steps=1)
    model.zero_grad()
    nn.functional.mse_loss(model(torch.randn(4, 24)), torch.randn(4, 10)).backward()
    model[2].bias.grad[3] = float("inf")  # an AdamW tensor, after the Muon ones in group order
    snapshot = copy.deepcopy((model.state_dict(), opt.state_dict()))
    return model, opt, snapshot


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def test_nonfinite_raises_before_anything_changes():
    model, opt, snapshot = _nan_setup()
    with pytest.raises(FloatingPointError, match=r"2\.bias"):
        opt.step()
    assert _same((model.state_dict(), opt.state_dict()), snapshot)


def test_nonfinite_skip_counts_and_warns():
    model, opt, snapshot = _nan_setup()
    opt.nonfinite = "skip"
    with pytest.warns(RuntimeWarning, match="skipped step"):
        opt.step()
    assert opt.nonfinite_skips == 1
    assert _same((model.state_dict(), opt.state_dict()), snapshot)


# -- closure and resume --------------------------------------------------------------------

def test_closure_runs_with_grad_enabled():
    model = mlp()
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model))
    x, y = torch.randn(4, 24), torch.randn(4, 10)

    def closure():
        assert torch.is_grad_enabled()
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert loss.item() > 0


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_resume_bitwise(ns_dtype, tmp_path):
    straight = mlp()
    opt = ds_muon.Muon(ds_muon.muon_param_groups(straight, adam_lr=1e-3, weight_decay=0.01), ns_dtype=ns_dtype)
    train(straight, [opt], steps=4, seed=5)

    first = mlp()
    opt1 = ds_muon.Muon(ds_muon.muon_param_groups(first, adam_lr=1e-3, weight_decay=0.01), ns_dtype=ns_dtype)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(16, 24, generator=g), torch.randn(16, 10, generator=g)) for _ in range(4)]

    def run(model, o, bs):
        for x, y in bs:
            o.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            o.step()

    run(first, opt1, batches[:2])
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, tmp_path / "ckpt.pt")
    ck = torch.load(tmp_path / "ckpt.pt")
    resumed = mlp(seed=123)
    opt2 = ds_muon.Muon(ds_muon.muon_param_groups(resumed, adam_lr=1e-3, weight_decay=0.01), ns_dtype=ns_dtype)
    resumed.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    run(resumed, opt2, batches[2:])
    for (n, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("change", [{}, {"ns_steps": 2}, {"ns_dtype": torch.float32}, {"ns_coefficients": "quintic"}])
def test_ns_settings_changed_between_steps_take_effect(change):
    """NS settings are read every step, not frozen in the first step's compiled exchanges."""
    a = mlp()
    opt_a = ds_muon.Muon(ds_muon.muon_param_groups(a))
    train(a, [opt_a], steps=1)
    b = copy.deepcopy(a)
    opt_b = ds_muon.Muon(ds_muon.muon_param_groups(b))
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # in-process loads share tensors
    for o in (opt_a, opt_b):
        for g in o.param_groups:
            if g["use_muon"]:
                g.update(change)
    train(a, [opt_a], steps=1, seed=2)  # opt_a compiled its exchanges with the old settings
    train(b, [opt_b], steps=1, seed=2)  # opt_b never stepped before: the new settings for sure
    for (n, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), n


def test_l2_weight_decay_differs_from_decoupled():
    outs = []
    for mode in ("decoupled", "l2"):
        model = mlp()
        opt = ds_muon.Muon([p for p in model.parameters() if p.ndim == 2], weight_decay=0.5,
                           weight_decay_mode=mode, ns_dtype=torch.float32)
        train(model, [opt], steps=2)
        outs.append(model[0].weight.detach().clone())
    assert not torch.equal(*outs)
    # l2 adds wd·p to the gradient before momentum: check one step against the formula
    p = nn.Parameter(torch.randn(6, 4))
    g = torch.randn(6, 4)
    p.grad = g.clone()
    p0 = p.detach().clone()
    opt = ds_muon.Muon([p], lr=0.1, momentum=0.9, nesterov=False, weight_decay=0.5, weight_decay_mode="l2",
                       ns_dtype=torch.float32)
    opt.step()
    buf = (g + 0.5 * p0) * (1 - 0.9)
    expected = p0 - 0.1 * math.sqrt(6 / 4) * ds_muon.newton_schulz(buf, dtype=torch.float32)
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)


# -- Gram Newton–Schulz in the optimizer (opt-in) ------------------------------------------------

def test_gram_method_in_optimizer_and_errors():
    p = nn.Parameter(torch.randn(16, 64))
    p.grad = torch.randn(16, 64)
    q = nn.Parameter(p.detach().clone())
    q.grad = p.grad.clone()
    ds_muon.Muon([p], ns_method="gram", ns_dtype=torch.float32).step()
    ds_muon.Muon([q], ns_dtype=torch.float32).step()
    torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="ns_method"):
        ds_muon.Muon([nn.Parameter(torch.zeros(3, 3))], ns_method="fast")
