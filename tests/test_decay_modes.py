"""Weight decay modes (``ds_muon.rules.decay``): the formulas in one process, and every stack bitwise.

``independent`` is ``p <- p * (1 - wd)`` (not tied to lr, as NVIDIA Emerging-Optimizers); ``cautious``
is ``p <- p * (1 - lr * wd)`` only where ``p * u >= 0`` (u: the update direction the step subtracts, the
orthogonalized result for Muon, the new first moment for AdamW; as dion's ``cautious_wd``).
One-process results are checked against references written here from those formulas (and the rule
itself against ``torch.where`` bitwise); resume from a state dict into a fresh optimizer is bitwise;
then one spawned W=2 job per stack (DDP, FSDP1 flat with mixed flat shards, FSDP2, ZeRO-2 from
``tests/fuzz_stacks.py``'s builders; ZeRO-3 and ZeRO-3 with the optimizer offloaded to the host
from ``tests/test_deepspeed.py``'s set-up, through the DsMuon JSON, with a DeepSpeed checkpoint
resume) runs every mode with fp32 and bf16 NS and must equal one process bitwise; overlap's
``apply_in_forward`` equals the plain step bitwise; team NS stays within test_team_ns's bound.
"""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
from torch import nn

import ds_muon
import dist_harness
from fuzz_models import Case, Leaf, ModelSpec, Settings, Stack, build_model
from fuzz_stacks import ZERO_ENV, run_case, run_reference

LR, WD, ADAM_LR, ADAM_WD, M, BETAS, EPS = 0.1, 0.3, 0.01, 0.2, 0.9, (0.9, 0.95), 1e-8


# -- one process against the formulas --------------------------------------------------------------
def _ns(x):
    return ds_muon.newton_schulz(x, dtype=torch.float32, method="auto")  # what Muon's default method runs


def _scale(shape):
    rows, cols = shape
    return math.sqrt(max(1.0, rows / cols))  # shape_scaling


def _reference(mode, p0, b0, grads, lrs):
    """Muon matrix ``p`` (momentum M, no Nesterov) and AdamW vector ``b``, from the formulas."""
    p, b = p0.clone(), b0.clone()
    buf = torch.zeros_like(p)
    m, v = torch.zeros_like(b), torch.zeros_like(b)
    for t, ((gp, gb), (lr, adam_lr)) in enumerate(zip(grads, lrs), start=1):
        gp = gp + WD * p if mode == "l2" else gp
        buf = M * buf + (1 - M) * gp
        o = _ns(buf)
        if mode == "decoupled":
            p = p * (1 - lr * WD)
        elif mode == "independent":
            p = p * (1 - WD)
        elif mode == "cautious":
            p = torch.where(p * o >= 0, p * (1 - lr * WD), p)
        p = p - lr * _scale(p.shape) * o
        m = BETAS[0] * m + (1 - BETAS[0]) * gb
        v = BETAS[1] * v + (1 - BETAS[1]) * gb * gb
        if mode in ("decoupled", "l2"):  # AdamW tensors decay decoupled under l2 (l2 is Muon's)
            b = b * (1 - adam_lr * ADAM_WD)
        elif mode == "independent":
            b = b * (1 - ADAM_WD)
        else:
            b = torch.where(b * m >= 0, b * (1 - adam_lr * ADAM_WD), b)
        b = b - adam_lr * (m / (1 - BETAS[0] ** t)) / ((v / (1 - BETAS[1] ** t)).sqrt() + EPS)
    return p, b


def _run(mode, p0, b0, grads, lrs):
    p, b = nn.Parameter(p0.clone()), nn.Parameter(b0.clone())
    opt = ds_muon.Muon([{"params": [p]}, {"params": [b], "use_muon": False, "lr": lrs[0][1], "weight_decay": ADAM_WD}],
                       lr=LR, momentum=M, nesterov=False, weight_decay=WD, weight_decay_mode=mode,
                       ns_dtype=torch.float32, adam_betas=BETAS, adam_eps=EPS, log_summary=False)
    for (gp, gb), (lr, adam_lr) in zip(grads, lrs):
        opt.param_groups[0]["lr"], opt.param_groups[1]["lr"] = lr, adam_lr  # a scheduler's change
        p.grad, b.grad = gp.clone(), gb.clone()
        opt.step()
    return p.detach(), b.detach()


