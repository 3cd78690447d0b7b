"""The census (``tools/census.py``): every model type the installed transformers builds from a config
in code is classified by ds_muon's rules, with no tensor outside the closed list of kinds and nothing
on Muon but hidden linear maps; a seeded sample takes one finite single-process step.  It is also a
proof (issue 32): each family's forward is read on the meta device and the decision checked against
it tensor by tensor (the fused splits the forward performs are the splits made, no stem or head on
Muon), for the transformers families and for the models without a config written in
``tests/trace_models.py`` (torchvision ResNet / detection backbone, timm ViT)."""

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
    assert row.kinds["input layer"] == 1 and row.kinds["output head"] == (0 if family == "resnet_fpn" else 1)
