"""Coming from another Muon (one process): torch.optim.Muon + AdamW, Keller's MuonWithAuxAdam, DCP and torch files.

The state moves by tensor name into ds_muon's own groups (``muon_param_groups``); after the move every
momentum and AdamW moment is ``torch.equal`` to the source's, and the next step is checked against the
source optimizer continuing: bitwise for torch.optim.Muon + AdamW (ds_muon's single-process maths is
theirs, bit for bit, on one thread), within a stated bound for Keller's (its NS rounds otherwise in bf16, so
both sides run NS in fp32 there: 1e-4 of the step; its Adam puts ``eps`` after the bias correction: 1e-6).
"""

import os

import pytest
import torch
from torch import nn

import ds_muon
import dist_harness
from ds_muon import convert as cv
from ds_muon.conversion.write import one_rank_group


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 24)
        self.up = nn.Linear(24, 48)
        self.down = nn.Linear(48, 24)
        self.norm = nn.LayerNorm(24)
        self.lm_head = nn.Linear(24, 16, bias=False)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.down(torch.relu(self.up(h)))
        return self.lm_head(self.norm(h))


def net():
    torch.manual_seed(0)
    return Net()


def other_net():
    torch.manual_seed(0)
    m = Net()
    m.up, m.down = nn.Linear(24, 40), nn.Linear(40, 24)
    return m


def loss(model, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 16, (4, 8), generator=g)
    return nn.functional.cross_entropy(model(x).reshape(-1, 16), torch.roll(x, -1, 1).reshape(-1))


def run(model, opts, steps, start=0):
    for t in range(start, start + steps):
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss(model, t).backward()
        for o in opts:
            o.step()


SETTINGS = dict(lr=0.02, adam_lr=3e-3, weight_decay=0.0, adam_weight_decay=0.0)
TORCH_NS = dict(ns_dtype="bfloat16", ns_method="standard")  # torch.optim.Muon's NS (the default is auto)


def ds_muon_for(model, **kw):
    groups = ds_muon.muon_param_groups(model, lr=0.02, adam_lr=3e-3)
    kw = {"ns_dtype": torch.bfloat16, "ns_method": "standard", **kw}  # torch.optim.Muon's NS, on every CPU
    return ds_muon.Muon(groups, adam_betas=(0.9, 0.95), adam_eps=1e-8, log_summary=False, **kw)


def torch_pair(model):
    """The usual torch split: hidden matrices on torch.optim.Muon, the rest on AdamW (named, so the state dicts
    record param_names)."""
    hidden = [(n, p) for n, p in model.named_parameters() if p.ndim == 2 and n in ("up.weight", "down.weight")]
    rest = [(n, p) for n, p in model.named_parameters() if (n, p) not in hidden]
    return (torch.optim.Muon(hidden, lr=0.02, momentum=0.95, weight_decay=0.0, adjust_lr_fn="original"),
            torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0))


def _state_equal(muon, model, source_state):
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in muon.state.items():
        for k, v in st.items():
            if k != "step":
                assert torch.equal(v, source_state[names[id(p)]][k]), f"{names[id(p)]} {k}"


def test_from_torch_muon_and_adamw_bitwise():
    with dist_harness.one_thread():
        a, b = net(), net()
        pair = torch_pair(a)
        run(a, pair, 3)
        b.load_state_dict(a.state_dict())
        muon = ds_muon_for(b)
        cv.load_state_from(muon, list(pair), a)  # the documented lines (docs/CHECKPOINTS.md)
        _state_equal(muon, b, cv.named_state(list(pair), a))
        run(a, pair, 1, start=3)
        run(b, [muon], 1, start=3)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), f"{n}: the step after the move differs from torch.optim.Muon + AdamW continuing"


def test_torch_file_through_the_cli(tmp_path):
    """``ds-muon convert state.pt out.pt --to torch``: a torch file whose optimizers recorded param_names."""
    from ds_muon.cli import main

    with dist_harness.one_thread():
        a = net()
        pair = torch_pair(a)
        run(a, pair, 2)
        src = tmp_path / "state.pt"
        torch.save({"model": a.state_dict(), "optimizers": [o.state_dict() for o in pair]}, src)
        out = tmp_path / "ds_muon.pt"
        assert main(["convert", str(src), str(out), "--to", "torch", "--model", "test_convert:net",
                     "--set", "lr=0.02", "adam_lr=0.003", "ns_dtype=bfloat16", "ns_method=standard"]) == 0
        b = net()
        muon = ds_muon_for(b)
        ck = torch.load(out, weights_only=False)
        b.load_state_dict(ck["model"])
        muon.load_state_dict(ck["optim"])
        run(a, pair, 1, start=2)
        run(b, [muon], 1, start=2)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n