def _data(seed=0, steps=3):
    g = torch.Generator().manual_seed(seed)
    p0, b0 = torch.randn(12, 5, generator=g), torch.randn(7, generator=g)
    grads = [(torch.randn(12, 5, generator=g), torch.randn(7, generator=g)) for _ in range(steps)]
    return p0, b0, grads


@pytest.mark.parametrize("mode", ["decoupled", "l2", "independent", "cautious"])
def test_one_process_equals_the_formula(mode):
    """Three steps with the lr changed between them (independent decay must not follow it); the
    Muon matrix and the AdamW tensor against the formulas above (tolerance: atol 1e-6, rtol 0)."""
    p0, b0, grads = _data()
    lrs = [(LR, ADAM_LR), (LR / 2, ADAM_LR / 4), (0.0, 0.0)]
    got_p, got_b = _run(mode, p0, b0, grads, lrs)
    want_p, want_b = _reference(mode, p0, b0, grads, lrs)
    torch.testing.assert_close(got_p, want_p, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_b, want_b, rtol=0, atol=1e-6)
    for m in {"decoupled", "l2", "independent", "cautious"} - {mode}:  # the references tell the modes apart
        p, b = _reference(m, p0, b0, grads, lrs)
        assert (p - want_p).abs().max() > 1e-4, m
        assert {m, mode} == {"decoupled", "l2"} or (b - want_b).abs().max() > 1e-4, m  # AdamW: l2 is decoupled


def test_independent_decay_is_not_scaled_by_lr_bitwise():
    """lr = 0: no update, and independent decay still multiplies by exactly (1 - wd); the others
    leave the weights alone."""
    p0, b0, grads = _data(steps=1)
    for mode, factor in (("independent", 1 - WD), ("decoupled", None), ("cautious", None)):
        p, b = _run(mode, p0, b0, grads, [(0.0, 0.0)])
        assert torch.equal(p, p0 * (1 - WD) if factor else p0), mode
        assert torch.equal(b, b0 * (1 - ADAM_WD) if factor else b0), mode


@pytest.mark.parametrize("agree", [True, False])
def test_cautious_is_decoupled_where_signs_agree_and_no_decay_where_not(agree):
    """Weights whose signs all agree with the update direction: cautious == decoupled, bitwise;
    all disagreeing: cautious == no decay, bitwise (the sign convention: decay where p * u >= 0)."""
    g = torch.Generator().manual_seed(3)
    gp, gb = torch.randn(12, 5, generator=g), torch.randn(7, generator=g)
    o = _ns((1 - M) * gp)  # the first step's direction (momentum from zero, no Nesterov)
    sign = 1 if agree else -1
    p0 = sign * torch.sign(o) * (torch.rand(12, 5, generator=g) + 0.5)
    b0 = sign * torch.sign(gb) * (torch.rand(7, generator=g) + 0.5)  # m_1 = (1 - beta1) g: the sign of g
    got = _run("cautious", p0, b0, [(gp, gb)], [(LR, ADAM_LR)])
    if agree:
        want = _run("decoupled", p0, b0, [(gp, gb)], [(LR, ADAM_LR)])
    else:
        p, b = nn.Parameter(p0.clone()), nn.Parameter(b0.clone())
        opt = ds_muon.Muon([{"params": [p]}, {"params": [b], "use_muon": False, "lr": ADAM_LR}], lr=LR, momentum=M,
                           nesterov=False, ns_dtype=torch.float32, adam_betas=BETAS, adam_eps=EPS, log_summary=False)
        p.grad, b.grad = gp.clone(), gb.clone()
        opt.step()
        want = (p.detach(), b.detach())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 12), nn.Linear(12, 4))


