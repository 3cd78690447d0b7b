"""The census (``tools/census.py``): every model type the installed transformers builds from a config
in code is classified by ds_muon's rules, with no tensor outside the closed list of kinds and nothing
on Muon but hidden linear maps; a seeded sample takes one finite single-process step.  It is also a
proof (issue 32): each family's forward is read on the meta device and the decision checked against
it tensor by tensor (the fused splits the forward performs are the splits made, no stem or head on
Muon), for the transformers families and for the models without a config written in
``tests/trace_models.py`` (torchvision ResNet / detection backbone, timm ViT).  Issue 40: the same beyond
transformers (every diffusers model class, litgpt's named configs), with no ``example_inputs``, and every
final layer (read from the autograd graph, not the trace) on AdamW."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
sys.path.insert(0, os.path.dirname(__file__))
import census  # noqa: E402
import trace_models  # noqa: E402

from ds_muon.models.kinds import KINDS, MUON_KINDS  # noqa: E402

MUST_TRACE = ("llama", "gpt2", "phi3", "gpt_neox", "mixtral", "qwen2_moe", "qwen3_next", "mamba", "llama4_text",
              "gpt_oss", "vit", "resnet")


FULL = os.environ.get("DS_MUON_CENSUS_FULL") == "1"  # read every family's forward (else a seeded 60 + MUST_TRACE)


def test_every_family_that_builds_is_classified_into_known_kinds():
    rows = census.census(step=4, seed=0, read=None if FULL else 60, must_read=MUST_TRACE)
    built = [r for r in rows if r.built]
    assert len(rows) > 400 and len(built) > 0.8 * len(rows)  # the installed transformers, all of it
    classified = [r for r in built if not r.refused]
    for r in classified:
        assert set(r.kinds) <= set(KINDS), (r.family, r.kinds)  # the closed list
        assert r.muon == sum(n for k, n in r.kinds.items() if k in MUON_KINDS), r.family
    refused = [r for r in built if r.refused]
    for r in refused:  # a refusal names the tensor and what to do, never a crash
        assert r.error.startswith(("NotImplementedError", "ValueError")), (r.family, r.error)
    assert len(classified) >= 0.85 * len(built), [(r.family, r.error) for r in refused]
    by_name = {r.family: r for r in rows}
    for family in ("phi3", "gpt_neox", "gpt2", "gpt_oss", "qwen3_next", "mamba"):  # fused projections split
        assert by_name[family].fused, family
    stepped = [r for r in rows if r.step]
    assert len(stepped) == 4 and all(r.step == "finite" or r.step.startswith("skipped") for r in stepped), \
        [(r.family, r.step) for r in stepped]
    assert sum(r.step == "finite" for r in stepped) >= 2, [(r.family, r.step) for r in stepped]
    # the proof: the traced truth against the decision, every family whose forward was read
    assert not [(r.family, r.disagreements) for r in classified if r.disagreements]
    read = [r for r in classified if not r.trace_error.startswith("not read")]
    traced = [r for r in read if not r.trace_error]
    assert len(read) >= (len(classified) if FULL else 60) and len(traced) >= 0.55 * len(read), (len(read), len(traced))
    assert sum(r.forward_splits for r in traced) == sum(r.splits_made for r in traced) > (200 if FULL else 30)
    for family in MUST_TRACE:
        r = by_name[family]
        assert not r.trace_error and r.by_fallback == 0 and r.by_trace > 0, (family, r.trace_error, r.by_fallback)


@pytest.mark.parametrize("family", sorted(trace_models.FAMILIES))
def test_models_without_a_config_traced_and_agree(family):
    row = census.classify_model(census.Row(family), trace_models.FAMILIES[family]())
    assert not row.refused and not row.trace_error, (row.error, row.trace_error)
    assert row.by_fallback == 0 and not row.disagreements, row.disagreements
    assert row.forward_splits == row.splits_made == (2 if family == "vit" else 0)
    # the FPN's output is a dict of 4 feature maps, each made by its own layer block: 4 final layers (issue 40)
    assert row.kinds["input layer"] == 1 and row.kinds["output head"] == (4 if family == "resnet_fpn" else 1)
    assert row.finals == row.finals_adamw == row.kinds["output head"], (row.finals, row.finals_adamw)


# -- beyond transformers: diffusers' model classes and litgpt's named configs (issue 40) ----------------------
BEYOND_MUST = ("UNet2DConditionModel", "UNet2DModel", "DiTTransformer2DModel", "PixArtTransformer2DModel",
               "SD3Transformer2DModel", "FluxTransformer2DModel", "AutoencoderKL",
               "pythia-14m", "Llama-3.2-1B", "Gemma-2-2b", "phi-2")
BEYOND_SAMPLE = 4  # seeded classes or configs of each library beside BEYOND_MUST (all with DS_MUON_CENSUS_FULL=1)


def test_beyond_transformers_classified_traced_and_agree():
    pytest.importorskip("diffusers")
    pytest.importorskip("litgpt")
    rows = census.census_beyond(seed=0, sample=None if FULL else BEYOND_SAMPLE, must=BEYOND_MUST)
    assert len(census.diffusers_classes()) > 100 and len(census.litgpt_configs()) > 100  # enumerated, all of them
    by_name = {r.family: r for r in rows}
    assert set(BEYOND_MUST) <= set(by_name)
    built = [r for r in rows if r.built]
    assert len(built) >= (0.8 if FULL else 0.7) * len(rows), [(r.family, r.error) for r in rows if not r.built]
    classified = [r for r in built if not r.refused]
    for r in built:  # a refusal: a model of one projection (its only matrix is its output layer), said so
        assert not r.refused or r.error.startswith("ValueError: muon_param_groups: no hidden weight matrix"), \
            (r.family, r.error)
    assert len(classified) >= 0.95 * len(built)
    for r in classified:
        assert set(r.kinds) <= set(KINDS), (r.family, r.kinds)
        assert r.muon == sum(n for k, n in r.kinds.items() if k in MUON_KINDS), r.family
    # the proof: splits, stems and final layers against the traced forward and the autograd graph
    assert not [(r.family, r.disagreements) for r in classified if r.disagreements]
    traced = [r for r in classified if not r.trace_error]
    assert len(traced) >= (0.6 if FULL else 0.7) * len(classified), [(r.family, r.trace_error) for r in classified]
    assert sum(r.forward_splits for r in traced) == sum(r.splits_made for r in traced) > (100 if FULL else 10)
    for name in BEYOND_MUST:  # no example_inputs: every matrix decided from the forward, the final layer on AdamW
        r = by_name[name]
        assert r.built and not r.trace_error and r.by_fallback == 0 and r.by_trace > 0, (name, r.error, r.trace_error)
        assert r.finals >= 1 and r.finals_adamw == r.finals, (name, r.finals, r.finals_adamw)
    for name in ("pythia-14m", "Llama-3.2-1B", "Gemma-2-2b", "phi-2"):  # litgpt's fused qkv, split as it splits it
        assert by_name[name].forward_splits >= 2 and by_name[name].fused, (name, by_name[name].fused)