# -- Keller Jordan's MuonWithAuxAdam (the package is not installable here): its state layout, faithfully --------
def _keller_ns(G, steps=5, dtype=torch.bfloat16):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.to(dtype)
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


class KellerMuonWithAuxAdam(torch.optim.Optimizer):
    """Stand-in for ``muon.SingleDeviceMuonWithAuxAdam`` (KellerJordan/Muon): groups flagged ``use_muon``; the
    Muon group's params sorted by size, largest first; Muon state ``momentum_buffer``; Adam state ``exp_avg``,
    ``exp_avg_sq`` and ``step`` as a Python int; Nesterov momentum by lerp; scale sqrt(max(1, rows/cols))."""

    def __init__(self, param_groups, ns_dtype=torch.bfloat16):
        self.ns_dtype = ns_dtype  # Keller's is bf16; the test runs both sides in fp32 to compare closely
        for g in param_groups:
            if g["use_muon"]:
                g["params"] = sorted(g["params"], key=lambda x: x.size(), reverse=True)
                g.setdefault("lr", 0.02), g.setdefault("momentum", 0.95), g.setdefault("weight_decay", 0)
            else:
                g.setdefault("lr", 3e-4), g.setdefault("betas", (0.9, 0.95)), g.setdefault("eps", 1e-10)
                g.setdefault("weight_decay", 0)
        super().__init__(param_groups, dict())

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if g["use_muon"]:
                    if not st:
                        st["momentum_buffer"] = torch.zeros_like(p)
                    m = st["momentum_buffer"]
                    m.lerp_(p.grad, 1 - g["momentum"])
                    u = _keller_ns(p.grad.lerp(m, g["momentum"]), dtype=self.ns_dtype)
                    u = u * max(1, p.size(-2) / p.size(-1)) ** 0.5
                    p.mul_(1 - g["lr"] * g["weight_decay"]).add_(u.reshape(p.shape), alpha=-g["lr"])
                else:
                    if not st:
                        st["exp_avg"], st["exp_avg_sq"], st["step"] = torch.zeros_like(p), torch.zeros_like(p), 0
                    st["step"] += 1
                    b1, b2 = g["betas"]
                    st["exp_avg"].lerp_(p.grad, 1 - b1)
                    st["exp_avg_sq"].lerp_(p.grad.square(), 1 - b2)
                    u = (st["exp_avg"] / (1 - b1 ** st["step"])) / ((st["exp_avg_sq"] / (1 - b2 ** st["step"])).sqrt()
                                                                     + g["eps"])
                    p.mul_(1 - g["lr"] * g["weight_decay"]).add_(u, alpha=-g["lr"])


def keller(model, ns_dtype=torch.bfloat16):
    hidden = [model.up.weight, model.down.weight]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    return KellerMuonWithAuxAdam([dict(params=hidden, lr=0.02, momentum=0.95, use_muon=True),
                                  dict(params=rest, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, use_muon=False)], ns_dtype)


def test_from_keller_muon_with_aux_adam():
    with dist_harness.one_thread():
        a, b = net(), net()
        opt = keller(a, torch.float32)
        run(a, [opt], 3)
        b.load_state_dict(a.state_dict())
        muon = ds_muon_for(b, ns_dtype="float32")
        cv.load_state_from(muon, opt, a)  # the live optimizer names its tensors through the model
        _state_equal(muon, b, cv.named_state(opt, a))
        steps = {int(st["step"]) for st in muon.state.values() if "step" in st}
        assert steps == {3}
        start = {n: p.detach().clone() for n, p in a.named_parameters()}
        run(a, [opt], 1, start=3)
        run(b, [muon], 1, start=3)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        step_keller, step_ours = pa - start[n], pb - start[n]
        if n in ("up.weight", "down.weight"):
            # NS in fp32 on both sides: the same iteration up to fp32 rounding (1e-5 of the step measured). In bf16
            # Keller's NS normalises and multiplies in another order than torch.optim.Muon / ds_muon, and the
            # steps differ by 17% from any state, a fresh one included: rounding, not state
            rel = ((step_keller - step_ours).norm() / step_keller.norm()).item()
            assert rel <= 1e-4, f"{n}: the step is {rel:.2e} of Keller's away"
        else:  # AdamW: eps after the bias correction, so a few ulps apart
            err = (step_keller - step_ours).abs().max().item()
            assert err <= 1e-6, f"{n}: {err:.2e} from Keller's continuing step"


