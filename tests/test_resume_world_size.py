"""accelerate and HF Trainer checkpoints written at W=2 resume at another world size.

One spawn per world size (transformers and accelerate are slow to import), several checks in each:

* W=2: ``ds_muon.accelerate.prepare`` (DDP, and FSDP2 through configs/accelerate/fsdp2.yaml) trains a
  tiny Llama K steps with NorMuon (``variant="normuon"``: its second moment ``normuon_v`` resumes too)
  with the same batch on every rank, ``accelerator.save_state``, then one more step (the continuing
  reference).  ``MuonTrainer`` (DDP) trains 2K steps with ``save_steps=K``; its Muon's
  state is read when the checkpoint at step K is written.
* W=1: a fresh model (another seed) ``accelerator.load_state`` / ``trainer.train(resume_from_checkpoint=...)``
  (DDP and FSDP2 each).  Every Muon momentum and AdamW moment (and the weights) is ``torch.equal`` to the
  saved run's, and the accelerate runs' next step is bitwise the continuing W=2 step: every rank sees the
  same batch, so the W=2 gradient is the mean of two equal gradients (exact), and every rank runs one CPU
  thread as the W=1 process does, so Newton-Schulz rounds alike.
* ``MuonTrainer`` at ZeRO-3: the W=2 checkpoint converted with ``zero_to_universal`` resumes at W=1 with
  ``"checkpoint": {"load_universal": true}`` (same checks).
* Opt-in (DS_MUON_RESUME_DEEPSPEED=1, ~30 s more): W=3: accelerate's FSDP2 checkpoint (DCP) loads into
  three uneven shards, state and weights ``torch.equal``, the next step within 1e-6 of each tensor's
  largest value (three equal gradients average with rounding); and accelerate at ZeRO-2/3 and the
  Trainer at ZeRO-2 through the universal conversion, W=2 to W=1.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import dist_harness  # noqa: E402
from door_matrix import TokenRows  # noqa: E402
from hf_models import FAMILIES  # noqa: E402
from test_front_doors import ENV, REPO, SETTINGS, _fresh_accelerate, _full_fp32, _rows, launch_env  # noqa: E402

K = 2
ACCELERATE_DOORS = ("ddp", "fsdp2")
TRAINER_DOORS = ("ddp", "fsdp2")
AT_THREE = ("fsdp2",)  # DCP reshards into 3 uneven shards; DDP's plain state dict does not depend on W
# the W=3 spawn and the DeepSpeed-through-accelerate test: ~30 s more than this file's CI share
SLOW = os.environ.get("DS_MUON_RESUME_DEEPSPEED") == "1"
# accelerate's runs are NorMuon (its second moment resumes like the momentum, at any world size); the Trainer's
# are plain Muon
ACCELERATE_SETTINGS = dict(SETTINGS, variant="normuon")
FSDP2 = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "reshard_after_forward": True})


def full_state(muon) -> dict:
    """``{param name: {state key: whole tensor}}`` of a ds_muon.Muon (DTensor state made whole: a
    collective, called in the same order on every rank)."""
    out = {}
    for group in muon.param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            entry = {}
            for key, v in sorted(muon.state[p].items()):
                if torch.is_tensor(v):
                    v = v.full_tensor() if hasattr(v, "full_tensor") else v
                    v = v.detach().clone()
                entry[key] = v
            out[name.removeprefix("module.")] = entry
    return out


def _batch():
    return _rows(4, seed=5)  # the same rows on every rank and at every world size


# -- accelerate --------------------------------------------------------------------------------------
def _accelerate_setup(door, seed):
    from ds_muon.accelerate import Accelerator, find_muon, prepare

    _fresh_accelerate(launch_env(door))
    accelerator = Accelerator()
    model, opt = prepare(accelerator, FAMILIES["llama"](seed=seed), **ACCELERATE_SETTINGS)
    return accelerator, model, opt, find_muon(opt)


def _accelerate_step(accelerator, model, opt):
    idx = _batch()
    accelerator.backward(model(input_ids=idx, labels=idx).loss)
    opt.step()
    opt.zero_grad()


def _accelerate_save(door, ckpt):
    accelerator, model, opt, muon = _accelerate_setup(door, seed=0)
    for _ in range(K):
        _accelerate_step(accelerator, model, opt)
    accelerator.save_state(ckpt)
    saved = dict(state=full_state(muon), weights=_full_fp32(model),
                 distributed_type=str(accelerator.distributed_type).split(".")[-1],
                 homes=sorted({h for ex in muon.exchanges() for hs in ex.homes.values() for h in hs}))
    _accelerate_step(accelerator, model, opt)
    saved["next"] = _full_fp32(model)
    accelerator.wait_for_everyone()
    return saved


def _accelerate_load(door, ckpt):
    accelerator, model, opt, muon = _accelerate_setup(door, seed=1)  # another init: everything comes from ckpt
    accelerator.load_state(ckpt)
    loaded = dict(state=full_state(muon), weights=_full_fp32(model),
                  distributed_type=str(accelerator.distributed_type).split(".")[-1])
    _accelerate_step(accelerator, model, opt)
    loaded["next"] = _full_fp32(model)
    accelerator.wait_for_everyone()
    return loaded


# -- MuonTrainer -------------------------------------------------------------------------------------
def _trainer(door, out_dir, seed, record):
    from transformers import TrainerCallback, TrainingArguments

    from ds_muon.trainer import MuonTrainer

    class Record(TrainerCallback):
        def on_save(self, args, state, control, **kw):  # the Muon as the checkpoint at step K holds it
            if state.global_step == K:
                record.setdefault("saved", dict(state=full_state(trainer.muon), weights=_full_fp32(trainer.model)))

        def on_train_begin(self, args, state, control, **kw):  # after resume_from_checkpoint loaded
            record["begin"] = dict(state=full_state(trainer.muon), step=state.global_step,
                                   weights=_full_fp32(trainer.model))

    _fresh_accelerate({})
    args = TrainingArguments(output_dir=out_dir, max_steps=2 * K, per_device_train_batch_size=8, save_steps=K,
                             save_strategy="steps", report_to="none", use_cpu=True, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True,
                             **(FSDP2 if door == "fsdp2" else {}))
    trainer = MuonTrainer(model=FAMILIES["llama"](seed=seed), args=args,
                          train_dataset=TokenRows(_rows(2 * K * 8 * 2, seed=5)), muon_settings=SETTINGS,
                          callbacks=[Record()])
    return trainer


def _trainer_save(door, out_dir):
    record = {}
    trainer = _trainer(door, out_dir, 0, record)
    trainer.train()
    return record


def _trainer_resume(door, out_dir, ckpt):
    record = {}
    trainer = _trainer(door, out_dir, 1, record)
    trainer.train(resume_from_checkpoint=ckpt)
    record["end_step"] = trainer.state.global_step
    record["wrapped"] = type(trainer.model_wrapped).__name__
    return record


# -- the spawns --------------------------------------------------------------------------------------
def _save_worker(rank, world, root):
    out = {door: _accelerate_save(door, os.path.join(root, f"acc_{door}")) for door in ACCELERATE_DOORS}
    for door in TRAINER_DOORS:
        out[f"trainer_{door}"] = _trainer_save(door, os.path.join(root, f"trainer_{door}"))
    out["trainer_zero3"] = _ds_trainer(3, root, resume=False)
    return out


def _load_worker(rank, world, root, doors):
    out = {door: _accelerate_load(door, os.path.join(root, f"acc_{door}")) for door in doors}
    if world > 1:
        return out
    for door in TRAINER_DOORS:
        out[f"trainer_{door}"] = _trainer_resume(door, os.path.join(root, f"trainer_{door}_resumed"),
                                                 os.path.join(root, f"trainer_{door}", f"checkpoint-{K}"))
    out["trainer_zero3"] = _ds_trainer(3, root, resume=True)
    return out


def assert_state_equal(got, want, what):
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for name, entry in want.items():
        assert got[name].keys() == entry.keys(), (what, name, sorted(got[name]), sorted(entry))
        for key, v in entry.items():
            ok = torch.equal(got[name][key], v) if torch.is_tensor(v) else got[name][key] == v
            assert ok, (what, name, key)


def assert_weights_equal(got, want, what):
    assert got.keys() == want.keys(), what
    for name, t in want.items():
        assert torch.equal(got[name], t), (what, name)


def test_resume_at_another_world_size(tmp_path):
    pytest.importorskip("deepspeed")
    saved = dist_harness.run(_save_worker, 2, str(tmp_path), timeout=300, env=ENV)
    universal(tmp_path, "trainer", 3)
    (loaded,) = dist_harness.run(_load_worker, 1, str(tmp_path), ACCELERATE_DOORS, timeout=300, env=ENV)
    at_three = dist_harness.run(_load_worker, 3, str(tmp_path), AT_THREE, timeout=300, env=ENV) if SLOW else []
    s = saved[0]
    assert s["ddp"]["distributed_type"] == "MULTI_CPU" and s["fsdp2"]["distributed_type"] == "FSDP"
    for door in ACCELERATE_DOORS:
        assert s[door]["homes"] == [0, 1], (door, s[door]["homes"])  # Newton-Schulz split over both ranks
        kinds = {k for entry in s[door]["state"].values() for k in entry}
        assert {"momentum_buffer", "normuon_v", "exp_avg", "exp_avg_sq"} <= kinds, (door, kinds)
        for r in saved[1:]:  # both ranks saw the same whole state and weights
            assert_state_equal(r[door]["state"], s[door]["state"], (door, "ranks"))
        assert_state_equal(loaded[door]["state"], s[door]["state"], door)
        assert_weights_equal(loaded[door]["weights"], s[door]["weights"], door)
        assert_weights_equal(loaded[door]["next"], s[door]["next"], (door, "next step"))
        for r in at_three if door in AT_THREE else ():
            assert r[door]["distributed_type"] == s[door]["distributed_type"], door
            assert_state_equal(r[door]["state"], s[door]["state"], (door, "W=3"))
            assert_weights_equal(r[door]["weights"], s[door]["weights"], (door, "W=3"))
            for name, t in s[door]["next"].items():  # W=3 averages three equal gradients, with rounding
                err = (r[door]["next"][name] - t).abs().max().item()
                assert err <= 1e-6 * t.abs().max().item(), (door, "W=3 next step", name, err)
    for door in TRAINER_DOORS:
        t_saved, t_loaded = s[f"trainer_{door}"], loaded[f"trainer_{door}"]
        assert "saved" in t_saved and t_saved["begin"]["step"] == 0, door
        assert t_loaded["begin"]["step"] == K and t_loaded["end_step"] == 2 * K, door
        assert_state_equal(t_loaded["begin"]["state"], t_saved["saved"]["state"], ("trainer", door))
        assert_weights_equal(t_loaded["begin"]["weights"], t_saved["saved"]["weights"], ("trainer", door))
    assert loaded["trainer_fsdp2"]["wrapped"].startswith("FSDP"), loaded["trainer_fsdp2"]["wrapped"]
    check_trainer_zero(s["trainer_zero3"], loaded["trainer_zero3"], 3)


# -- DeepSpeed through accelerate and the Trainer: zero_to_universal, then "load_universal" ---------------
DEEPSPEED_STAGES = (2, 3)  # the Trainer at ZeRO-3 also runs in test_resume_at_another_world_size


def _zero_state(engine) -> dict:
    """``{name: {key: whole tensor}}`` through DeepSpeed's ``safe_get_full_optimizer_state`` (a collective)."""
    import ds_muon
    from deepspeed.utils import safe_get_full_optimizer_state

    muon = ds_muon.find_muon(engine)
    names = {n for g in muon.param_groups if g["use_muon"] for n in g["param_names"]}
    return {n: {k: safe_get_full_optimizer_state(p, k).clone()
                for k in (("momentum_buffer",) if n in names else ("exp_avg", "exp_avg_sq"))}
            for n, p in engine.module.named_parameters()}


