"""The door matrix (tests/door_matrix.py) against ds_muon in one process.

CI runs a seeded sample (``DS_MUON_DOORS_SEED``, default 0; ``DS_MUON_DOORS_SAMPLE`` cells, default 16;
about 2 minutes on 2 cores) that always holds issue 44's cases: the Lightning Trainer at ZeRO-3 with the
Muon from ``configure_optimizers`` (the decoder layers as ZeRO-3 leaf modules: bitwise, straight and
resumed; DeepSpeed's default hooks: within the stated tolerance) and docs/TRAINER.md's Trainer at ZeRO-3
with evaluation on.
``DS_MUON_FULL_DOORS=1`` runs every cell (211; 3 min 14 s on 2 cores).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

import door_matrix as dm  # noqa: E402

MUST = (dm.Cell("lightning", "zero3", "optimizer", "plain"), dm.Cell("lightning", "zero3", "optimizer", "resume"),
        dm.Cell("lightning", "zero3", "optimizer", "accumulation+resume"),  # issue 51
        dm.Cell("lightning", "zero3_hooks", "optimizer", "plain"),
        dm.Cell("hf_trainer", "zero3", "helper", "evaluation"))


def chosen():
    if os.environ.get("DS_MUON_FULL_DOORS") == "1":
        return dm.all_cells()
    return dm.sample(int(os.environ.get("DS_MUON_DOORS_SAMPLE", "16")), int(os.environ.get("DS_MUON_DOORS_SEED", "0")),
                     must=MUST)


def test_matrix_is_generated():
    """Every door has every stage it documents, every form and variant; the sample holds the must cells."""
    cells = dm.all_cells()
    assert len(set(cells)) == len(cells)
    for door in dm.DOORS:
        assert {c.stage for c in cells if c.door == door} == set(dm.stages(door)), door
    assert {c.variant for c in cells if c.door != "fabric"} == set(dm.VARIANTS)
    assert {c.form for c in cells if c.door == "lightning"} == {"optimizer", "entry"}
    assert set(MUST) <= set(dm.sample(len(MUST), 1, must=MUST))
    assert all(c in cells for c in MUST)


@pytest.mark.timeout(3600)
def test_doors_against_one_process(tmp_path):
    cells = chosen()
    rows = dm.table(dm.run_cells(cells, str(tmp_path), timeout=3000), dm.references())
    report = "\n".join(f"{'held' if held else 'FAIL'}  {cell.name}  {detail}" for cell, held, detail in rows)
    print(report)
    assert all(held for _, held, _ in rows), report


def test_docs_tables_are_the_generated_ones():
    """docs/LIGHTNING.md, docs/TRAINER.md and docs/ACCELERATE.md carry the matrix's table as the generator states it (which cells
    are bitwise, which within what and why): the table the full run checks."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for page, doors in (("LIGHTNING.md", ("lightning", "fabric")), ("TRAINER.md", ("hf_trainer",)),
                        ("ACCELERATE.md", ("accelerate",))):
        text = open(os.path.join(repo, "docs", page)).read()
        assert dm.docs_table(doors) in text, f"docs/{page}: paste door_matrix.docs_table({doors})"
