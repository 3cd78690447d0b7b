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

from conftest import FAST_NS_DTYPE

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
    ns_kw = dict(steps=5, coefficients="keller", dtype=torch.float32, eps=1e-7, method="auto")  # Muon's default method
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
    kw = dict(variant="normuon", normuon_beta2=0.8, ns_dtype=FAST_NS_DTYPE)  # resume, not dtypes
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


def _lost_moment_worker(rank, world):
    """W=2 DDP-like (every rank holds every matrix, one home each): save after 2 steps, load into fresh
    optimizers where rank 0's dict has no v at all (as FSDP1's ``optim_state_dict_to_load`` gives a rank
    holding none of a tensor), step 3 again; returns both runs' parameters and v."""
    torch.manual_seed(0)
    a, b = Net(), Net()  # (a deepcopy would lose the transposed tag: torch's Parameter copy drops attributes)
    grads = _grads(a, 3)
    kw = dict(variant="normuon", normuon_beta2=0.8)
    opt_a = _train(a, grads, 2, **kw)
    saved = copy.deepcopy(opt_a.state_dict())
    b.load_state_dict(a.state_dict())
    for model, opt in ((a, opt_a), (b, None)):
        if opt is None:
            opt = ds_muon.Muon(_groups(b), log_summary=False, **kw)
            if rank == 0:
                for st in saved["state"].values():
                    st.pop(KEY, None)
            opt.load_state_dict(saved)
            opt_b = opt
        for n, p in model.named_parameters():
            p.grad = grads[2][n].clone()
        opt.step()
    return ({n: p.detach().clone() for n, p in a.named_parameters()},
            {n: p.detach().clone() for n, p in b.named_parameters()},
            [opt_b.state[p][KEY].clone() for p in opt_b.param_groups[0]["params"]],
            [opt_a.state[p][KEY].clone() for p in opt_a.param_groups[0]["params"]])


def test_a_rank_that_loaded_no_moment_takes_the_saved_one():
    """After a load where one rank got no v (zeros made anew), the next step is still the uninterrupted
    one on every rank, bitwise: the ranks agree on v (the max, exact: v >= 0) before the first NS after
    the load, so a home that lost its v does not normalize with zeros (fails without that agreement)."""
    import dist_harness

    per_rank = dist_harness.run(_lost_moment_worker, 2, timeout=120)
    for rank in range(2):
        want, got, v_got, v_want = per_rank[rank]
        for n in want:
            assert torch.equal(got[n], want[n]), (rank, n)
        for x, y in zip(v_got, v_want):
            assert torch.equal(x, y), rank


