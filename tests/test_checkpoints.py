"""Checkpoints that move: DeepSpeed universal checkpoints at another world size, refusals, conversions.

One spawn per world size (DeepSpeed engines are slow to build): W=2 trains ds_muon at ZeRO-1/2/3 (and
DeepSpeed's own ``"type": "muon"`` at ZeRO-2) and saves; the parent converts every checkpoint to
DeepSpeed's universal layout (:func:`ds_muon.integrations.deepspeed_universal.zero_to_universal`); W=1 and W=3 load them with
``"load_universal": true``.  Every Muon momentum and AdamW moment is ``torch.equal`` to the saved run's
after loading at every W, and the next step equals the continuing W=2 run's: bitwise at W=1, and at W=3
within 1e-6 relative (DeepSpeed averages three equal gradients as (g/3)·3, which rounds; at W=1 and 2
the average is exact).
"""

import os

import pytest
import torch

import dist_harness

pytest.importorskip("deepspeed")

import ds_muon  # noqa: E402
from ds_muon import deepspeed as ds_muon_deepspeed  # noqa: E402
from test_deepspeed import ENV, PARAMS, batch, ds_config, full_fp32, make_model, train  # noqa: E402

STAGES = (1, 2, 3)
NEXT = 3  # steps after the load compared with the continuing W=2 run (at W=1; W=3 compares the first)
# ZeRO-2 with gradient clipping (the shipped configs/deepspeed/zero2.json clips, with bf16 NS), and with fp32
# NS: saved at W=2, loaded at W=1, NEXT steps compared (test_clipped_resume_is_bitwise_given_deepspeeds_norm).
# DeepSpeed's global gradient norm is a sum over its partitions' fragments, so at W=1 it can round 1 ulp away
# from W=2's: the W=1 run is replayed once more with DeepSpeed's norm pinned to the W=2 run's, and that replay
# must be bitwise; the free run is bitwise wherever the norms agree, and close where they do not.
CLIPPED = {"z2clip_bf16": "bfloat16", "z2clip_fp32": "float32"}


def _clipped_config(ns_dtype):
    # zero2.json's 1.0 does not bind on TinyLM (its gradient norm is below 1): 1e-3 clips every step
    return ds_config(2, clip=1e-3, params=dict(PARAMS, ns_dtype=ns_dtype))
KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")


def full_state(engine, muon_names=None):
    """``{name: {key: whole tensor}}`` of the optimizer state (a collective under ZeRO), through DeepSpeed's
    ``safe_get_full_optimizer_state``."""
    from deepspeed.utils import safe_get_full_optimizer_state

    if muon_names is None:
        muon = ds_muon.find_muon(engine)
        muon_names = {n for g in muon.param_groups if g["use_muon"] for n in g["param_names"]}
    zero = engine.optimizer
    ds_api = getattr(zero, "_ds_muon_relinks", False) or not hasattr(zero, "single_partition_of_fp32_groups")
    get = safe_get_full_optimizer_state if ds_api else _by_address
    out = {}
    for n, p in engine.module.named_parameters():
        keys = ("momentum_buffer",) if n in muon_names else ("exp_avg", "exp_avg_sq")
        out[n] = {k: get(p, k, engine) if get is _by_address else get(p, k).clone() for k in keys}
    return out


def _by_address(p, key, engine):
    """A ZeRO-1/2 tensor's whole state read from the flat partitions through its ``_hp_mapping`` addresses.
    DeepSpeed's own "type": "muon" links its per-tensor views of the state after its first group's step, before
    its AdamW group has state, so ``safe_get_full_optimizer_state`` fails there (ds_muon engines relink:
    ds_muon.integrations.deepspeed_checkpoint.relink_state_fragments)."""
    import torch.distributed as dist

    zero = engine.optimizer
    full = torch.zeros(p.numel(), dtype=torch.float32)
    m = p._hp_mapping
    if m is not None:
        flat = zero.optimizer.state[zero.single_partition_of_fp32_groups[m.param_group_index]][key]
        full.narrow(0, m.lp_fragment_address.start, m.lp_fragment_address.numel).copy_(
            flat.narrow(0, m.hp_fragment_address.start, m.hp_fragment_address.numel))
    dist.all_reduce(full)
    return full.view(p.shape)