def _steps(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(5, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode", ["independent", "cautious"])
def test_resume_bitwise(mode):
    """State saved after 2 steps, loaded into a fresh optimizer built with the default mode (the
    saved groups carry the mode), 2 more steps: equal to 4 steps without the break."""
    def build(model, m):
        return ds_muon.Muon(ds_muon.muon_param_groups(model, weight_decay=0.1, adam_weight_decay=0.05),
                            weight_decay_mode=m, log_summary=False)
    whole = _model()
    opt = build(whole, mode)
    _steps(whole, opt, 2, 0)
    _steps(whole, opt, 2, 1)
    first = _model()
    opt = build(first, mode)
    _steps(first, opt, 2, 0)
    saved = copy.deepcopy(opt.state_dict())
    second = copy.deepcopy(first)
    opt2 = build(second, "decoupled")
    opt2.load_state_dict(saved)
    assert {g["weight_decay_mode"] for g in opt2.param_groups} == {mode}
    _steps(second, opt2, 2, 1)
    for (n, a), b in zip(whole.named_parameters(), second.parameters()):
        assert torch.equal(a, b), n


# -- bad values: a clear error naming the key, before anything changes -------------------------------
def test_bad_modes_are_refused_naming_the_key():
    model = _model()
    with pytest.raises(ValueError, match=r"param_groups\[0\]: weight_decay_mode='L2' is unknown; use one of "
                                         r"\['decoupled', 'l2', 'independent', 'cautious'\]"):
        ds_muon.Muon(ds_muon.muon_param_groups(model), weight_decay_mode="L2")
    groups = ds_muon.muon_param_groups(model)
    groups[1]["weight_decay_mode"] = "cautius"  # an AdamW group decays by its mode too: checked there
    with pytest.raises(ValueError, match=r"param_groups\[1\]: weight_decay_mode='cautius' is unknown"):
        ds_muon.Muon(groups)
    with pytest.raises(ValueError, match=r"weight_decay=1.5 with weight_decay_mode='independent'"):
        ds_muon.Muon(ds_muon.muon_param_groups(model, weight_decay=1.5), weight_decay_mode="independent")
    with pytest.raises(ValueError, match=r"param_groups\[0\]: adam_weight_decay=1.0 with weight_decay_mode"):
        ds_muon.Muon([{"params": [model[0].weight], "adam_weight_decay": 1.0}], weight_decay_mode="independent")
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, weight_decay=0.1), weight_decay_mode="cautious")
    model(torch.randn(2, 8)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["weight_decay_mode"] = ["cautious"]  # edited between steps
    with pytest.raises(ValueError, match=r"param_groups\[0\]: weight_decay_mode=\['cautious'\] is unknown"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state


# -- every stack, bitwise ---------------------------------------------------------------------------------
MODEL = ModelSpec(((Leaf("linear", (12, 8), bias=True), Leaf("norm", (12,))),
                   (Leaf("linear", (17, 12)), Leaf("embed", (9, 5))),
                   (Leaf("linear", (5, 17), bias=True), Leaf("head", (4, 5)))))
# (mode, NS dtype, overlap, more Muon settings): every mode, fp32 and bf16 NS for the new ones,
# overlapped waves twice; and, once Muon has NorMuon (the NorMuon engineer's), the new modes with it
# (cautious reads the sign of the result NorMuon has normalized)
CASES = [("independent", torch.float32, False, ()), ("independent", torch.bfloat16, True, ()),
         ("cautious", torch.float32, True, ()), ("cautious", torch.bfloat16, False, ()),
         ("decoupled", torch.bfloat16, False, ()), ("l2", torch.float32, False, ())]
if "variant" in inspect.signature(ds_muon.Muon.__init__).parameters:
    CASES += [("cautious", torch.bfloat16, True, (("variant", "normuon"),)),
              ("independent", torch.float32, False, (("variant", "normuon"),))]
STACKS = {"ddp": Stack("ddp", 2), "fsdp2": Stack("fsdp2", 2, (("wrap_units", (0, 2)), ("reshard_after_forward", True))),
          "fsdp1": Stack("fsdp1", 2, (("use_orig_params", False), ("nested", True))),  # mixed flat shards
          "zero2": Stack("zero", 2, (("stage", 2),))}


def decay_case(index: int, stack: Stack) -> Case:
    mode, ns_dtype, overlap, more = CASES[index]
    muon = (("momentum", 0.9), ("nesterov", True), ("weight_decay_mode", mode), ("ns_steps", 5),
            ("ns_coefficients", "keller"), ("ns_method", "standard"), ("ns_dtype", ns_dtype),
            ("scale_mode", "shape_scaling"), ("extra_scale_factor", 1.0), ("adam_betas", (0.9, 0.95)),
            ("adam_eps", 1e-8)) + more
    equivalent = ()
    if overlap:
        equivalent = (("overlap", True), ("waves", 2), ("dispatch_in_backward", stack.kind != "zero"))
    settings = Settings(muon=muon, equivalent=equivalent, lr=0.05, adam_lr=3e-3, weight_decay=0.1,
                        adam_weight_decay=0.05)
    return Case(28, index, MODEL, settings, stack)


def _stack_worker(rank, world, name):
    out = [run_case(decay_case(i, STACKS[name])) for i in range(len(CASES))]
    if name == "ddp":  # the mode is one of the settings every rank must agree on
        model = _model()
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model, weight_decay=0.1),
                           weight_decay_mode=("cautious", "independent")[rank], log_summary=False)
        model(torch.randn(2, 8)).sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt.step()
            out.append(None)
        except ValueError as e:
            out.append((str(e), all(torch.equal(a, b) for a, b in zip(before, model.parameters()))))
    return out


