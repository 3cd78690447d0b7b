"""Issue 28's settings through every front door: the DsMuon JSON (``ds_muon.deepspeed``), ``ds_muon.accelerate
.prepare`` (and the DeepSpeed path it shares with ``MuonTrainer``) and ``MuonTrainer(muon_settings=...)``.

Each setting must reach the Muon's param groups, and a bad value must be a clear error naming the key,
raised before anything is built.  The doors accept what :class:`ds_muon.Muon` accepts (they read its
signature), so a setting added there is checked here as soon as it exists: ``variant`` and
``normuon_beta2`` are the NorMuon engineer's (skipped until ``Muon`` takes them).
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from torch import nn

import ds_muon

# key: (a good value other than the default, a bad value)
NEW_SETTINGS = {"weight_decay_mode": ("cautious", "cautios"), "variant": ("normuon", "norm_muon"),
                "normuon_beta2": (0.9, 1.5)}
KEYS = list(NEW_SETTINGS)
IN_MUON = set(inspect.signature(ds_muon.Muon.__init__).parameters)


def _known(key):
    if key not in IN_MUON:
        pytest.skip(f"ds_muon.Muon has no {key!r} yet (the NorMuon engineer's setting)")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _muon_groups(muon):
    return [g for g in muon.param_groups if g["use_muon"]]


def test_every_group_setting_of_muon_is_a_front_door_setting():
    """The names: every Muon keyword that is a group setting is accepted by the JSON and by prepare/Trainer."""
    from ds_muon.deepspeed import accepted_params
    from ds_muon.setup.build import MUON_SETTINGS  # what prepare and MuonTrainer accept

    defaults = ds_muon.Muon([_model()[0].weight]).defaults
    group_keywords = [k for k in IN_MUON if k in defaults]
    assert "weight_decay_mode" in group_keywords
    missing = {door: [k for k in group_keywords if k not in keys]
               for door, keys in (("DsMuon JSON", accepted_params()), ("accelerate/Trainer", MUON_SETTINGS))}
    assert not any(missing.values()), missing


@pytest.mark.parametrize("key", KEYS)
def test_dsmuon_json_reaches_the_groups(key, tmp_path):
    """From a JSON file (optimizer_from_config, what accelerate's DeepSpeed path reads) and from the
    entry's params (build_optimizer, what ds_muon.deepspeed.initialize builds)."""
    from ds_muon.deepspeed import build_optimizer, optimizer_from_config

    _known(key)
    good, _ = NEW_SETTINGS[key]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                                "optimizer": {"type": "DsMuon", "params": {"lr": 0.01, key: good}}}))
    config, muon = optimizer_from_config(_model(), str(path))
    assert "optimizer" not in config
    assert [g[key] for g in _muon_groups(muon)] == [good]
    assert [g[key] for g in _muon_groups(build_optimizer(_model(), {key: good}))] == [good]


@pytest.mark.parametrize("key", KEYS)
def test_dsmuon_json_bad_value_names_the_key(key):
    from ds_muon.deepspeed import build_optimizer

    _known(key)
    _, bad = NEW_SETTINGS[key]
    with pytest.raises(ValueError, match=rf"{key}.*{bad}|{key}="):
        build_optimizer(_model(), {key: bad})


def test_dsmuon_json_hints_other_libraries_spellings():
    """Emerging-Optimizers' ``weight_decay_method`` and dion's ``cautious_wd`` / ``muon_beta2`` are refused
    with the key to use (the entry still refuses every unknown key)."""
    from ds_muon.deepspeed import parse_params

    for theirs, ours in (("weight_decay_method", '"weight_decay_mode"'), ("cautious_wd", '"weight_decay_mode": "cautious"'),
                         ("muon_beta2", '"normuon_beta2"')):
        with pytest.raises(ValueError, match=rf'unknown key\(s\) \[\'{theirs}\'\].*for "{theirs}" use {ours}'):
            parse_params({theirs: True})


@pytest.mark.parametrize("key", KEYS)
def test_accelerate_and_trainer_deepspeed_path(key):
    """The DeepSpeed path prepare and MuonTrainer share: the config's entry with keyword settings over it."""
    from ds_muon.accelerate import build_deepspeed_muon, take_dsmuon_entry

    _known(key)
    good, bad = NEW_SETTINGS[key]
    default = inspect.signature(ds_muon.Muon.__init__).parameters[key].default
    cfg = {"optimizer": {"type": "DsMuon", "params": {key: default}}, "zero_optimization": {"stage": 2}}
    params = take_dsmuon_entry(cfg, {key: good})  # the keyword setting wins over the entry
    assert [g[key] for g in _muon_groups(build_deepspeed_muon(_model(), params))] == [good]
    with pytest.raises(ValueError, match=rf"{key}"):
        build_deepspeed_muon(_model(), take_dsmuon_entry({"zero_optimization": {"stage": 2}}, {key: bad}))


@pytest.mark.parametrize("key", KEYS)
def test_accelerate_prepare_reaches_the_groups(key):
    """One process: ``prepare(accelerator, model, key=value)``; a bad value raises from prepare, naming
    the key, before accelerate wraps anything."""
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from ds_muon.accelerate import Accelerator, find_muon, prepare

    _known(key)
    good, bad = NEW_SETTINGS[key]
    try:
        accelerator = Accelerator(cpu=True)
        _, opt = prepare(accelerator, _model(), lr=0.01, **{key: good})
        assert [g[key] for g in _muon_groups(find_muon(opt))] == [good]
        with pytest.raises(ValueError, match=rf"{key}"):
            prepare(accelerator, _model(), **{key: bad})
    finally:
        for state in (AcceleratorState, GradientState, PartialState):
            state._reset_state()


@pytest.mark.parametrize("key", KEYS)
def test_trainer_settings_reach_the_groups(key, tmp_path):
    """``MuonTrainer(muon_settings={key: value})``: the optimizer it builds carries it; a bad value raises
    from create_optimizer (before any step), naming the key, and leaves no optimizer behind."""
    pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from transformers import TrainingArguments

    from ds_muon.trainer import MuonTrainer

    _known(key)
    good, bad = NEW_SETTINGS[key]
    from hf_models import FAMILIES

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True,
                             disable_tqdm=True)
    try:
        trainer = MuonTrainer(model=FAMILIES["llama"](), args=args, muon_settings={key: good})
        trainer.create_optimizer()
        assert [g[key] for g in _muon_groups(trainer.muon)] == [good]
        trainer = MuonTrainer(model=FAMILIES["llama"](), args=args, muon_settings={key: bad})
        with pytest.raises(ValueError, match=rf"{key}"):
            trainer.create_optimizer()
        assert trainer.optimizer is None and trainer.muon is None
    finally:
        for state in (AcceleratorState, GradientState, PartialState):
            state._reset_state()
