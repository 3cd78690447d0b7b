"""The one decision (``ds_muon/models/decide.py``, issue 43): over a zoo of models and settings that reaches
every rule, each tensor's decision is the first rule of ``PRECEDENCE`` that applies, that rule gives one of
the kinds its entry lists, every rule decides some tensor (none is dead), and the model map is the same
read through every entry (``read``, ``classify``, ``model_map``, FSDP1's one-tensor ``param_decision``).

The zoo: the config-less models of issue 40 (``tests/map_models.py``) and of issue 32
(``tests/trace_models.py``), tiny transformers families built on the meta device, and hand-made modules
for the rules no family reaches (parametrizations, the old ``weight_norm``, recurrent gates, depthwise and
stem convs, ``nn.MultiheadAttention``, tied weights, PEFT's adapters where peft is installed).
"""

from __future__ import annotations

import collections
import os
import sys
import warnings

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
import map_models  # noqa: E402
import trace_models  # noqa: E402

from ds_muon.models.decide import PRECEDENCE, decide  # noqa: E402
from ds_muon.models.evidence import Rules, TensorView  # noqa: E402
from ds_muon.models.reading import classify, model_map, param_decision, read  # noqa: E402
from ds_muon.tensors.shape import global_shape  # noqa: E402

HF_FAMILIES = ("llama", "gpt2", "phi3", "mixtral", "qwen2_moe", "mamba", "whisper", "vit", "bert", "gpt_neox", "resnet",
               "aimv2")


class WeightNormed(nn.Module):
    """torch's parametrized weight norm (original0/original1) beside the old ``weight_g``/``weight_v``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.new = torch.nn.utils.parametrizations.weight_norm(nn.Linear(8, 8))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.old = torch.nn.utils.weight_norm(nn.Linear(8, 8))
        self.out = nn.Linear(8, 16)

    def forward(self, idx):
        return self.out(self.old(torch.relu(self.new(self.emb(idx)))))


class Recurrent(nn.Module):
    """An LSTM and a GRU (gates apart), a multi-head attention (its fused ``in_proj_weight``), tied weights."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x, _ = self.lstm(self.emb(idx))
        x, _ = self.gru(x)
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return self.head(self.norm(x))


class Convs(nn.Module):
    """A stem reading the 3 input channels, a depthwise conv, a pointwise one, a raw layer scale."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pw = nn.Conv2d(8, 8, 1)
        self.scale = nn.Parameter(torch.ones(8, 1, 1))
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.pw(self.dw(self.stem(x))) * self.scale
        return self.fc(x.mean((2, 3)))


class ChannelNorm(nn.Module):
    """A norm whose gain is stored ``[1, d]`` (2-D, yet a norm's tensor, not a map)."""

    def __init__(self, d=8):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1, d))

    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True) * self.weight