def _check_against_reference(name, per_rank):
    failures = []
    for i in range(len(CASES)):
        case = decay_case(i, STACKS[name])
        ref = run_reference(case)
        moved = [n for n, p in ref["params"].items() if not torch.equal(p, build_model(MODEL, case.model_seed)
                                                                         .state_dict()[n])]
        assert len(moved) == len(ref["params"]), f"{case.describe()}: a tensor did not move"
        for rank, results in enumerate(per_rank):
            got = results[i]
            assert got["roundtrip"] is None, (case.describe(), got["roundtrip"])
            bad = [n for n, w in ref["params"].items() if not torch.equal(got["params"][n], w)]
            if bad:
                failures.append(f"{CASES[i]} rank {rank}: {bad}")
    assert not failures, f"{name}: not bitwise one process:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", list(STACKS))
def test_stack_bitwise_equals_one_process(name):
    """One spawn per stack: every mode (CASES) against one process, bitwise (FSDP1: flat shards
    mixing Muon rows and AdamW slices, so the slices' decay runs too; overlap waves in two cases)."""
    if name == "zero2":
        pytest.importorskip("deepspeed")
    per_rank = dist_harness.run(_stack_worker, 2, name, timeout=300, env=ZERO_ENV if name == "zero2" else None)
    _check_against_reference(name, per_rank)
    if name == "ddp":  # ranks with other modes: refused on every rank, naming the setting, nothing changed
        for results in per_rank:
            msg, unchanged = results[len(CASES)]
            assert unchanged and "param_groups[0]['weight_decay_mode'] is 'cautious' on rank 0, 'independent' on " \
                                 "rank 1" in msg, msg


def test_apply_in_forward_bitwise_equals_the_step():
    """Overlap's deferred apply (updates landed in the next forward's pre-hooks) under each new mode:
    the cautious mask is read on the weight as the step left it, so the result is the plain step's."""
    single = Stack("single", 1)
    for i in range(4):
        base = decay_case(i, single)
        case = Case(base.seed, base.index, base.model,
                    Settings(base.settings.muon, (("overlap", True), ("apply_in_forward", True), ("waves", 2)),
                             base.settings.lr, base.settings.adam_lr, base.settings.weight_decay,
                             base.settings.adam_weight_decay), single)
        ref = run_reference(case)
        with dist_harness.one_thread():
            got = run_case(case)
        for n, w in ref["params"].items():
            assert torch.equal(got["params"][n], w), (CASES[i], n)


# -- ZeRO-3 (and ZeRO-3 offloaded to the host) through the DsMuon JSON --------------------------------
Z3_CASES = [(mode, dtype, False) for mode, dtype, _, more in CASES if not more] + [("cautious", "bfloat16", True),
                                                                  ("independent", "float32", True)]


def _z3_params(mode, dtype):
    from test_deepspeed import PARAMS

    return dict(PARAMS, weight_decay=0.1, adam_weight_decay=0.05, weight_decay_mode=mode,
                ns_dtype=str(dtype).replace("torch.", ""))


