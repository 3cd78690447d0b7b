"""Checkpoints that move: DeepSpeed universal checkpoints at another world size, refusals, conversions.

One spawn per world size (DeepSpeed engines are slow to build): W=2 trains ds_muon at ZeRO-1/2/3 (and
DeepSpeed's own ``"type": "muon"`` at ZeRO-2) and saves; the parent converts every checkpoint to
DeepSpeed's universal layout (:func:`ds_muon.universal.zero_to_universal`); W=1 and W=3 load them with
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
KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")


def full_state(engine):
    """``{name: {key: whole tensor}}`` of the optimizer state (a collective under ZeRO)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    muon = ds_muon.find_muon(engine)
    muon_names = {n for g in muon.param_groups if g["use_muon"] for n in g["param_names"]}
    out = {}
    for n, p in engine.module.named_parameters():
        keys = ("momentum_buffer",) if n in muon_names else ("exp_avg", "exp_avg_sq")
        out[n] = {k: safe_get_full_optimizer_state(p, k).clone() for k in keys}
    return out


def _save_worker(rank, world, root):
    """W=2: ds_muon at ZeRO-1/2/3 and DeepSpeed's Muon at ZeRO-2 train 2 steps and save; ds_muon goes on one step."""
    import deepspeed

    out = {}
    for stage in STAGES:
        engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=ds_config(stage))
        train(engine, 2)
        engine.save_checkpoint(os.path.join(root, f"z{stage}"), tag="t2")
        saved = full_state(engine), full_fp32(engine)
        train(engine, 1, start=2)
        out[stage] = saved + (full_fp32(engine),)
    model = make_model()
    cfg = ds_config(2)
    cfg["optimizer"] = {"type": "muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    train(engine, 2)
    engine.save_checkpoint(os.path.join(root, "dsmuon"), tag="t2")
    out["dsmuon"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return out


def _load_worker(rank, world, root):
    """Any W: every universal checkpoint loaded into a fresh ds_muon engine at its stage; state and one step."""
    out = {}
    for stage in STAGES:
        torch.manual_seed(1000 + stage)  # a different init: everything must come from the checkpoint
        cfg = dict(ds_config(stage), checkpoint={"load_universal": True})
        from test_deepspeed import TinyLM

        engine, _, _, _ = ds_muon_deepspeed.initialize(model=TinyLM(), config=cfg)
        engine.load_checkpoint(os.path.join(root, f"z{stage}"), tag="t2_universal")
        loaded = full_state(engine), full_fp32(engine)
        train(engine, 1, start=2)
        out[stage] = loaded + (full_fp32(engine), engine.global_steps)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    results = dist_harness.run(_save_worker, 2, root, timeout=300, env=ENV)
    return root, results[0]


@pytest.fixture(scope="module")
def universal(saved):
    from ds_muon.universal import zero_to_universal

    root, _ = saved
    for stage in STAGES:
        zero_to_universal(os.path.join(root, f"z{stage}", "t2"), os.path.join(root, f"z{stage}", "t2_universal"))
    return root


@pytest.mark.parametrize("world", [1, 3])
def test_universal_resume_at_other_world_size(saved, universal, world):
    _, want = saved
    results = dist_harness.run(_load_worker, world, universal, timeout=300, env=ENV)
    for rank, got in enumerate(results):
        for stage in STAGES:
            state_w, fp32_w, next_w = want[stage]
            state_g, fp32_g, next_g, steps = got[stage]
            assert steps == 3
            for name in state_w:
                assert torch.equal(fp32_w[name], fp32_g[name]), f"W={world} z{stage} {name}: weights differ"
                assert state_w[name].keys() == state_g[name].keys()
                for key in state_w[name]:
                    assert torch.equal(state_w[name][key], state_g[name][key]), \
                        f"W={world} rank {rank} ZeRO-{stage}: {name} {key} differs after the universal load"
                if world == 1:
                    assert torch.equal(next_w[name], next_g[name]), f"W=1 z{stage} {name}: next step differs"
                else:
                    scale = next_w[name].abs().max().clamp_min(1e-30)
                    err = (next_w[name] - next_g[name]).abs().max() / scale
                    assert err <= 1e-6, f"W={world} z{stage} {name}: next step off by {err:.2e} of its largest value"