# -- refusals and choices ------------------------------------------------------------------------------------
def test_other_algorithm_or_other_model_refused_changing_nothing():
    a = net()
    opt = keller(a)
    run(a, [opt], 1)
    b = net()
    # a source that stepped lm_head with Muon: ds_muon puts the head on AdamW
    named = cv.named_state(opt, a)
    named["lm_head.weight"] = {"momentum_buffer": torch.ones(16, 24)}
    muon = ds_muon_for(b)
    before = {k: dict(v) for k, v in muon.state.items()}
    with pytest.raises(ValueError, match="lm_head.weight takes AdamW .* Muon's state"):
        cv.load_named(muon, named)
    assert {k: dict(v) for k, v in muon.state.items()} == before
    with pytest.warns(UserWarning, match="lm_head.weight"):
        assert cv.load_named(muon, named, fresh=True) == ["lm_head.weight"]
    with pytest.raises(ValueError, match="up.weight momentum_buffer has shape \\[48, 24\\] .* is \\[40, 24\\]"):
        cv.build(other_net(), cv.Named(state=cv.named_state(opt, a)))


def test_find_muon_through_wrappers():
    model = net()
    muon = ds_muon_for(model)

    class Wrapper:  # accelerate's AcceleratedOptimizer and DeepSpeed's ZeRO optimizers keep it as .optimizer
        def __init__(self, inner):
            self.optimizer = inner

    assert ds_muon.find_muon(muon) is muon
    assert ds_muon.find_muon(Wrapper(Wrapper(muon))) is muon
    with pytest.raises(TypeError, match="no ds_muon.Muon inside AdamW"):
        ds_muon.find_muon(torch.optim.AdamW(model.parameters()))
    assert ds_muon.find_muon(object(), required=False) is None
    from ds_muon.accelerate import find_muon as accelerate_find_muon

    assert accelerate_find_muon(Wrapper(muon)) is muon


# -- DCP -------------------------------------------------------------------------------------------------------
def test_dcp_of_torch_muon_and_adamw_converts_and_resumes_bitwise(tmp_path):
    """A DCP checkpoint written with torch.optim.Muon + AdamW (``get_state_dict(model, [muon, adamw])``) → a ds_muon
    DCP checkpoint (``to="dcp"``) → loaded the documented way into ds_muon: state equal, next step bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with dist_harness.one_thread(), one_rank_group():
        a = net()
        pair = torch_pair(a)
        run(a, pair, 2)
        msd, osd = get_state_dict(a, list(pair))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "torch_dcp"))
        cv.convert(str(tmp_path / "torch_dcp"), str(tmp_path / "ours"), net(), to="dcp",
                   settings=dict(SETTINGS, **TORCH_NS))
        b = net()
        muon = ds_muon_for(b)
        msd, osd = get_state_dict(b, muon)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(tmp_path / "ours"))
        set_state_dict(b, muon, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _state_equal(muon, b, cv.named_state(list(pair), a))
        run(a, pair, 1, start=2)
        run(b, [muon], 1, start=2)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n


def test_dcp_of_another_model_refused_changing_nothing(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with one_rank_group():
        a = net()
        muon = ds_muon_for(a)
        run(a, [muon], 1)
        cv.write_dcp(a, muon, str(tmp_path / "ckpt"))
        b = other_net()
        opt = ds_muon_for(b)
        run(b, [opt], 1)
        before = ({n: p.detach().clone() for n, p in b.named_parameters()},
                  {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()})
        msd, osd = get_state_dict(b, opt)
        with pytest.raises(BaseException) as err:  # DCP's CheckpointException, gathered from every rank's plan
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))
        said = str(err.value) + "".join(map(str, getattr(err.value, "failures", {}).values()))
        assert "Size mismatch" in said and "model.up.weight" in said, said[:500]
    for n, p in b.named_parameters():
        assert torch.equal(p, before[0][n]), n
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(v, before[1][id(p)][k]), k