def test_rule_invariants_on_drawn_matrices():
    """rules/normuon.normalize on 40 seeded shapes (1-wide, tall, wide), dtypes and β₂: the result keeps
    O's Frobenius norm and dtype; with β₂ = 0 every row ends with the same RMS (the paper's aim); an
    [in, out] matrix is its transpose's update transposed; v is not written; a zero O (a step with zero
    gradients, as DeepSpeed's first) stays zero without NaN."""
    from ds_muon.rules.normuon import normalize

    rng = random.Random(7)
    for _ in range(40):
        m, n = rng.choice((1, 2, 5, 16, 33)), rng.choice((1, 3, 8, 24))
        dtype = rng.choice((torch.float32, torch.bfloat16))
        beta2 = rng.choice((0.0, 0.5, 0.95))
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        o = (torch.randn(m, n, generator=g) * torch.rand(m, 1, generator=g) * 3).to(dtype)
        v = torch.rand(m, generator=g)
        v0 = v.clone()
        out, v_new = normalize(o, v, beta2)
        assert out.dtype == dtype and out.shape == o.shape and torch.equal(v, v0)
        torch.testing.assert_close(v_new.double(), beta2 * v0.double() + (1 - beta2) * o.double().square().mean(1),
                                   rtol=1e-5, atol=1e-7)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert abs(float(out.double().norm() / o.double().norm()) - 1) < tol
        if beta2 == 0.0 and dtype == torch.float32:
            rms = normalize(o, torch.zeros(m), 0.0)[0].double().square().mean(1).sqrt()
            torch.testing.assert_close(rms, rms.mean().expand(m), rtol=1e-4, atol=0)
        t_out, t_v = normalize(o.t().contiguous(), v, beta2, transposed=True)
        torch.testing.assert_close(t_out.t().float(), out.float(), rtol=1e-5 if dtype == torch.float32 else 2e-2,
                                   atol=1e-6)
        torch.testing.assert_close(t_v, v_new, rtol=1e-5, atol=1e-7)
        zero, vz = normalize(torch.zeros(m, n, dtype=dtype), v, beta2)
        assert torch.equal(zero, torch.zeros_like(zero)) and not vz.isnan().any()


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
    normuon = {"variant": "normuon"} if key == "normuon_beta2" else {}  # (beta2 on variant="muon": refused as such)
    groups = [{"params": [model[0].weight]}, {"params": [model[1].weight], key: value, **normuon}]
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
    """A loaded v of the wrong length (another model's) is refused at load, naming the tensor and the key,
    with the state unchanged (issue 33: what the step would refuse); set into the state directly it raises
    at the step with every tensor unchanged; a non-1-D one is refused at load."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=True))
    opt = _train(model, _grads(model, 1), 1, variant="normuon")
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0][KEY] = torch.zeros(5)
    kept = opt.state[model[0].weight][KEY].clone()
    with pytest.raises(ValueError, match=r"0\.weight.*'normuon_v'.*shape \(6,\).*nothing was loaded"):
        opt.load_state_dict(sd)
    assert torch.equal(opt.state[model[0].weight][KEY], kept)
    opt.state[model[0].weight][KEY] = torch.zeros(5)
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


# -- every stack at W=2, bitwise equal to one process --------------------------------------------
# Fuzz cases (tests/fuzz_models.py: drawn models with conv weights, expert stacks, tied weights,
# empty and 1-wide matrices; drawn settings with overlap/waves/backward dispatch, duplicated mode
# and every planner) made NorMuon: variant="normuon", a drawn normuon_beta2, NS in fp32 for even
# cases and bf16 for odd ones; a second group (where drawn) sometimes stays plain Muon.

SEED = 0
CASES_PER_STACK = 4
STACKS = ["ddp", "fsdp2", "fsdp1", "zero"]


def normuon_case(index: int, kind: str, world: int):
    from dataclasses import replace

    from fuzz_models import draw_case

    case = draw_case(SEED, index, kind, world)
    rng = random.Random(f"normuon/{SEED}/{index}/{kind}/{world}")
    muon = dict(case.settings.muon)
    muon.update(variant="normuon", normuon_beta2=rng.choice((0.95, 0.5, 0.0)),
                ns_dtype=torch.float32 if index % 2 == 0 else torch.bfloat16)
    if muon["ns_method"] == "gram" and muon["ns_dtype"] == torch.bfloat16:
        muon["ns_method"] = "standard"  # as draw_settings (fuzz_models: gram in bf16 is not batch-invariant)
    second = case.second_group
    if second:
        second = tuple((k, "float32" if k == "ns_dtype" and muon["ns_method"] == "gram" else v) for k, v in second)
        second += (("variant", rng.choice(("muon", "normuon"))),)
    stack = case.stack
    if kind == "zero":  # ZeRO-2 in three of four cases (the draw picks stage 1 a third of the time)
        stack = replace(stack, options=(("stage", 1 if index == 3 else 2),))
    return replace(case, settings=replace(case.settings, muon=tuple(muon.items())), second_group=second, stack=stack)


def _moments(opt, flat: bool):
    """NorMuon's v of every tensor: by name, or (flat shards) in the optimizer's order."""
    if flat:
        return [opt.state[p][KEY].clone() for g in opt.param_groups for p in g["params"]
                if KEY in opt.state.get(p, {})]
    return {n[len("module."):] if n.startswith("module.") else n: opt.state[p][KEY].clone()
            for g in opt.param_groups for n, p in zip(g["param_names"], g["params"]) if KEY in opt.state.get(p, {})}


def _run_with_moments(case):
    """fuzz_stacks.run_case, plus the moments every rank holds at the end."""
    from fuzz_stacks import run_case

    return run_case(case, extra=lambda opt, flat: {"moments": _moments(opt, flat)})


def _stack_worker(rank, world, kind, indices):
    import traceback

    import torch.distributed as dist

    out = []
    for index in indices:
        try:
            res = _run_with_moments(normuon_case(index, kind, world))
        except Exception:  # noqa: BLE001 - reported per case by the parent
            res = {"error": traceback.format_exc(limit=8)}
        dist.barrier()
        out.append(res)
    return out


def _reference_with_moments(case):
    from fuzz_stacks import run_reference

    return run_reference(case, extra=lambda opt: {"moments": _moments(opt, False)})


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", STACKS)
def test_stacks_bitwise_with_one_process(kind):
    """DDP, FSDP2, FSDP1 (flat or orig params, nested or not) and ZeRO-1/2 at W=2: every rank's
    parameters ``torch.equal`` to one process, the same state keys everywhere (``normuon_v``
    included), a lossless state_dict round trip after step 2, and every rank holding the home's v
    bitwise (by name where the stack keeps names: equal to one process's too)."""
    pytest.importorskip("deepspeed") if kind == "zero" else None
    import dist_harness
    from fuzz_stacks import ZERO_ENV
    from test_fuzz import _check, _report

    indices = list(range(CASES_PER_STACK))
    results = dist_harness.run(_stack_worker, 2, kind, indices, timeout=360, env=ZERO_ENV)
    failures, steps_normuon = [], 0
    for pos, index in enumerate(indices):
        case = normuon_case(index, kind, 2)
        per_rank = [results[r][pos] for r in range(2)]
        ref = _reference_with_moments(case)
        lines = _check(case, per_rank, ref)
        for r, res in enumerate(per_rank):
            if "error" in res:
                continue
            mine, first = res["moments"], per_rank[0].get("moments")
            if isinstance(mine, dict):
                if sorted(mine) != sorted(ref["moments"]):
                    lines.append(f"rank {r}: v of {sorted(mine)} != reference {sorted(ref['moments'])}")
                lines += [f"rank {r}: v of {n} differs from one process" for n in mine
                          if n in ref["moments"] and not torch.equal(mine[n], ref["moments"][n])]
            else:
                if len(mine) != len(first) or not all(torch.equal(a, b) for a, b in zip(mine, first)):
                    lines.append(f"rank {r}: flat v differs from rank 0's")
                if not mine:
                    lines.append(f"rank {r}: no normuon_v")
            steps_normuon += bool(mine)
        if lines:
            failures.append((case, lines))
    assert not failures, _report(failures)
    assert steps_normuon == 2 * len(indices)


# -- ZeRO-3 (test_deepspeed's set-up) and DeepSpeed checkpoints ------------------------------------
NORMUON_PARAMS = {"variant": "normuon", "normuon_beta2": 0.9}


def _zero_worker(rank, world, root, runs):
    """Each run ``(stage, ns_dtype, resume)``: 3 steps through the DsMuon JSON; with ``resume``,
    ``save_checkpoint`` after step 2 and a fresh engine ``load_checkpoint`` takes step 3 again."""
    import os

    from ds_muon import deepspeed as ds_muon_deepspeed
    from test_deepspeed import PARAMS, ds_config, full_fp32, make_model, train

    out = {}
    for stage, ns, resume in runs:
        params = dict(PARAMS, ns_dtype=ns, **NORMUON_PARAMS)
        engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=ds_config(stage, params=params))
        train(engine, 2)
        path = os.path.join(root, f"z{stage}_{ns}")
        if resume:
            engine.save_checkpoint(path, tag="k")
        train(engine, 1, start=2)
        moments = [s[KEY].clone() for s in engine.basic_optimizer.state.values() if KEY in s]
        res = {"params": full_fp32(engine), "moments": moments}
        if resume:
            again, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=ds_config(stage, params=params))
            again.load_checkpoint(path, tag="k")
            loaded = [s[KEY].clone() for s in again.basic_optimizer.state.values() if KEY in s]
            train(again, 1, start=2)
            res.update(resumed=full_fp32(again), loaded_moments=len(loaded))
        out[(stage, ns, resume)] = res
    return out