def _zero3_worker(rank, world, path):
    from test_deepspeed import ds_config, full_fp32, make_model, train

    from ds_muon import deepspeed as ds_muon_deepspeed

    out = []
    for mode, dtype, offload in Z3_CASES:
        cfg = ds_config(3, params=_z3_params(mode, dtype))
        if offload:
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=cfg)
        train(engine, 3)
        modes = sorted({g["weight_decay_mode"] for g in engine.basic_optimizer.param_groups})
        out.append((full_fp32(engine), modes))
    # resume: DeepSpeed's checkpoint after 2 steps, loaded into a fresh engine (other initial weights)
    # built from a JSON with the default mode: the checkpoint's groups bring the mode back
    mode, dtype, _ = Z3_CASES[3]
    engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=ds_config(3, params=_z3_params(mode, dtype)))
    train(engine, 2)
    engine.save_checkpoint(path, tag="t2")
    torch.manual_seed(123)
    other = type(make_model())()
    engine2, _, _, _ = ds_muon_deepspeed.initialize(model=other, config=ds_config(3, params=_z3_params("decoupled", dtype)))
    engine2.load_checkpoint(path, tag="t2")
    modes = sorted({g["weight_decay_mode"] for g in engine2.basic_optimizer.param_groups})
    train(engine2, 1, start=2)
    return out, (full_fp32(engine2), modes)


def test_zero3_and_offload_bitwise_equals_one_process(tmp_path):
    """ZeRO-3 through the DsMuon JSON, every mode (CASES) and two offloaded to the host, against one process
    built from the same JSON params, bitwise; then a DeepSpeed checkpoint resume (cautious, bf16 NS) into a
    fresh engine whose JSON says decoupled: the checkpoint's groups carry the mode, steps 3.. bitwise."""
    pytest.importorskip("deepspeed")
    from test_deepspeed import ENV, reference

    per_rank = dist_harness.run(_zero3_worker, 2, str(tmp_path), timeout=400, env=ENV)
    for k, (mode, dtype, offload) in enumerate(Z3_CASES):
        want = reference(_z3_params(mode, dtype))
        for rank, (results, _) in enumerate(per_rank):
            got, modes = results[k]
            assert modes == [mode], (mode, modes)  # the JSON's mode reached every group
            bad = [n for n, w in want.items() if not torch.equal(got[n], w)]
            assert not bad, f"ZeRO-3{' offload' if offload else ''} {mode} {dtype} rank {rank}: {bad}"
    mode, dtype, _ = Z3_CASES[3]
    want = reference(_z3_params(mode, dtype))  # 3 steps straight
    for rank, (_, (got, modes)) in enumerate(per_rank):
        assert modes == [mode], modes
        bad = [n for n, w in want.items() if not torch.equal(got[n], w)]
        assert not bad, f"ZeRO-3 resume {mode} rank {rank}: {bad}"



# -- team NS: a matrix orthogonalized by two ranks, its holders' pieces decayed where they live -----------
TEAM_MODES = ("independent", "cautious")


def _team_opts(mode):
    from test_team_ns import FORCE

    return dict(lr=0.05, momentum=0.9, ns_dtype=torch.float32, ns_method="standard", cost_model=FORCE,
                weight_decay=0.2, weight_decay_mode=mode, log_summary=False)  # teams run the standard iteration


def _team_worker(rank, world):
    """test_team_ns's uneven flat partitions (matrices split across both ranks), the planner forced to team."""
    from ds_muon.engine.exchange.layout import ParamBinding, slots_in_range
    from models import HandAdapter
    from test_team_ns import _flat_partition, _grads

    mats, offsets, lo, hi = _flat_partition(rank, world)
    out = []
    for mode in TEAM_MODES:
        local = nn.Parameter(torch.cat([m.reshape(-1) for m in mats])[lo:hi].clone())
        local._ds_muon_flat = True

        def describe(p, name, context):
            return ParamBinding(p, lambda t: t.reshape(-1), slots_in_range(offsets, lo, hi))

        opt = ds_muon.Muon([{"params": [local]}], adapter=HandAdapter(describe), **_team_opts(mode))
        local.grad = torch.cat([g.reshape(-1) for g in _grads()])[lo:hi].clone()
        opt.step()
        out.append(((lo, hi), local.detach().clone(), sorted(m.key for m in opt.summary().matrices if m.team)))
    return out