def _save_worker(rank, world, root):
    """W=2: ds_muon at ZeRO-1/2/3 and DeepSpeed's Muon at ZeRO-2 train 2 steps and save; ds_muon goes on one step."""
    import deepspeed

    out = {}
    for stage in list(STAGES) + list(CLIPPED):
        cfg = ds_config(stage) if stage in STAGES else _clipped_config(CLIPPED[stage])
        engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=cfg)
        train(engine, 2)
        engine.save_checkpoint(os.path.join(root, f"z{stage}"), tag="t2")
        saved = full_state(engine), full_fp32(engine)
        nexts, norms = [], []
        for t in range(NEXT):
            train(engine, 1, start=2 + t)
            nexts.append(full_fp32(engine))
            norms.append(_grad_norm(engine))
        out[stage] = saved + (nexts, norms)
    model = make_model()
    cfg = ds_config(2)
    cfg["optimizer"] = {"type": "muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    train(engine, 2)
    engine.save_checkpoint(os.path.join(root, "dsmuon"), tag="t2")
    out["dsmuon"] = full_state(engine, muon_names={n for n, p in engine.module.named_parameters() if p.use_muon}), \
        full_fp32(engine)
    out["refusals"] = _refusals(root)
    return out


def _grad_norm(engine):
    """The global gradient norm DeepSpeed clipped the last step by (None where it computed none)."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else torch.as_tensor(norm).detach().clone()


def _pin_grad_norm(engine, norms):
    """Make DeepSpeed clip each next step by ``norms.pop(0)`` instead of the norm it would sum itself, so
    that a replay sees exactly the clipping coefficients of the run that recorded them (fp32 master weights:
    loss scale 1, so the scaled norm is the norm)."""
    zero = engine.optimizer
    assert zero.loss_scale == 1, zero.loss_scale
    zero.scaled_global_norm = lambda norm_type=2: norms.pop(0).clone()


def _snapshot(engine):
    return full_fp32(engine), {n: p.detach().clone() for n, p in engine.module.named_parameters()}, full_state(engine)


def _refusals(root):
    """A ds_muon ZeRO-2 engine refuses DeepSpeed Muon's checkpoint (other groups) before anything loads; a plain
    Muon refuses another model's state dict."""
    from test_deepspeed import TinyLM

    torch.manual_seed(7)
    engine, _, _, _ = ds_muon_deepspeed.initialize(model=TinyLM(), config=ds_config(2))
    train(engine, 1)
    before = _snapshot(engine)
    try:
        engine.load_checkpoint(os.path.join(root, "dsmuon"), tag="t2")
        ds_error = None
    except ValueError as e:
        ds_error = str(e)
    after = _snapshot(engine)
    unchanged = all(torch.equal(a[n], b[n]) for a, b in zip(before[:2], after[:2]) for n in a) and all(
        torch.equal(before[2][n][k], after[2][n][k]) for n in before[2] for k in before[2][n])
    # a plain state dict from another model: same names and group sizes, other shapes
    wide = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 8))
    narrow = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 12), torch.nn.ReLU(),
                                 torch.nn.Linear(12, 8))
    src = ds_muon.Muon(ds_muon.muon_param_groups(wide, head_names=()), log_summary=False)
    dst = ds_muon.Muon(ds_muon.muon_param_groups(narrow, head_names=()), log_summary=False)
    for m, o in ((wide, src), (narrow, dst)):
        m(torch.randn(4, 8)).sum().backward()
        o.step()
    kept = {id(p): {k: v.clone() for k, v in o_st.items()} for p, o_st in dst.state.items()}
    try:
        dst.load_state_dict(src.state_dict())
        plain_error = None
    except ValueError as e:
        plain_error = str(e)
    plain_unchanged = all(torch.equal(dst.state[p][k], kept[id(p)][k]) for p in dst.state for k in kept[id(p)])
    return ds_error, unchanged, plain_error, plain_unchanged