def _universal_config(path: str, out: str) -> str:
    import json

    with open(path) as f:
        cfg = json.load(f)
    cfg["checkpoint"] = {"load_universal": True}
    with open(out, "w") as f:
        json.dump(cfg, f)
    return out


def _ds_accelerate(stage, root, resume):
    from ds_muon.accelerate import Accelerator, prepare

    env = launch_env(f"deepspeed_zero{stage}")
    if resume:
        env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = _universal_config(
            env["ACCELERATE_DEEPSPEED_CONFIG_FILE"], os.path.join(root, f"zero{stage}_universal.json"))
    _fresh_accelerate(env)
    accelerator = Accelerator()
    model, opt = prepare(accelerator, FAMILIES["llama"](seed=int(resume)), **SETTINGS)
    if resume:
        accelerator.load_state(os.path.join(root, f"acc_zero{stage}_universal"))
    else:
        for _ in range(K):
            _accelerate_step(accelerator, model, opt)
        accelerator.save_state(os.path.join(root, f"acc_zero{stage}"))
    out = dict(state=_zero_state(model), weights=_full_fp32(model))
    _accelerate_step(accelerator, model, opt)
    out["next"] = _full_fp32(model)
    return out


def _ds_trainer(stage, root, resume):
    from transformers import TrainerCallback, TrainingArguments

    from ds_muon.trainer import MuonTrainer

    record = {}

    class Record(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            if state.global_step == K:
                record.setdefault("saved", dict(state=_zero_state(trainer.model_wrapped),
                                                weights=_full_fp32(trainer.model_wrapped)))

        def on_train_begin(self, args, state, control, **kw):
            if resume:
                record["begin"] = dict(state=_zero_state(trainer.model_wrapped), step=state.global_step,
                                       weights=_full_fp32(trainer.model_wrapped))

    config = os.path.join(REPO, "configs", "deepspeed", f"zero{stage}.json")
    if resume:
        config = _universal_config(config, os.path.join(root, f"trainer_zero{stage}_universal.json"))
    _fresh_accelerate({})
    args = TrainingArguments(output_dir=os.path.join(root, f"trainer_zero{stage}" + "_resumed" * resume),
                             max_steps=2 * K, per_device_train_batch_size=8, save_steps=K, save_strategy="steps",
                             report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
                             deepspeed=config)
    trainer = MuonTrainer(model=FAMILIES["llama"](seed=int(resume)), args=args,
                          train_dataset=TokenRows(_rows(2 * K * 8 * 2, seed=5)), muon_settings=SETTINGS,
                          callbacks=[Record()])
    trainer.train(resume_from_checkpoint=os.path.join(root, f"trainer_zero{stage}", f"checkpoint-{K}") if resume
                  else None)
    record["end_step"] = trainer.state.global_step
    return record


def _ds_worker(rank, world, root, resume):
    return {stage: (_ds_accelerate(stage, root, resume), _ds_trainer(stage, root, resume))
            for stage in DEEPSPEED_STAGES}


def universal(root, front_door: str, stage: int) -> None:
    """The documented conversion: accelerate's ``pytorch_model`` tag into a copy of its checkpoint folder
    (accelerate passes that tag to ``load_checkpoint``); the Trainer's ``global_stepN`` beside itself as
    ``global_stepN_universal`` (with ``latest_universal``, which the Trainer's untagged load reads)."""
    import shutil

    from ds_muon.integrations.deepspeed_universal import zero_to_universal

    if front_door == "accelerate":
        src, dst = os.path.join(root, f"acc_zero{stage}"), os.path.join(root, f"acc_zero{stage}_universal")
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("pytorch_model"))
        zero_to_universal(os.path.join(src, "pytorch_model"), os.path.join(dst, "pytorch_model"))
    else:
        ckpt = os.path.join(root, f"trainer_zero{stage}", f"checkpoint-{K}")
        zero_to_universal(os.path.join(ckpt, f"global_step{K}"), os.path.join(ckpt, f"global_step{K}_universal"))


