"""The census (``tools/census.py``): every model type the installed transformers builds from a config
in code is classified by ds_muon's rules, with no tensor outside the closed list of kinds and nothing
on Muon but hidden linear maps; a seeded sample takes one finite single-process step."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
import census  # noqa: E402

from ds_muon.models.kinds import KINDS, MUON_KINDS  # noqa: E402


def test_every_family_that_builds_is_classified_into_known_kinds():
    rows = census.census(step=4, seed=0)
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
    for family in ("phi3", "gpt_neox", "gpt2", "gpt_oss"):  # fused projections split, sizes from the config
        assert by_name[family].fused, family
    stepped = [r for r in rows if r.step]
    assert len(stepped) == 4 and all(r.step == "finite" or r.step.startswith("skipped") for r in stepped), \
        [(r.family, r.step) for r in stepped]
    assert sum(r.step == "finite" for r in stepped) >= 2, [(r.family, r.step) for r in stepped]