# universal checkpoints loaded at another ZeRO stage (saved at, loaded at), per load world size: DeepSpeed
# names the model-states file per stage (ZeRO-3: zero_pp_rank_0_mp_rank_00_..., ZeRO-1/2: mp_rank_00_...),
# and a universal load at another stage found none (an empty AssertionError) before ds_muon looked for both
CROSS = {1: ((2, 3), (3, 1)), 3: ((2, 3),)}


def _load_worker(rank, world, root):
    """Any W: every universal checkpoint loaded into a fresh ds_muon engine at its stage (and, per CROSS, at
    another stage); state and one step. At W=1 the clipped checkpoints also step NEXT times, once free and
    once replaying the W=2 run's gradient norms (``pinned``)."""
    out = {}
    moves = [(s, s) for s in STAGES] + list(CROSS.get(world, ()))
    if world == 1:
        moves += [(c, c) for c in CLIPPED] + [(c, (c, "pinned")) for c in CLIPPED]
        recorded = torch.load(os.path.join(root, "clip_norms.pt"))
    for saved_at, stage in moves:
        pinned = isinstance(stage, tuple) and stage[1] == "pinned"
        if pinned:
            stage = saved_at
        torch.manual_seed(1000 + (stage if stage in STAGES else 7))  # a different init: everything must come from the checkpoint
        cfg = ds_config(stage) if stage in STAGES else _clipped_config(CLIPPED[stage])
        cfg = dict(cfg, checkpoint={"load_universal": True})
        from test_deepspeed import TinyLM

        engine, _, _, _ = ds_muon_deepspeed.initialize(model=TinyLM(), config=cfg)
        engine.load_checkpoint(os.path.join(root, f"z{saved_at}"), tag="t2_universal")
        loaded = full_state(engine), full_fp32(engine)
        if pinned:
            _pin_grad_norm(engine, list(recorded[stage]))
        nexts, norms = [], []
        for t in range(NEXT if world == 1 else 1):
            train(engine, 1, start=2 + t)
            nexts.append(full_fp32(engine))
            norms.append(_grad_norm(engine))
        key = (stage, "pinned") if pinned else stage if saved_at == stage else (saved_at, stage)
        out[key] = loaded + (nexts, engine.global_steps, norms)
    if world == 1:
        out["from_dsmuon"] = _from_deepspeed_muon(root)
        out["other_world"] = _other_world_refused(root)
    return out


def _from_deepspeed_muon(root):
    """DeepSpeed's "type": "muon" ZeRO-2 checkpoint → ds_muon universal (by name) → a DsMuon ZeRO-2 engine; its
    next step against single-process ds_muon stepping from the same converted state."""
    from ds_muon import convert as cv
    from test_deepspeed import TinyLM

    dst = os.path.join(root, "from_dsmuon", "t2")
    cv.convert(os.path.join(root, "dsmuon"), dst, make_model(), config=ds_config(2))
    torch.manual_seed(99)
    cfg = dict(ds_config(2), checkpoint={"load_universal": True})
    engine, _, _, _ = ds_muon_deepspeed.initialize(model=TinyLM(), config=cfg)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    try:  # DeepSpeed Muon's checkpoint in the universal layout as it is: its groups are not ds_muon's
        engine.load_checkpoint(os.path.join(root, "dsmuon"), tag="t2_universal")
        universal_error = None
    except ValueError as e:
        universal_error = str(e)
    untouched = all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    engine.load_checkpoint(os.path.join(root, "from_dsmuon"))  # latest_universal
    loaded = full_state(engine), full_fp32(engine)
    train(engine, 1, start=2)
    # the reference: the same state given to a plain ds_muon in one process
    model = make_model()
    muon = cv.build(model, cv.read(os.path.join(root, "dsmuon")), dict(PARAMS))
    with dist_harness.one_thread():
        tokens, targets = batch(2)
        model(tokens, targets).backward()
        muon.step()
    return loaded, full_fp32(engine), {n: p.detach().clone() for n, p in model.named_parameters()}, \
        (universal_error, untouched)