def _zero_universal_worker(rank, world, root, runs):
    """Load each run's universal checkpoint (``"load_universal": true``) into a fresh engine, take step 3."""
    import os

    from ds_muon import deepspeed as ds_muon_deepspeed
    from test_deepspeed import PARAMS, ds_config, full_fp32, make_model, train

    out = {}
    for stage, ns in runs:
        cfg = ds_config(stage, params=dict(PARAMS, ns_dtype=ns, **NORMUON_PARAMS))
        cfg["checkpoint"] = {"load_universal": True}
        engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=cfg)
        engine.load_checkpoint(os.path.join(root, f"z{stage}_{ns}"), tag="k_universal")
        moments = sum(1 for s in engine.basic_optimizer.state.values() if KEY in s)
        train(engine, 1, start=2)
        out[(stage, ns)] = (full_fp32(engine), moments)
    return out


@pytest.mark.timeout(400)
def test_zero3_bitwise_and_deepspeed_checkpoint_resume(tmp_path):
    """ZeRO-3 at W=2, NS in fp32 and bf16: the fp32 master weights ``torch.equal`` to one process
    (NorMuon through the DsMuon JSON), both ranks holding the same v; ZeRO-3 (bf16 NS) and ZeRO-2
    (fp32 NS) ``save_checkpoint`` after step 2, ``load_checkpoint`` into a fresh engine: step 3 is
    bitwise the uninterrupted run's (v came back: a zero v would change it); and both checkpoints, converted
    with ``zero_to_universal``, load at W=1 (``"load_universal": true``) and step 3 is bitwise W=2's."""
    pytest.importorskip("deepspeed")
    import dist_harness
    from test_deepspeed import ENV, PARAMS, reference

    runs = [(3, "float32", False), (3, "bfloat16", True), (2, "float32", True)]
    results = dist_harness.run(_zero_worker, 2, str(tmp_path), runs, timeout=360, env=ENV)
    plain = reference(dict(PARAMS, ns_dtype="float32"))
    for run in runs:
        want = reference(dict(PARAMS, ns_dtype=run[1], **NORMUON_PARAMS))
        for rank, res in enumerate(r[run] for r in results):
            for name, w in want.items():
                assert torch.equal(res["params"][name], w), (run, rank, name)
                if run[2]:
                    assert torch.equal(res["resumed"][name], w), (run, rank, name, "resumed")
            assert res["moments"] and len(res["moments"]) == len(results[0][run]["moments"]), (run, rank)
            assert all(torch.equal(a, b) for a, b in zip(res["moments"], results[0][run]["moments"])), (run, rank)
            if run[2]:
                assert res["loaded_moments"] == len(res["moments"]), (run, rank)
    assert not torch.equal(plain["up.weight"], reference(dict(PARAMS, ns_dtype="float32", **NORMUON_PARAMS))["up.weight"])
    # the universal conversion (one normuon_v file per flat partition beside zero/), loaded at W=1: step 3
    # bitwise the W=2 run's (the W=2 gradient is the mean of two equal ones: exact)
    from ds_muon.integrations.deepspeed_universal import zero_to_universal
    resumed = [(stage, ns) for stage, ns, resume in runs if resume]
    for stage, ns in resumed:
        src = tmp_path / f"z{stage}_{ns}"
        zero_to_universal(str(src / "k"), str(src / "k_universal"))
        assert (src / "k_universal" / "normuon_v").is_dir()
        assert not any((src / "k_universal" / "zero").glob("*/normuon_v.pt"))  # never as a per-element file
    (at_one,) = dist_harness.run(_zero_universal_worker, 1, str(tmp_path), resumed, timeout=240, env=ENV)
    for stage, ns in resumed:
        got, moments = at_one[(stage, ns)]
        assert moments > 0, (stage, ns)
        for name, w in results[0][(stage, ns, True)]["params"].items():
            assert torch.equal(got[name], w), (stage, ns, name, "universal at W=1")