class LookedUp(nn.Module):
    """A raw table read through ``F.embedding`` (a relative-position bias), a 2-D-gain norm, a linear."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(16, 8))
        self.norm = ChannelNorm(8)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, idx):
        x = torch.nn.functional.embedding(idx, self.table)
        return self.out(self.mix(self.norm(x)))


def _hf(family):
    import census

    return census.build(family, tiny=True)


def _peft_model():
    peft = pytest.importorskip("peft")
    base = map_models.build("transposed_lm")
    cfg = peft.LoraConfig(r=2, target_modules=["up", "down", "output_layer"], modules_to_save=["norm"])
    return peft.get_peft_model(base, cfg)


def zoo():
    """``(label, build, options)`` for every member of the zoo."""
    for name in map_models.MODELS:
        yield f"map:{name}", (lambda name=name: map_models.build(name)), {
            "example_inputs": map_models.example_inputs(name)}
    for name in ("resnet18", "vit"):
        yield f"trace:{name}", trace_models.FAMILIES[name], {}
    for family in HF_FAMILIES:
        yield f"hf:{family}", (lambda family=family: _hf(family)), {}
    yield "hf:qwen2_moe routers=muon", (lambda: _hf("qwen2_moe")), {"routers": "muon"}
    yield "hf:llama heads", (lambda: _hf("llama")), {"split_attention": "heads"}
    yield "hf:phi3 rules only", (lambda: _hf("phi3")), {"trace": False}
    yield "weight_normed", WeightNormed, {"example_inputs": torch.zeros(1, 4, dtype=torch.long)}
    yield "recurrent", Recurrent, {"example_inputs": torch.zeros(1, 4, dtype=torch.long)}
    yield "looked_up", LookedUp, {"example_inputs": torch.zeros(1, 4, dtype=torch.long)}
    yield "convs", Convs, {"example_inputs": torch.zeros(1, 3, 8, 8)}
    yield "convs head_names", Convs, {"example_inputs": torch.zeros(1, 3, 8, 8), "head_names": ("pw",)}
    yield "peft", _peft_model, {"example_inputs": map_models.example_inputs("transposed_lm")}


def _first_rule(rules, mod_name, mod, pname, p):
    """The first entry of PRECEDENCE whose rule applies, walked here entry by entry, and what it gives."""
    t = TensorView(rules, mod_name, mod, pname, global_shape(p), p, rules.use_of(mod, pname))
    for entry in PRECEDENCE:
        d = entry.rule(t)
        if d is not None:
            return entry, d
    raise AssertionError("no rule decided")


def test_each_decision_is_the_first_rule_that_applies_and_no_rule_is_dead():
    used = collections.Counter()
    members = 0
    for label, build, options in zoo():
        try:
            model = build()
        except pytest.skip.Exception:
            continue
        members += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rules = Rules(model, **options)
            once = read(model, rules)
            owners = {}
            for mod_name, mod in model.named_modules():
                for pname, p in mod.named_parameters(recurse=False):
                    owners.setdefault(id(p), (mod_name, mod, pname))
            for i, (name, d) in once.decided.items():
                mod_name, mod, pname = owners[i]
                p = dict(model.named_parameters())[name]
                entry, first = _first_rule(rules, mod_name, mod, pname, p)
                assert first == d == decide(rules, mod_name, mod, pname, global_shape(p), p), (label, name)
                assert not entry.kinds or d.kind in entry.kinds, (label, name, entry.rule.__name__, d)
                assert once.owners[i] == (pname, mod), (label, name)
                used[entry.rule.__name__] += 1
    assert members >= 20
    dead = [e.rule.__name__ for e in PRECEDENCE if not used[e.rule.__name__]]
    if "peft" not in sys.modules:  # the PEFT rules need peft's models
        dead = [n for n in dead if not n.startswith("peft_")]
    assert not dead, (dead, dict(used))


@pytest.mark.parametrize("family", ["gpt2", "mixtral"])
def test_every_entry_reads_the_same_map(family):
    """``read``, ``classify``, ``model_map`` and the one-tensor ``param_decision`` (FSDP1's) agree tensor by
    tensor on the same model and settings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _hf(family)
        once = read(model)
        by_name = model_map(model)
        assert {n: d for n, d in once.decided.values()} == by_name
        assert classify(model, once.rules) == once.decided
        for i, (name, d) in once.decided.items():
            pname, mod = once.owners[i]
            mod_name = name[: -len(pname) - 1] if name != pname else ""
            p = dict(model.named_parameters())[name]
            assert param_decision(pname, global_shape(p), mod_name, mod, param=p) == d, name


def test_the_snapshot_tool_sees_a_changed_decision(tmp_path, capsys):
    """``tools/decision_snapshot.py`` (how issue 43 showed every decision unchanged): two runs over the same tree
    compare equal, and one changed decision is reported with its model, setting and tensor."""
    import json

    import decision_snapshot

    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert decision_snapshot.main([a, "--only", "gpt2,mixtral"]) == 0
        assert decision_snapshot.main([b, "--only", "gpt2,mixtral"]) == 0
    assert decision_snapshot.compare(a, b) == 0
    snap = json.load(open(b))
    assert len(snap) == 2 * len(decision_snapshot.SETTINGS)
    key = "transformers:mixtral | default"
    name = next(n for n, d in snap[key].items() if d[0] == "muon")
    snap[key][name][0] = "adamw"
    json.dump(snap, open(b, "w"))
    capsys.readouterr()
    assert decision_snapshot.compare(a, b) == 1
    out = capsys.readouterr().out
    assert f"{key}: 1 differ" in out and name in out