def _other_world_refused(root):
    """A W=2 ZeRO-2 checkpoint (not universal) into a W=1 engine: refused before the module is touched (DeepSpeed
    itself raises only after loading the module weights)."""
    from test_deepspeed import TinyLM

    torch.manual_seed(5)
    engine, _, _, _ = ds_muon_deepspeed.initialize(model=TinyLM(), config=ds_config(2))
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    try:
        engine.load_checkpoint(os.path.join(root, "z2"), tag="t2")
        error = None
    except ValueError as e:
        error = str(e)
    return error, all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    results = dist_harness.run(_save_worker, 2, root, timeout=300, env=ENV)
    torch.save({stage: results[0][stage][3] for stage in CLIPPED}, os.path.join(root, "clip_norms.pt"))
    return root, results


@pytest.fixture(scope="module")
def universal(saved):
    from ds_muon.integrations.deepspeed_universal import zero_to_universal

    root, _ = saved
    # DeepSpeed 0.19.8's own converter stops at the Muon group's state (deepspeed#8608): why ds_muon has its own
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=os.path.join(root, "z2", "t2"), output_folder=os.path.join(root, "ds_uc"),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    with pytest.raises(KeyError, match="exp_avg"):
        ds_to_universal.main(args)
    for stage in list(STAGES) + list(CLIPPED):
        zero_to_universal(os.path.join(root, f"z{stage}", "t2"), os.path.join(root, f"z{stage}", "t2_universal"))
    zero_to_universal(os.path.join(root, "dsmuon", "t2"), os.path.join(root, "dsmuon", "t2_universal"))
    return root


@pytest.fixture(scope="module")
def at_w1(universal):
    return dist_harness.run(_load_worker, 1, universal, timeout=300, env=ENV)


@pytest.mark.parametrize("world", [1, 3])
def test_universal_resume_at_other_world_size(saved, universal, world, request):
    """Each stage's checkpoint at its own stage and (CROSS) at another: ZeRO-2 -> 3 and 3 -> 1 at W=1,
    2 -> 3 at W=3."""
    want = saved[1][0]
    results = (request.getfixturevalue("at_w1") if world == 1 else
               dist_harness.run(_load_worker, world, universal, timeout=300, env=ENV))
    for rank, got in enumerate(results):
        for stage in list(STAGES) + list(CROSS[world]):
            state_w, fp32_w, next_w, _ = want[stage if stage in STAGES else stage[0]]
            state_g, fp32_g, next_g, steps, _ = got[stage]
            assert steps == 2 + len(next_g) and len(next_g) == (NEXT if world == 1 else 1)
            _same_state(state_w, fp32_w, state_g, fp32_g, f"W={world} rank {rank} ZeRO-{stage}")
            for t, (w_t, g_t) in enumerate(zip(next_w, next_g)):
                for name in w_t:
                    if world == 1:  # bitwise, every step
                        assert torch.equal(w_t[name], g_t[name]), f"W=1 z{stage} {name}: step {t + 1} after differs"
                    else:
                        scale = w_t[name].abs().max().clamp_min(1e-30)
                        err = (w_t[name] - g_t[name]).abs().max() / scale
                        assert err <= 1e-6, f"W={world} z{stage} {name}: next step off by {err:.2e} of its largest value"


def _same_state(state_w, fp32_w, state_g, fp32_g, where):
    for name in state_w:
        assert torch.equal(fp32_w[name], fp32_g[name]), f"{where} {name}: weights differ"
        assert state_w[name].keys() == state_g[name].keys()
        for key in state_w[name]:
            assert torch.equal(state_w[name][key], state_g[name][key]), \
                f"{where}: {name} {key} differs after the universal load"