def test_convert_carries_the_moment_by_name():
    """ds_muon.convert gives each tensor its v by name (another optimizer over the same model), float32."""
    from ds_muon.convert import load_named, named_state

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Linear(8, 5, bias=False)).to(torch.bfloat16)
    opt = _train(model, _grads(model, 2), 2, variant="normuon")
    named = named_state(copy.deepcopy(opt.state_dict()))
    fresh = ds_muon.Muon(_groups(model), log_summary=False, variant="normuon")
    load_named(fresh, named)
    for p in model.parameters():
        assert fresh.state[p][KEY].dtype == torch.float32 and torch.equal(fresh.state[p][KEY], opt.state[p][KEY])


# -- team NS never takes a NorMuon matrix --------------------------------------------------------------
def _team_worker(rank, world):
    """test_team_ns's flat partitions and cost model (which team the large matrices): per variant,
    the teams the plan made and this rank's result."""
    from models import HandAdapter
    from test_team_ns import _flat_partition, _grads, _opts
    from ds_muon.engine.exchange.layout import ParamBinding, slots_in_range

    mats, offsets, lo, hi = _flat_partition(rank, world)
    out = {}
    for variant in ("muon", "normuon"):
        local = nn.Parameter(torch.cat([m.reshape(-1) for m in mats])[lo:hi].clone())
        local._ds_muon_flat = True
        adapter = HandAdapter(lambda p, name, context: ParamBinding(p, lambda t: t.reshape(-1),
                                                                    slots_in_range(offsets, lo, hi)))
        opt = ds_muon.Muon([{"params": [local]}], adapter=adapter, variant=variant, **_opts(torch.float32))
        local.grad = torch.cat([g.reshape(-1) for g in _grads()])[lo:hi].clone()
        opt.step()
        out[variant] = ((lo, hi), local.detach().clone(), {m.key: m.homes for m in opt.summary().matrices if m.team})
    # ranks that disagree on the variant (or beta2) fail the step's agreement on every rank, unchanged
    for key, mine in (("variant", "normuon" if rank else "muon"), ("normuon_beta2", 0.9 if rank else 0.95)):
        local = nn.Parameter(torch.cat([m.reshape(-1) for m in mats])[lo:hi].clone())
        local._ds_muon_flat = True
        adapter = HandAdapter(lambda p, name, context: ParamBinding(p, lambda t: t.reshape(-1),
                                                                    slots_in_range(offsets, lo, hi)))
        variant = {"variant": "normuon"} if key == "normuon_beta2" else {}  # (beta2 is read by NorMuon alone)
        opt = ds_muon.Muon([{"params": [local], key: mine, **variant}], adapter=adapter, **_opts(torch.float32))
        local.grad = torch.ones_like(local)
        before = local.detach().clone()
        try:
            opt.step()
            out[key] = None
        except ValueError as e:
            out[key] = (str(e), torch.equal(before, local.detach()))
    return out