def check_trainer_zero(saved, loaded, stage):
    assert loaded["begin"]["step"] == K and loaded["end_step"] == 2 * K, stage
    assert_state_equal(loaded["begin"]["state"], saved["saved"]["state"], ("trainer", stage))
    assert_weights_equal(loaded["begin"]["weights"], saved["saved"]["weights"], ("trainer", stage))


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="opt-in: DS_MUON_RESUME_DEEPSPEED=1")
def test_deepspeed_resume_through_universal(tmp_path):
    """ZeRO-2/3 through accelerate and the Trainer: save at W=2, ``zero_to_universal`` the tag folder
    (accelerate: ``pytorch_model`` into a copy of the checkpoint folder; Trainer: ``global_stepN`` →
    ``global_stepN_universal``), resume at W=1 with ``"checkpoint": {"load_universal": true}``."""
    saved = dist_harness.run(_ds_worker, 2, str(tmp_path), False, timeout=400, env=ENV)[0]
    for stage in DEEPSPEED_STAGES:
        universal(tmp_path, "accelerate", stage)
        universal(tmp_path, "trainer", stage)
    (loaded,) = dist_harness.run(_ds_worker, 1, str(tmp_path), True, timeout=400, env=ENV)
    for stage in DEEPSPEED_STAGES:
        (acc_s, tr_s), (acc_l, tr_l) = saved[stage], loaded[stage]
        assert_state_equal(acc_l["state"], acc_s["state"], ("accelerate", stage))
        assert_weights_equal(acc_l["weights"], acc_s["weights"], ("accelerate", stage))
        assert_weights_equal(acc_l["next"], acc_s["next"], ("accelerate", stage, "next step"))
        check_trainer_zero(tr_s, tr_l, stage)
