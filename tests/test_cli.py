"""``ds-muon plan``: the optimizer's planner on real shapes, without processes."""

import json
import os

from ds_muon import cli

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_plan_hf_config_json(capsys):
    cfg = os.path.join(ROOT, "configs", "models", "llama-7b.json")
    assert cli.main(["plan", "--hf-config", cfg, "--world-sizes", "8", "64", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["world_size"], r["strategy"]) for r in rows} == {
        (w, s) for w in (8, 64) for s in ("locality", "lpt", "round_robin")}
    for r in rows:
        assert r["matrices"] == 32 * 7
        assert r["ns_max_over_bound"] >= 1.0
    by = {(r["world_size"], r["strategy"]): r for r in rows}
    # on a partitioned layout the locality plan moves less than plain LPT
    assert by[(8, "locality")]["total_bytes_sent"] < by[(8, "lpt")]["total_bytes_sent"]
    assert by[(64, "lpt")]["ns_max_over_mean"] <= by[(64, "round_robin")]["ns_max_over_mean"]


def test_shapes_file_and_gqa_moe(tmp_path, capsys):
    shapes = {"matrices": [{"name": f"w{i}", "shape": [64, 32 * (i % 3 + 1)]} for i in range(10)]}
    f = tmp_path / "s.json"
    f.write_text(json.dumps(shapes))
    assert cli.main(["plan", "--shapes", str(f), "--world-sizes", "4", "--layout", "replicated"]) == 0
    assert "round_robin" in capsys.readouterr().out
    moe = cli.shapes_from_hf_config({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "intermediate_size": 128, "num_local_experts": 4,
                                     "moe_intermediate_size": 32})
    names = dict(moe)
    assert names["layers.0.k"] == (32, 64) and names["layers.1.experts.3.down"] == (64, 32)
    assert len(moe) == 2 * (4 + 4 * 3)