def test_team_ns_decays_each_holders_piece():
    """Not bitwise (team NS never is): the teamed matrices' steps within test_team_ns's fp32 bound of the
    one-home step, every other matrix bitwise; the decay itself is each holder's (elementwise) work."""
    from test_team_ns import BOUND, SHAPES, _grads, _initial

    per_rank = dist_harness.run(_team_worker, 2, timeout=240)
    p0 = torch.cat([m.reshape(-1) for m in _initial()])
    spans, at = [], 0
    for s in SHAPES:
        spans.append((at, at + torch.Size(s).numel()))
        at += spans[-1][1] - spans[-1][0]
    for k, mode in enumerate(TEAM_MODES):
        with dist_harness.one_thread():
            mats = [nn.Parameter(m) for m in _initial()]
            opt = ds_muon.Muon([{"params": mats}], **_team_opts(mode))
            for p, g in zip(mats, _grads()):
                p.grad = g
            opt.step()
            home = torch.cat([m.detach().reshape(-1) for m in mats]) - p0
        full = torch.empty_like(p0)
        for result in per_rank:
            (lo, hi), piece, teams = result[k]
            full[lo:hi] = piece
        team = full - p0
        assert "m0" in teams, teams
        for i, (a, z) in enumerate(spans):
            if f"m{i}" in teams:
                assert float((team[a:z] - home[a:z]).norm() / home[a:z].norm()) <= BOUND[torch.float32], (mode, i)
            else:
                assert torch.equal(team[a:z], home[a:z]), (mode, i)


# -- the rule itself, on tensors -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("factor", [1 - 0.02 * 0.1, 1 - 0.7])  # the fast multiplier, and the select (< 0.5)
def test_cautious_decay_rule_bitwise(dtype, factor):
    """``decay_`` with Cautious against torch.where written here: mixed signs, zeros on either side (they
    count as agreeing), every sign agreeing (== decoupled's multiply) and none (== untouched), results in
    bf16 and in the weights' dtype."""
    from ds_muon.rules.decay import Cautious, decay_

    g = torch.Generator().manual_seed(7)
    p = torch.randn(300, generator=g).to(dtype)
    p[:5] = 0
    for u in (torch.randn(300, generator=g).bfloat16(), torch.randn(300, generator=g).to(dtype)):
        u = u.clone()
        u[5:10] = 0
        for case in ("mixed", "agree", "disagree"):
            w = p.clone() if case == "mixed" else (p.abs() + 0.5) * (1 if case == "agree" else -1) * torch.sign(
                u.float()).to(dtype).where(u != 0, torch.ones((), dtype=dtype))
            got = [w.clone()]
            decay_(got, [u], Cautious(factor))
            decayed = [w.clone()]
            torch._foreach_mul_(decayed, factor)  # decoupled decay's multiply (in place; bf16 rounds the factor)
            want = torch.where(w.double() * u.double() >= 0, decayed[0], w)
            assert torch.equal(got[0], want), (case, u.dtype)
            if case == "agree":
                assert torch.equal(got[0], decayed[0])
            if case == "disagree":  # untouched but where u is 0 (zero counts as agreeing)
                assert torch.equal(got[0][u != 0], w[u != 0]) and torch.equal(got[0][u == 0], decayed[0][u == 0])


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("mode", ["decoupled", "independent"])
def test_adamw_rule_bitwise_equals_torch_adamw(mode, foreach):
    """``rules.adamw.adamw_`` on tensor lists, three steps: torch.optim.AdamW bitwise (``independent``: the
    weights times ``1 - wd`` first, then torch's AdamW without decay, as the formula says)."""
    from ds_muon.rules.adamw import adamw_

    g = torch.Generator().manual_seed(3)
    ours = [torch.randn(5, 4, generator=g), torch.randn(7, generator=g)]
    ref = [nn.Parameter(t.clone()) for t in ours]
    moments = [(torch.zeros_like(t), torch.zeros_like(t), torch.tensor(0.0)) for t in ours]
    torch_opt = torch.optim.AdamW(ref, lr=ADAM_LR, betas=BETAS, eps=EPS, foreach=foreach,
                                  weight_decay=ADAM_WD if mode == "decoupled" else 0.0)
    for _ in range(3):
        grads = [torch.randn(t.shape, generator=g) for t in ours]
        adamw_(ours, grads, [m[0] for m in moments], [m[1] for m in moments], [m[2] for m in moments], lr=ADAM_LR,
               betas=BETAS, eps=EPS, weight_decay=ADAM_WD, weight_decay_mode=mode, foreach=foreach)
        with torch.no_grad():
            for p, gr in zip(ref, grads):
                p.grad = gr.clone()
                if mode == "independent":
                    p.mul_(1 - ADAM_WD)
        torch_opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(ours, ref))