def test_team_ns_leaves_normuon_matrices_at_one_home():
    """Where plain Muon runs the step-bounding matrices as teams, NorMuon keeps every matrix at one home
    (its row means and norm need the whole matrix) and the flat W=2 result is bitwise one process's.
    In the same spawn: ranks given different ``variant`` or ``normuon_beta2`` raise on every rank,
    naming the setting, with nothing changed (they are settings the step's agreement compares)."""
    import dist_harness
    from test_team_ns import _initial, _grads, _opts

    per_rank = dist_harness.run(_team_worker, 2, timeout=120)
    assert per_rank[0]["muon"][2], "the set-up no longer makes teams: this test shows nothing"
    for key in ("variant", "normuon_beta2"):  # a setting of the agreement: refused on every rank, nothing changed
        for r in per_rank:
            assert r[key] is not None and f"param_groups[0][{key!r}]" in r[key][0] and r[key][1], (key, r[key])
    assert all(r["normuon"][2] == {} for r in per_rank)
    with dist_harness.one_thread():
        mats = [nn.Parameter(m) for m in _initial()]
        opt = ds_muon.Muon([{"params": mats}], variant="normuon", **_opts(torch.float32))
        for p, g in zip(mats, _grads()):
            p.grad = g
        opt.step()
        want = torch.cat([m.detach().reshape(-1) for m in mats])
    for r in per_rank:
        (lo, hi), got, _ = r["normuon"]
        assert torch.equal(got, want[lo:hi])