def test_clipped_resume_is_bitwise_given_deepspeeds_norm(saved, at_w1):
    """ZeRO-2 with gradient clipping that binds (1e-3: every step is clipped, which the saved weights show
    against the unclipped run), bf16 NS (the shipped zero2.json's) and fp32 NS, saved at W=2 and resumed at
    W=1. The state loads torch.equal. Replayed with the W=2 run's gradient norms, each of the NEXT steps is
    bitwise the continuing W=2 run's: everything ds_muon computes is world-size invariant. Free, DeepSpeed
    sums its norm over other fragments at W=1 (two partial norms of a tensor the W=2 cut splits, one at
    W=1), which can round 1 ulp apart (seen: 0.91212827 against 0.91212833 on an AMD EPYC box, not on an
    Intel one): a step whose norm and inputs agree is bitwise, and a step after a norm that differed stays
    within 1e-6 of each tensor's largest value with fp32 NS (the clip coefficient's 1 ulp, through AdamW and
    NS), 1e-4 with bf16 NS (where that ulp can flip one bf16 rounding of an NS input)."""
    tolerance = {"z2clip_bf16": 1e-4, "z2clip_fp32": 1e-6}
    unclipped = saved[1][0][2][1]
    for stage in CLIPPED:
        state_w, fp32_w, next_w, norms_w = saved[1][0][stage]
        for key in (stage, (stage, "pinned")):
            state_g, fp32_g, next_g, steps, norms_g = at_w1[0][key]
            assert any(not torch.equal(fp32_w[n], unclipped[n]) for n in fp32_w), "the clipping did not bind"
            _same_state(state_w, fp32_w, state_g, fp32_g, stage)
            assert steps == 2 + NEXT and len(next_g) == NEXT
            drifted = False
            for t, (w_t, g_t) in enumerate(zip(next_w, next_g)):
                assert norms_w[t] is not None and norms_g[t] is not None, "DeepSpeed computed no gradient norm"
                if key != stage:
                    assert torch.equal(norms_w[t], norms_g[t]), f"{key}: the pinned norm did not reach the step"
                drifted = drifted or not torch.equal(norms_w[t], norms_g[t])
                for n in w_t:
                    if not drifted:
                        assert torch.equal(w_t[n], g_t[n]), f"{key} {n}: step {t + 1} after the resume differs " \
                            f"with DeepSpeed's norm equal ({norms_w[t].item():.9g})"
                    else:
                        err = (w_t[n] - g_t[n]).abs().max() / w_t[n].abs().max().clamp_min(1e-30)
                        assert err <= tolerance[stage], f"{key} {n}: step {t + 1} off by {err:.2e} after DeepSpeed's norm " \
                            f"rounded apart"


def test_mismatched_checkpoints_refused_on_every_rank_changing_nothing(saved):
    for rank_result in saved[1]:  # both ranks
        ds_error, unchanged, plain_error, plain_unchanged = rank_result["refusals"]
        assert ds_error is not None and unchanged, ds_error
        assert "param group 0, tensor" in ds_error, ds_error
        assert '"type": "muon"' in ds_error and "ds-muon convert" in ds_error, ds_error
        assert plain_error is not None and plain_unchanged, plain_error
        assert "2.weight" in plain_error and "(16, 16)" in plain_error and "ds-muon convert" in plain_error, plain_error


def test_from_deepspeed_muon_and_other_world_size(saved, at_w1):
    """DeepSpeed Muon's checkpoint converted by name: every state tensor equal to DeepSpeed Muon's own, the next step
    bitwise that of single-process ds_muon from the same state; a ZeRO checkpoint of another W refused."""
    results = at_w1[0]
    ds_state, ds_fp32 = saved[1][0]["dsmuon"]
    (state, fp32), after, reference, (universal_error, untouched) = results["from_dsmuon"]
    assert universal_error is not None and untouched, universal_error
    assert "do not record their tensors' names" in universal_error, universal_error
    for name in ds_state:
        assert torch.equal(ds_fp32[name], fp32[name]), name
        for key in ds_state[name]:
            assert torch.equal(ds_state[name][key], state[name][key]), f"{name} {key} changed in the conversion"
        assert torch.equal(after[name], reference[name]), f"{name}: next step differs from single-process ds_muon"
    error, unchanged = results["other_world"]
    assert error is not None and unchanged, error
    assert "world size 2" in error and "load_universal" in error, error
