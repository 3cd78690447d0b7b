"""``ds-muon plan``: the optimizer's planner and the baselines on real shapes, without processes."""

import json

import pytest
import torch
from torch import nn

from ds_muon import cli
from ds_muon.engine.plan import costs, mesh_costs
from ds_muon.engine.plan.cost_model import CostModel, MatrixTask
from ds_muon.engine.plan.planner import plan_homes


def test_plan_preset_json_all_strategies(capsys):
    assert cli.main(["plan", "--preset", "llama-7b", "--world-sizes", "8", "256", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by = {(r["world_size"], r["strategy"]): r for r in rows}
    assert set(by) == {(w, s) for w in (8, 256) for s in cli.ALL_STRATEGIES}
    for r in rows:
        assert r["matrices"] == 32 * 7 and r["ns_max_over_bound"] >= 1.0
    # partitioned (ZeRO/FSDP1) layout: the locality plan moves far less than plain LPT, and is no slower
    assert by[(8, "locality")]["total_bytes_moved"] < 0.1 * by[(8, "lpt")]["total_bytes_moved"]
    assert by[(8, "locality")]["modelled_step_ms"] <= by[(8, "lpt")]["modelled_step_ms"]
    # one fused exchange each way vs one collective per matrix
    assert by[(8, "locality")]["collectives_per_step"] == 2 and by[(8, "duplicated")]["collectives_per_step"] == 224
    # every rank runs every NS in the baseline
    assert by[(256, "duplicated")]["modelled_step_ms"] > 20 * by[(256, "locality")]["modelled_step_ms"]
    assert 1 <= by[(256, "locality")]["waves"] <= 2 and by[(8, "lpt")]["waves"] == 28  # 224 matrices on 8 ranks


def test_plot_and_table(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert cli.main(["plan", "--preset", "gpt-125m", "--world-sizes", "4", "32", "--layout", "replicated",
                     "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| 32 | locality+dup |" in out and png.stat().st_size > 10_000


def test_hf_config_shapes_and_module(tmp_path):
    moe = cli.shapes_from_hf_config({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "intermediate_size": 128, "num_local_experts": 4,
                                     "moe_intermediate_size": 32})
    names = dict(moe)
    assert names["layers.0.k"] == (32, 64) and names["layers.1.experts.3.down"] == (64, 32)
    assert len(moe) == 2 * (4 + 4 * 3)
    with pytest.raises(ValueError, match="hidden_size"):
        cli.shapes_from_hf_config({"num_hidden_layers": 2})
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.Conv1d(16, 4, 3))
    assert cli.shapes_from_module(model) == [("1.weight", (16, 8)), ("2.weight", (4, 48))]
    from hf_models import tiny_qwen2_moe

    moe = dict(cli.shapes_from_module(tiny_qwen2_moe()))  # fused experts: one matrix per expert and half
    assert moe["model.layers.0.mlp.experts.gate_up_proj[3][up]"] == (16, 32)
    assert moe["model.layers.1.mlp.experts.down_proj[0]"] == (32, 16)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in moe and "model.layers.0.mlp.gate.weight" not in moe
    rows = cli.plan_rows(cli.shapes_from_module(model), [2], strategies=["locality", "duplicated"])
    assert [r["strategy"] for r in rows] == ["locality", "duplicated"]
    with pytest.raises(ValueError, match="preset"):
        cli.load_shapes(preset="no-such-model")


def test_baseline_costs_by_hand():
    # one 4x4 matrix split in halves over 2 ranks, bf16 on the wire
    t = MatrixTask(4, 4, 5, 2, (8, 8))
    dup = costs.duplicated_cost([t], 2, CostModel())
    assert dup.bytes_received == [16.0, 16.0] and dup.bytes_sent == [16.0, 16.0] and dup.ns_flops[0] == t.flops
    owner = costs.deepspeed_owner_cost([t], 2, CostModel())
    assert owner.ns_flops == [t.flops, t.flops] and owner.collectives == 1
    sharded = costs.sharded_cost([t], 2, "locality", CostModel())
    assert sum(sharded.ns_flops) == t.flops and sum(sharded.bytes_sent) == 32  # 8 elements in, 8 back
    # replicated over many ranks: extra homes split the broadcast of results
    tasks = [MatrixTask(64, 64, 5, 2, (4096,) * 16) for _ in range(2)]
    single = costs.sharded_cost(tasks, 16, "locality", CostModel())
    dup_homes = costs.duplicate_surplus_cost(tasks, 16, CostModel())
    assert max(dup_homes.bytes_sent) < max(single.bytes_sent)


def test_sharded_rows_are_the_planners_numbers():
    tasks = costs.tasks_for([(768, 768), (3072, 768), (768, 3072)] * 3, 4, "partitioned")
    cm = CostModel(1e12, 1e9)
    plan = plan_homes(tasks, 4, "lpt", cm)
    cost = costs.sharded_cost(tasks, 4, "lpt", cm)
    assert (cost.ns_flops, (cost.bytes_sent, cost.bytes_received), cost.seconds) == \
        (plan.ns_cost, plan.traffic(), plan.step_time())
    # every strategy turns FLOPs and bytes into seconds with the planner's one formula
    for c in (costs.duplicated_cost(tasks, 4, cm), costs.deepspeed_owner_cost(tasks, 4, cm),
              costs.duplicate_surplus_cost(tasks, 4, cm)):
        assert c.seconds == [cm.seconds(f, s + r) for f, s, r in zip(c.ns_flops, c.bytes_sent, c.bytes_received)]


def test_extra_homes_count_the_gather_like_the_planner():
    # no idle rank to add as a home: locality+dup is the locality plan, byte for byte. (It used to
    # count the home sending part of its own missing piece to itself: sent [14, 2] instead of [8, 8].)
    tasks = [MatrixTask(4, 4, 5, 2, (12, 4)), MatrixTask(4, 4, 5, 2, (0, 16))]
    single = costs.sharded_cost(tasks, 2, "locality", CostModel())
    dup_homes = costs.duplicate_surplus_cost(tasks, 2, CostModel())
    assert plan_homes(tasks, 2).homes == [0, 1]
    assert single.bytes_sent == [8, 8] and single.bytes_received == [8, 8]  # 4 elements in, 4 back
    assert (dup_homes.bytes_sent, dup_homes.bytes_received, dup_homes.seconds) == \
        (single.bytes_sent, single.bytes_received, single.seconds)


def test_mesh_hsdp_by_hand():
    """One 64x64 matrix on replicate=2,shard=2, two ranks per node: each row's numbers by hand."""
    cm = CostModel(ranks_per_node=2, intra_bytes_per_s=4e9, bytes_per_s=1e9)
    t = MatrixTask(64, 64)
    piece = 64 * 64 * 2 / 2
    today = mesh_costs.hsdp_cost([t], 2, 2, "per_replica", cm)
    assert today.ns_flops == [t.flops, 0.0, t.flops, 0.0]  # NS once per replica group
    assert today.intra == [2 * piece] * 4 and today.inter == [0.0] * 4
    once = mesh_costs.hsdp_cost([t], 2, 2, "one_home", cm)
    assert once.ns_flops == [t.flops, 0.0, 0.0, 0.0]  # once in the world
    assert once.intra == [2 * piece, 2 * piece, 0.0, 0.0]
    assert once.inter == [piece] * 4  # home group forwards its pieces, the other replica receives them
    dup = mesh_costs.hsdp_cost([t], 2, 2, "duplicated", cm)
    assert dup.ns_flops == [t.flops] * 4 and dup.inter == [0.0] * 4


def test_mesh_choice_follows_the_cost_model():
    """NS once in the world when NS is dearer than the inter-node bytes, per replica group when not."""
    tasks = [MatrixTask(512, 512)] * 8
    slow_ns = CostModel(flops_per_s=1e12, bytes_per_s=1e12, ranks_per_node=4)
    slow_net = CostModel(flops_per_s=1e15, bytes_per_s=1e6, ranks_per_node=4)
    assert mesh_costs.dedupe_pays(tasks[0], slow_ns) and not mesh_costs.dedupe_pays(tasks[0], slow_net)
    a = mesh_costs.hsdp_cost(tasks, 4, 4, "hierarchical", slow_ns)
    b = mesh_costs.hsdp_cost(tasks, 4, 4, "hierarchical", slow_net)
    assert a.step_seconds() == mesh_costs.hsdp_cost(tasks, 4, 4, "one_home", slow_ns).step_seconds()
    assert b.step_seconds() == mesh_costs.hsdp_cost(tasks, 4, 4, "per_replica", slow_net).step_seconds()
    assert max(b.inter) == 0 and max(a.ns_flops) < max(b.ns_flops)
    for cm in (slow_ns, slow_net):  # never slower than either pure plan
        h = mesh_costs.hsdp_cost(tasks, 4, 4, "hierarchical", cm).step_seconds()
        assert h <= min(mesh_costs.hsdp_cost(tasks, 4, 4, s, cm).step_seconds() for s in ("one_home", "per_replica"))


def test_plan_mesh_cli(capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert cli.main(["plan", "--preset", "gpt-125m", "--mesh", "replicate=4,shard=8", "dp=4,tp=8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    n = len(mesh_costs.MESH_STRATEGIES)
    assert [r["mesh"] for r in rows] == ["replicate=4,shard=8"] * n + ["dp=4,tp=8"] * n
    assert [r["strategy"] for r in rows[:n]] == list(mesh_costs.MESH_STRATEGIES)
    hsdp = {r["strategy"]: r for r in rows[:n]}
    assert hsdp["per_replica"]["max_inter_node_MB"] == 0  # shard groups inside a node
    assert hsdp["one_home"]["ns_tflop_per_rank"] < hsdp["per_replica"]["ns_tflop_per_rank"]
    assert hsdp["hierarchical"]["modelled_step_ms"] <= min(hsdp["one_home"]["modelled_step_ms"],
                                                           hsdp["per_replica"]["modelled_step_ms"])
    assert cli.main(["plan", "--preset", "gpt-125m", "--mesh", "replicate=4,shard=8", "--ranks-per-node", "8"]) == 0
    assert "8 ranks per node" in capsys.readouterr().out


def test_mesh_auto_row_is_the_optimizers_plan():
    """The mesh table's "auto" row plans on the optimizer's input: the holdings and replica groups an HSDP
    2x2 layout gives the planner (as tests/test_mesh_plan.py's), so bytes between replica groups
    follow the cost model exactly as in the optimizer."""
    from ds_muon.engine.exchange.routes import replica_groups
    from ds_muon.engine.plan.planner import plan_multi_homes

    n = 1024
    tasks = mesh_costs.mesh_tasks([(n, n)] * 4, "hsdp", 2, 2)
    assert tasks == [MatrixTask(n, n, 5, 2, (n * n // 2,) * 4, groups=replica_groups([[0, 2], [1, 3]]))] * 4
    dear_bytes = CostModel(flops_per_s=1e15, bytes_per_s=1e6, ranks_per_node=2, intra_bytes_per_s=1e12)
    dear_ns = CostModel(flops_per_s=1e3, bytes_per_s=1e12, ranks_per_node=2, intra_bytes_per_s=1e12)
    for cm, several in ((dear_bytes, 4), (dear_ns, 0)):
        row = {r["strategy"]: r for r in mesh_costs.mesh_rows([(n, n)] * 4, "replicate=2,shard=2", cm)}["auto"]
        homes = plan_multi_homes(tasks, 4, cm)
        assert sum(len(h) > 1 for h in homes) == several and f"{several} of 4 with several homes" in row["note"]
        assert (row["max_inter_node_MB"] == 0) == (several == 4), (row, homes)


@pytest.mark.parametrize("spec", ["replicate=4", "pp=2,dp=4", "dp=x,tp=2", "dp=0,tp=8"])
def test_bad_mesh_names_the_flag(spec):
    with pytest.raises(ValueError, match="--mesh"):
        mesh_costs.parse_mesh(spec)


def test_auto_row_is_the_optimizers_plan():
    """`--strategies auto` counts plan_multi_homes' homes: duplication for a small DDP model, where
    one home per matrix must send every result to W-1 ranks."""
    from ds_muon.engine.plan.cost_model import rank_seconds
    from ds_muon.engine.plan.planner import plan_multi_homes

    shapes = [(768, 768)] * 8 + [(3072, 768)] * 4
    cm = CostModel()
    tasks = costs.tasks_for(shapes, 8, "replicated")
    rows = {r["strategy"]: r for r in costs.compare(tasks, 8, cm, ["locality", "duplicated", "auto"])}
    homes = plan_multi_homes(tasks, 8, cm)
    t_rank = [0.0] * 8
    for t, hs in zip(tasks, homes):
        for r, v in rank_seconds(t, hs, cm).items():
            t_rank[r] += v
    assert rows["auto"]["modelled_step_ms"] == round(max(t_rank) * 1e3, 4)
    assert rows["auto"]["modelled_step_ms"] < rows["locality"]["modelled_step_ms"]
    assert rows["auto"]["modelled_step_ms"] <= rows["duplicated"]["modelled_step_ms"]


def test_plan_exchange_columns_follow_the_cost_model(capsys):
    """--exchange adds each sharded row's busiest rank's peer count and the transport the cost
    model picks for it: all_to_all where a rank talks to every other (LPT at W=8), batched p2p at
    W=4096 where the locality plan talks to few peers."""
    assert cli.main(["plan", "--preset", "gpt-125m", "--world-sizes", "8", "4096", "--layout", "partitioned",
                     "--strategies", "locality", "lpt", "duplicated", "--exchange", "auto", "--json"]) == 0
    by = {(r["world_size"], r["strategy"]): r for r in json.loads(capsys.readouterr().out)}
    small, large = by[(8, "lpt")], by[(4096, "locality")]
    assert small["max_peers"] == 7 and small["transport"] == "all_to_all"
    cm = CostModel(exchange="auto")
    assert large["max_peers"] < 4095
    assert large["transport"] == cm.transport(4096, large["max_peers"]) == "p2p"
    assert by[(8, "duplicated")]["transport"] == "-"  # a baseline's collectives are not the exchange
    assert cli.main(["plan", "--preset", "gpt-125m", "--world-sizes", "8", "--json"]) == 0
    assert "transport" not in json.loads(capsys.readouterr().out)[0]  # without --exchange: no columns