# -- split rows, [in, out] weights, expert stacks and conv kernels under DDP and FSDP2 -----------------
def _tagged_net():
    torch.manual_seed(0)
    return Net()


def _retag(model):
    """fully_shard's DTensor parameters carry no tags: tag them again (as muon_param_groups' param_tags would)."""
    ds_muon.transposed(model.stored_in_out)
    ds_muon.split_rows(model.fused, [4, 6])
    ds_muon.expert_weight(model.experts)


def _net_worker(rank, world, configs):
    import dist_harness  # noqa: F401 - (the spawn's one thread is set by the harness)

    grads = _grads(_tagged_net(), 3)
    out = []
    for kind, ns, kw in configs:
        model = _tagged_net()
        if kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor import distribute_tensor

            mesh = init_device_mesh("cpu", (world,))
            fully_shard(model, mesh=mesh)
            _retag(model)
        opt = ds_muon.Muon(_groups(model), log_summary=False, variant="normuon", normuon_beta2=0.8, ns_dtype=ns, **kw)
        for t in range(3):
            for n, p in model.named_parameters():
                g = grads[t][n]
                p.grad = distribute_tensor(g, p.device_mesh, p.placements) if kind == "fsdp2" else g.clone()
            opt.step()
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in model.named_parameters()}
        out.append((full, {n: opt.state[p][KEY].clone() for n, p in model.named_parameters() if KEY in opt.state[p]}))
    return out


def test_every_kind_of_matrix_under_ddp_and_fsdp2():
    """The formula test's model (plain, [in, out], split rows, experts, conv) at W=2 under the default
    (DDP-like, replicated) layout with the auto planner's duplicated homes and under FSDP2 (every
    matrix cut across both ranks), with overlap's waves: parameters and every rank's v ``torch.equal``
    to one process, fp32 and bf16 NS."""
    import dist_harness

    configs = [("ddp", torch.float32, {}), ("ddp", torch.bfloat16, dict(overlap=True, waves=2)),
               ("fsdp2", torch.float32, dict(overlap=True, waves=3)), ("fsdp2", torch.bfloat16, {})]
    per_rank = dist_harness.run(_net_worker, 2, configs, timeout=180)
    with dist_harness.one_thread():
        for c, (kind, ns, _) in enumerate(configs):
            model = _tagged_net()
            opt = _train(model, _grads(_tagged_net(), 3), 3, variant="normuon", normuon_beta2=0.8, ns_dtype=ns)
            for r, res in enumerate(per_rank):
                full, moments = res[c]
                for n, p in model.named_parameters():
                    assert torch.equal(full[n], p.detach()), (kind, ns, r, n)
                    if KEY in opt.state[p]:
                        assert torch.equal(moments[n], opt.state[p][KEY]), (kind, ns, r, n, "v")
                assert sorted(moments) == sorted(n for n, p in model.named_parameters() if p.dim() >= 2)


# -- FSDP1's optimizer state dicts ---------------------------------------------------------------------
def _fsdp1_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 7, bias=False), nn.Linear(7, 9, bias=False), nn.Tanh(), nn.Linear(9, 5, bias=True),
                         nn.Tanh(), nn.Linear(5, 5, bias=False))  # 0: the input layer, 5: the output layer (AdamW)


def _fsdp1_batch(t):
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(10 + t))


def _resumable(rank, world, kind, seed=0):
    """A Muon on ``_fsdp1_model(seed)`` wrapped by FSDP1 (flat or use_orig_params=True) or FSDP2."""
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(_fsdp1_model(seed), mesh=init_device_mesh("cpu", (world,)))
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(_fsdp1_model(seed), device_id=torch.device("cpu"), use_orig_params=kind == "fsdp1_orig")
    return model, ds_muon.Muon(ds_muon.muon_param_groups(model), model=model, variant="normuon", log_summary=False)


def _fsdp1_step(model, opt, t):
    model(_fsdp1_batch(t)).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _fsdp1_full(model, opt=None, offload=False):
    """The full model state dict and (with ``opt``) FSDP1's full optimizer state dict, on every rank."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if not isinstance(model, FSDP):  # FSDP2
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}, None
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                              FullOptimStateDictConfig(rank0_only=False, offload_to_cpu=offload)):
        return model.state_dict(), (FSDP.optim_state_dict(model, opt) if opt is not None else None)


def _fsdp1_worker(rank, world, kind):
    """2 steps, then the optimizer saved three ways: FSDP.optim_state_dict (full) without and with torch's
    default offload_to_cpu=True, and a plain per-rank torch.save(opt.state_dict()); one more step.  A fresh
    model and Muon (another seed) load each and take the third step again (FSDP2: the plain save only)."""
    import io

    def resume(load):
        again, opt2 = _resumable(rank, world, kind, seed=1)
        again.load_state_dict(model_sd)  # (FSDP2: its DTensors into the fresh ones)
        try:
            load(again, opt2)
        except ValueError as e:  # a refused load: the fresh optimizer was left as it was
            return {"refused": str(e), "untouched": not opt2.state}
        _fsdp1_step(again, opt2, 2)
        return _fsdp1_full(again)[0]

    def through_fsdp(osd):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        def load(again, opt2):
            with FSDP.state_dict_type(again, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
                opt2.load_state_dict(FSDP.optim_state_dict_to_load(again, opt2, osd))
        return load

    model, opt = _resumable(rank, world, kind)
    for t in range(2):
        _fsdp1_step(model, opt, t)
    if kind == "fsdp2":
        model_sd, osd, osd_cpu = {k: v.detach().clone() for k, v in model.state_dict().items()}, None, None
    else:
        (model_sd, osd), (_, osd_cpu) = _fsdp1_full(model, opt), _fsdp1_full(model, opt, offload=True)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    _fsdp1_step(model, opt, 2)
    out = {"continued": _fsdp1_full(model)[0], "saved": (model_sd, osd)}
    out["plain"] = resume(lambda again, opt2: opt2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()),
                                                                              weights_only=False)))
    if kind != "fsdp2":
        out["resumed"], out["offloaded"] = resume(through_fsdp(osd)), resume(through_fsdp(osd_cpu))
    return out


def test_fsdp1_optim_state_dict_carries_the_moment():
    """FSDP1 (flat and ``use_orig_params=True``) at W=2: ``FSDP.optim_state_dict`` carries v (as FSDP1's
    non-tensor state: it all-gathers every state tensor with a dimension as a flat shard and failed on it),
    a fresh FSDP1 optimizer loading it takes step 3 bitwise the uninterrupted run's, equal to one process,
    the AdamW bias too; so does a plain per-rank ``torch.save(opt.state_dict())`` (FSDP2 too); and the
    ``use_orig_params=True`` state dict (v per tensor) resumes in one process (W=1) through ds_muon.convert,
    its Muon matrices bitwise the same step.

    ``use_orig_params=True`` saved with torch's default ``FullOptimStateDictConfig(offload_to_cpu=True)``
    on CPU: torch's gather leaves every state key of a flat parameter's tensors equal to the last one
    (the AdamW bias's moments become its zero momentum placeholder, ~2e-4 off after the step); the load
    refuses it on every rank, naming the bias, loading nothing (ds_muon.integrations.fsdp1_checkpoint)."""
    import dist_harness
    from ds_muon.convert import load_named, named_state

    for kind in ("fsdp1_flat", "fsdp1_orig", "fsdp2"):
        per_rank = dist_harness.run(_fsdp1_worker, 2, kind, timeout=180)
        with dist_harness.one_thread():
            model = _fsdp1_model(0)
            opt = ds_muon.Muon(ds_muon.muon_param_groups(model), variant="normuon", log_summary=False)
            for t in range(3):
                model(_fsdp1_batch(t)).square().sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            want = {n: p.detach() for n, p in model.named_parameters()}
            if kind == "fsdp1_orig":  # W=2's full state dicts into one process, by tensor name
                msd, osd = per_rank[0]["saved"]
                one = _fsdp1_model(1)
                one.load_state_dict(msd)
                opt1 = ds_muon.Muon(ds_muon.muon_param_groups(one), variant="normuon", log_summary=False)
                load_named(opt1, named_state(osd))
                assert all(torch.is_tensor(opt1.state[p]["normuon_v"]) for p in (one[1].weight, one[3].weight))
                one(_fsdp1_batch(2)).square().sum().backward()
                opt1.step()
                muon = {n for g in opt1.param_groups if g["use_muon"] for n in g["param_names"]}
                assert muon == {"1.weight", "3.weight"}, muon  # the hidden matrices; 0 and 5: input and output
                for n, p in one.named_parameters():
                    if n in muon:  # the Muon matrices (the AdamW tensors through convert are not this test's)
                        assert torch.equal(p.detach(), want[n]), (n, "W=1 through ds_muon.convert")
        for r, res in enumerate(per_rank):
            ways = ["continued", "plain"] + ([] if kind == "fsdp2" else ["resumed"])
            if kind == "fsdp1_orig":
                off = res["offloaded"]
                assert isinstance(off, dict) and "refused" in off, (r, "offload_to_cpu=True loaded")
                assert "0.weight (AdamW)" in off["refused"] and "offload_to_cpu=False" in off["refused"], off["refused"]
                assert off["untouched"], (r, "a refused load changed the optimizer")
            elif kind == "fsdp1_flat":
                ways.append("offloaded")
            for way in ways:
                for n, w in want.items():
                    assert torch.equal(res[way][n], w), (kind, r, n, way)


# -- 2-D meshes at W=4: HSDP (one home per matrix in the world) and FSDP2 x TP with split rows ----------
def _mesh_worker(rank, world):
    from test_mesh import OPTS, GatedMLP, _split, _wrap, record

    out = []
    for kind, split in (("hsdp", False), ("fsdp_tp", True)):
        for ns_dtype in (torch.float32, torch.bfloat16):
            model = GatedMLP()
            init = {n: p.detach().clone() for n, p in model.named_parameters()}
            _wrap(kind, model)
            if split:
                _split(model)
            opt = ds_muon.Muon(ds_muon.muon_param_groups(model, **OPTS), momentum=0.9, ns_dtype=ns_dtype,
                               planner="locality", variant="normuon", normuon_beta2=0.5, log_summary=False)
            grads, params = record(model, opt)
            names = {id(p): n for n, p in model.named_parameters()}
            moments = {names[id(p)]: st[KEY].clone() for p, st in opt.state.items() if KEY in st}
            out.append(dict(init=init, grads=grads, params=params[-1], moments=moments, split=split))
    return out


def test_hsdp_and_fsdp_tp_split_rows_at_w4():
    """HSDP 2x2 and FSDP2 x TP 2x2 with split_rows blocks across shard borders (tests/test_mesh.py's
    set-up), fp32 and bf16 NS: every rank's parameters and v ``torch.equal`` to one process fed the
    gradients the sharded run saw (TP sums its forward in another order, so the gradients are recorded)."""
    import dist_harness
    from test_mesh import OPTS, GatedMLP, _split

    per_rank = dist_harness.run(_mesh_worker, 4, timeout=240)
    for c in range(len(per_rank[0])):
        for r, res in enumerate(per_rank):
            res = res[c]
            with dist_harness.one_thread():
                model = GatedMLP()
                if res["split"]:
                    _split(model)
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(res["init"][n])
                ns_dtype = (torch.float32, torch.bfloat16)[c % 2]
                opt = ds_muon.Muon(ds_muon.muon_param_groups(model, **OPTS), momentum=0.9, ns_dtype=ns_dtype,
                                   variant="normuon", normuon_beta2=0.5, log_summary=False)
                for g in res["grads"]:
                    for n, p in model.named_parameters():
                        p.grad = g[n].clone()
                    opt.step()
            for n, p in model.named_parameters():
                assert torch.equal(res["params"][n], p.detach()), (c, r, n)
                if KEY in opt.state[p]:
                    assert torch.equal(res["moments"][n], opt.state[p][KEY]), (c, r, n, "v")
            assert sorted(res["moments"]) == sorted(n for n, p in model.named_parameters() if KEY in opt.state[p])
