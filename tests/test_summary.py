"""``Muon.summary()`` (ds_muon/engine/report/summary.py) tells what the optimizer actually does.

Each column is checked against the optimizer's own state, not against the summary's
own arithmetic: Muon/AdamW against the param groups, reasons against the model's
modules, matrix keys and shapes against the bound layouts, scale factors against
:func:`ds_muon.rules.update.apply_coefficients` (what the step applies), home ranks and bytes
against the exchanges a sharded FSDP2 step compiled on each rank.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ds_muon
from ds_muon.engine.exchange.layout import matrix_shape
from ds_muon.rules.newton_schulz import ns_flops
from ds_muon.engine.plan.cost_model import CostModel
from ds_muon.tensors.tag_keys import is_transposed
from ds_muon.rules.update import apply_coefficients

import dist_harness
from hf_models import hf_batches, hf_loss, tiny_gpt2, tiny_llama, tiny_qwen2_moe

LR = 0.02


def _train(model, opt, steps=2):
    for idx in hf_batches(steps):
        hf_loss(model, idx).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _params_by_name(opt):
    return {n: (g, p) for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])}


def _check_against_optimizer(opt, s):
    """Every row agrees with the param groups, the bound layouts and the update's coefficients."""
    by_name = _params_by_name(opt)
    assert [t.name for t in s.tensors] == [n for g in opt.param_groups for n in g["param_names"]]
    layout_matrices = {m.key: m for lay in opt.runtime.layouts for m in lay.matrices}
    for t in s.tensors:
        g, p = by_name[t.name]
        assert (t.algorithm == "Muon") == g["use_muon"], t.name
        assert t.shape == tuple(p.shape)
        if not g["use_muon"]:
            assert t.matrices == ()
            continue
        assert [m.key for m in t.matrices] == [sl.key for sl in opt.runtime.bindings[id(p)].matrices]
        for m in t.matrices:
            assert m.shape == matrix_shape(layout_matrices[m.key].shape)
            _, alpha = apply_coefficients(g, m.shape, is_transposed(p))
            assert alpha == -float(g["lr"]) * m.scale, (m.key, alpha, m.scale)
    assert {m.key for m in s.matrices} == set(layout_matrices)


def _expected_reason(model, name):
    """The reason read from the model's modules (independently of ds_muon.models.reading)."""
    module_name, _, pname = name.rpartition(".")
    mod = model.get_submodule(module_name)
    p = mod.get_parameter(pname)
    if isinstance(mod, nn.Embedding):
        return "embedding"
    if module_name.rsplit(".", 1)[-1] == "lm_head":
        return "output head"
    if module_name.endswith("gate") and not module_name.endswith("experts"):  # Qwen2-MoE routers
        return "router"
    return "hidden matrix" if p.ndim >= 2 else f"{p.ndim}-D"


# -- single process ------------------------------------------------------------------
def test_llama_rows_match_the_optimizer():
    model = tiny_llama()
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=LR), ns_dtype=torch.float32)
    before = opt.summary()  # before any step: binds and plans itself
    _check_against_optimizer(opt, before)
    for t in before.tensors:
        assert t.reason == _expected_reason(model, t.name), t.name
        if t.algorithm == "Muon":  # an untagged weight is one matrix keyed by its name
            assert [m.key for m in t.matrices] == [t.name]
    reasons = {t.name: t.reason for t in before.tensors}
    assert reasons["model.embed_tokens.weight"] == "embedding" and reasons["lm_head.weight"] == "output head"
    assert reasons["model.norm.weight"] == "1-D"
    # one rank: every matrix is homed at 0, nothing moves, FLOPs are those of every matrix
    [rank] = before.ranks
    assert rank.rank == 0 and rank.bytes_sent == rank.bytes_received == 0
    assert rank.matrices == len(before.matrices) == 14
    assert rank.ns_flops == sum(ns_flops(*m.shape, m.ns_steps, m.ns_method) for m in before.matrices)
    assert all(m.homes == (0,) for m in before.matrices)
    _train(model, opt)
    after = opt.summary()
    assert after.tensors == before.tensors and after.ranks == before.ranks
    text = str(after)
    assert "model.layers.1.mlp.down_proj.weight" in text and "output head" in text and "per rank" in text
    assert after.muon_tensors == 14 and after.adamw_tensors == 7


def test_gpt2_transposed_and_spectral_scales():
    """Conv1D weights are stored [in, out]: the scale reads [out, in], as the update does."""
    model = tiny_gpt2()
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=LR, split_fused=False), extra_scale_factor=0.2)
    s = opt.summary()
    _check_against_optimizer(opt, s)
    row = next(t for t in s.tensors if t.name == "transformer.h.0.attn.c_attn.weight")
    assert row.shape == (32, 96) and row.matrices[0].shape == (32, 96)
    assert row.matrices[0].scale == pytest.approx(0.2 * 3 ** 0.5)  # [out, in] = [96, 32]
    split = ds_muon.Muon(ds_muon.muon_param_groups(tiny_gpt2(), lr=LR), extra_scale_factor=0.2)  # the default
    s = split.summary()
    _check_against_optimizer(split, s)
    row = next(t for t in s.tensors if t.name == "transformer.h.0.attn.c_attn.weight")
    assert [m.shape for m in row.matrices] == [(32, 32)] * 3  # q, k, v column blocks (issue 24)
    assert [m.scale for m in row.matrices] == [pytest.approx(0.2)] * 3
    spectral = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=LR), scale_mode="spectral")
    _check_against_optimizer(spectral, spectral.summary())


def test_moe_experts_are_per_expert_matrices_and_routers_adamw():
    model = tiny_qwen2_moe()
    cfg = model.config
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=LR), ns_dtype=torch.float32)
    s = opt.summary()
    _check_against_optimizer(opt, s)
    rows = {t.name: t for t in s.tensors}
    for t in s.tensors:
        assert t.reason == _expected_reason(model, t.name), t.name
    E, ff, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gate_up = rows["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (E, 2 * ff, d)
    assert [m.key[len(gate_up.name):] for m in gate_up.matrices] == [
        f"[{e}][{w}]" for e in range(E) for w in ("gate", "up")]
    assert {m.shape for m in gate_up.matrices} == {(ff, d)}
    down = rows["model.layers.0.mlp.experts.down_proj"]
    assert [m.shape for m in down.matrices] == [(d, ff)] * E
    assert rows["model.layers.0.mlp.gate.weight"].algorithm == "AdamW"
    assert rows["model.layers.0.mlp.shared_expert_gate.weight"].reason == "router"
    _train(model, opt, steps=1)
    assert opt.summary().tensors == s.tensors

    routed = ds_muon.Muon(ds_muon.muon_param_groups(tiny_qwen2_moe(), routers="muon")).summary()
    router = next(t for t in routed.tensors if t.name == "model.layers.0.mlp.gate.weight")
    assert (router.algorithm, router.reason, router.matrices[0].shape) == ("Muon", "hidden matrix", (E, d))


def test_hand_built_groups_say_user_group():
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(8))
    opt = ds_muon.Muon([{"params": [w]}, {"params": [b], "use_muon": False, "lr": 1e-3}])
    s = opt.summary()
    assert [(t.name, t.algorithm, t.reason) for t in s.tensors] == [
        ("param_groups[0]['params'][0]", "Muon", "user group"), ("param_groups[1]['params'][0]", "AdamW", "user group")]
    assert s.matrices[0].scale == 2 ** 0.5  # shape_scaling of [8, 4]
    assert s.plan_rows(["locality", "duplicated"])[0]["matrices"] == 1


def test_saved_summary_feeds_ds_muon_plan(tmp_path, capsys):
    from ds_muon import cli
    from ds_muon.engine.plan import costs
    from ds_muon.engine.report.rows import Summary

    s = ds_muon.Muon(ds_muon.muon_param_groups(tiny_llama(), lr=LR)).summary()
    s.save(tmp_path / "run.json")
    assert Summary.load(tmp_path / "run.json") == s
    assert cli.main(["plan", "--summary", str(tmp_path / "run.json"), "--world-sizes", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["world_size"], r["strategy"]) for r in rows] == [(w, k) for w in (1, 4) for k in costs.STRATEGIES]
    assert all(r["matrices"] == 14 for r in rows)
    assert rows[0] == s.plan_rows(cost_model=CostModel())[0]  # the CLI's rates: its flags (GPU defaults)


def test_summary_plans_at_the_rates_the_optimizer_planned_with():
    """Muon(cost_model=None) plans at CostModel.for_device; the summary keeps those rates, so its
    table models this run's step (a CPU's), unless another cost model is passed."""
    opt = ds_muon.Muon(ds_muon.muon_param_groups(tiny_llama(), lr=LR))
    s = opt.summary()
    cpu = CostModel.for_device("cpu")
    assert opt.planning_cost_model() == cpu and s.cost_model == dataclasses.asdict(cpu)
    at_cpu, at_gpu = s.plan_rows(["locality"])[0], s.plan_rows(["locality"], CostModel())[0]
    assert at_cpu["modelled_step_ms"] > 100 * at_gpu["modelled_step_ms"]  # 0.5 vs 400 TFLOP/s of NS


def _log_records(caplog, opt, model, steps):
    caplog.clear()
    _train(model, opt, steps)
    return [r for r in caplog.records if r.name == "ds_muon"]


def test_log_line_once_and_opt_out(caplog):
    caplog.set_level(logging.INFO, logger="ds_muon")
    model = tiny_llama()
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=LR))
    records = _log_records(caplog, opt, model, 3)
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "14 tensors Muon (14 matrices), 7 AdamW" in records[0].getMessage()
    assert "GFLOP" in records[0].getMessage() and "MB moved" in records[0].getMessage()

    quiet = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=LR), log_summary=False)
    assert _log_records(caplog, quiet, model, 2) == []
    assert copy.deepcopy(quiet).log_summary is False  # the setting travels with copies


def _keep_log():
    """The ds_muon log lines of this process (at INFO), as they come."""
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger("ds_muon")
    log.setLevel(logging.INFO)
    log.handlers = [Keep()]
    return seen


# -- W=2 FSDP2 -----------------------------------------------------------------------
def _fsdp2_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    seen = _keep_log()
    mesh = init_device_mesh("cpu", (world,))
    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=LR), ns_dtype=torch.float32)
    alone = None
    if rank == 0:  # one rank alone before the first step: what it knows, no collective joined (issue 33)
        alone = str(opt.summary())
    before = opt.summary(all_ranks=True)  # collective: binds on every rank
    _train(model, opt)
    after = opt.summary()
    homes, sent, received = {}, 0, 0
    for ex in opt.exchanges():  # what the step compiled and ran on this rank
        homes.update((ex.layout.matrices[i].key, ex.homes[i]) for i in ex.active)
        sent += ex.bytes_sent
        received += ex.bytes_received
    _check_against_optimizer(opt, after)
    return {"alone": alone, "before": dataclasses.asdict(before), "after": dataclasses.asdict(after), "homes": homes,
            "sent": sent, "received": received, "logged": list(seen), "text": str(after),
            "plan": after.plan_rows(["locality"])[0], "fsdp1": _fsdp1(rank, world) if world == 2 else None,
            "domains": _domains(rank, world) if world == 2 else None}


@pytest.mark.parametrize("world", [2, 3])  # at 2 ranks every rank moves the same bytes; 3 shards unevenly
def test_fsdp2_homes_and_bytes_are_the_exchanges(world):
    """FSDP2: home ranks are the exchanges', every rank's bytes are what that rank's exchanges move;
    at W=2 the same processes also check FSDP1 (:func:`_check_fsdp1`)."""
    out = dist_harness.run(_fsdp2_worker, world, timeout=240)
    assert "planned at the first step" in out[0]["alone"] and "summary(all_ranks=True) called on every rank" in \
        out[0]["alone"]
    planned = {m["key"]: m["shape"] for t in out[0]["before"]["tensors"] for m in t["matrices"]}
    assert all(f"{r} x {c}" in out[0]["alone"] for r, c in planned.values())  # its matrices, from metadata alone
    for rank, r in enumerate(out):
        assert r["after"]["tensors"] == r["before"]["tensors"] and r["after"]["ranks"] == r["before"]["ranks"]
        assert {m["key"]: m["homes"] for t in r["after"]["tensors"] for m in t["matrices"]} == r["homes"]
        # every rank's summary holds every rank's bytes, equal to what that rank's own exchanges move
        for other in out:
            assert other["after"]["ranks"][rank]["bytes_sent"] == r["sent"]
            assert other["after"]["ranks"][rank]["bytes_received"] == r["received"]
        assert r["after"]["rank"] == rank
    ranks = out[0]["after"]["ranks"]
    assert [x["rank"] for x in ranks] == list(range(world))
    assert all(r["after"]["tensors"] == out[0]["after"]["tensors"] and r["after"]["ranks"] == ranks for r in out)
    if world == 3:
        assert len({x["bytes_sent"] for x in ranks}) > 1  # uneven: a wrong rank's bytes would show
    assert sum(x["bytes_sent"] for x in ranks) == sum(x["bytes_received"] for x in ranks) > 0
    matrices = [m for t in out[0]["after"]["tensors"] for m in t["matrices"]]
    assert sum(x["matrices"] for x in ranks) == len(matrices) == 14
    assert sum(x["ns_flops"] for x in ranks) == sum(m["ns_flops"] for m in matrices)
    assert all(x["matrices"] > 0 for x in ranks)  # FSDP2 shards every matrix: the planner spreads NS
    # the planner's table of this run (ds-muon plan --summary) models the bytes the exchanges move
    plan = out[0]["plan"]
    assert (plan["world_size"], plan["matrices"]) == (world, 14)
    assert plan["max_bytes_sent"] == max(x["bytes_sent"] for x in ranks)
    assert plan["total_bytes_moved"] == sum(x["bytes_sent"] for x in ranks)
    assert len(out[0]["logged"]) == 1 and all(r["logged"] == [] for r in out[1:])
    assert "14 tensors Muon (14 matrices), 7 AdamW" in out[0]["logged"][0]
    assert all(f"computed on rank {k}" in r["text"] for k, r in enumerate(out))
    if world == 2:
        _check_fsdp1([r["fsdp1"] for r in out])
        _check_domains([r["domains"] for r in out])


# -- W=2 FSDP1: reasons recorded from FSDP1's metadata ---------------------------------------
def _fsdp1(rank, world):
    """(in the W=2 FSDP2 test's processes, saving a spawn)"""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    out = {}
    for orig in (True, False):
        fsdp = FSDP(tiny_llama(), device_id=torch.device("cpu"), use_orig_params=orig,
                    auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))
        opt = ds_muon.Muon(ds_muon.muon_param_groups(fsdp, lr=LR), model=fsdp)
        s = opt.summary(all_ranks=True)
        _train(fsdp, opt, steps=1)
        assert opt.summary().tensors == s.tensors
        out[orig] = ([(t.name, t.algorithm, t.reason) for t in s.tensors], sorted((m.key, m.shape) for m in s.matrices))
    return out


def _check_fsdp1(out):
    """FSDP1 at W=2, both modes: reasons recorded from FSDP1's metadata, the same matrices."""
    model = tiny_llama()
    plain = ds_muon.Muon(ds_muon.muon_param_groups(model)).summary()
    reasons = {t.name: (t.algorithm, t.reason) for t in plain.tensors}
    matrices = sorted((m.key, m.shape) for m in plain.matrices)
    for r in out:
        orig_rows, orig_matrices = r[True]
        assert {name: (algo, why) for name, algo, why in orig_rows} == reasons  # use_orig_params=True
        flat_rows, flat_matrices = r[False]
        assert {(algo, why) for _, algo, why in flat_rows} == {("Muon+AdamW", "FSDP1 flat parameter")}
        assert orig_matrices == flat_matrices == matrices


# -- W=2 expert domains: each rank's experts in a group of its own ------------------------------
def _domains(rank, world):
    """(in the W=2 FSDP2 test's processes)  A replicated dense matrix, and experts that differ per rank
    in a domain of one rank each: homes are global ranks, and a rank counts only the domains it is in."""
    own = [dist.new_group([r]) for r in range(world)][rank]
    torch.manual_seed(0)
    dense = nn.Parameter(torch.randn(8, 6))
    torch.manual_seed(1 + rank)
    experts = ds_muon.expert_weight(nn.Parameter(torch.randn(2, 4, 6)), domain_group=own)
    opt = ds_muon.Muon([{"params": [dense, experts], "param_names": ["dense", "experts"]}], ns_dtype=torch.float32)
    dense.grad, experts.grad = torch.ones_like(dense), torch.ones_like(experts)
    opt.step()
    homes = {ex.layout.matrices[i].key: tuple(dist.get_process_group_ranks(ex.layout.group or dist.group.WORLD)[h]
                                              for h in ex.homes[i]) for ex in opt.exchanges() for i in ex.active}
    return dataclasses.asdict(opt.summary()), homes, sum(ex.bytes_sent for ex in opt.exchanges())


def _check_domains(out):
    for rank, (s, homes, sent) in enumerate(out):
        matrices = {m["key"]: m for t in s["tensors"] for m in t["matrices"]}
        assert {k: m["homes"] for k, m in matrices.items()} == homes
        assert matrices["experts[0]"]["homes"] == matrices["experts[1]"]["homes"] == (rank,)
        mine = s["ranks"][rank]
        assert mine["matrices"] == 2 + (rank in homes["dense"]) and mine["bytes_sent"] == sent  # auto: may be both
        assert any("expert domains" in n for n in s["notes"])


# -- W=2 DeepSpeed ZeRO-2 and ZeRO-3: flat partitions described by the tensors they hold -------------
def _deepspeed_worker(rank, world):
    import test_deepspeed as T

    out = {}
    for stage in (2, 3):
        seen = _keep_log()
        engine, _, _, _ = T.ds_muon_deepspeed.initialize(model=T.make_model(), config=T.ds_config(stage))
        muon = engine.basic_optimizer
        before = muon.summary(all_ranks=True)
        T.train(engine, 1)
        logged_after_one = list(seen)
        T.train(engine, 2, start=1)
        after = muon.summary()
        homes, sent, received = {}, 0, 0
        for ex in muon.exchanges():
            homes.update((ex.layout.matrices[i].key, ex.homes[i]) for i in ex.active)
            sent += ex.bytes_sent
            received += ex.bytes_received
        out[stage] = {"before": dataclasses.asdict(before), "after": dataclasses.asdict(after), "homes": homes,
                      "sent": sent, "received": received, "logged": list(seen), "logged_after_one": logged_after_one}
    return out


def test_deepspeed_rows_are_the_original_tensors():
    pytest.importorskip("deepspeed")
    import test_deepspeed as T

    plain = T.ds_muon_deepspeed.build_optimizer(T.make_model(), T.PARAMS).summary()
    reasons = [(t.name, t.algorithm, t.reason, t.shape) for t in plain.tensors]
    matrices = sorted((m.key, m.shape, m.scale) for m in plain.matrices)
    out = dist_harness.run(_deepspeed_worker, 2, env=T.ENV, timeout=300)
    for stage in (2, 3):
        for rank, r in enumerate(o[stage] for o in out):
            after = r["after"]
            assert [(t["name"], t["algorithm"], t["reason"], t["shape"]) for t in after["tensors"]] == reasons
            assert sorted((m["key"], m["shape"], m["scale"]) for m in
                          (m for t in after["tensors"] for m in t["matrices"])) == matrices
            assert {m["key"]: m["homes"] for t in after["tensors"] for m in t["matrices"]} == r["homes"]
            for other in out:
                assert other[stage]["after"]["ranks"][rank]["bytes_sent"] == r["sent"]
                assert other[stage]["after"]["ranks"][rank]["bytes_received"] == r["received"]
            if stage == 2:  # ZeRO-1/2 partitions exist before the first step
                assert r["before"]["tensors"] == after["tensors"] and r["before"]["ranks"] == after["ranks"]
            else:  # ZeRO-3 hands them over inside step() only, and the summary says so
                assert not any(t["matrices"] for t in r["before"]["tensors"])
                assert any("after the first step" in n for n in r["before"]["notes"])
        assert out[0][stage]["logged_after_one"] == []  # DeepSpeed: logged once every set has been bound
        assert len(out[0][stage]["logged"]) == 1 and out[1][stage]["logged"] == []
        assert "5 tensors Muon (5 matrices), 6 AdamW" in out[0][stage]["logged"][0]


def test_deepspeed_moe_group_split_keeps_reasons_aligned():
    """DsMuon puts DeepSpeed MoE experts in their own groups: each per-tensor list follows its tensors."""
    from ds_muon.integrations.moe import split_moe_groups

    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 6), nn.Linear(6, 4), nn.Linear(4, 3))  # 3: output layer
    model[1].weight.allreduce, model[1].weight.group_name = False, "ep_size_2"  # how DeepSpeed marks experts
    groups = split_moe_groups(ds_muon.muon_param_groups(model))
    head = "output head (its output is the model's output: traced)"
    assert [(g["param_names"], g["param_reasons"], g.get("name")) for g in groups] == [
        (["2.weight"], ["hidden matrix"], None), (["1.weight"], ["hidden matrix"], "ep_size_2"),
        (["0.weight", "1.bias", "2.bias", "3.weight", "3.bias"], ["embedding", "1-D", "1-D", head, "1-D"], None)]
    assert [g["param_evidence"] for g in groups] == [["trace"], ["trace"], ["trace"] + ["module type"] * 2 + ["trace", "module type"]]
    assert all(len(g["param_tags"]) == len(g["params"]) for g in groups if g["use_muon"])


# -- W=4 HSDP 2x2: the summary plans on the optimizer's input, replica groups included ------------------
def _hsdp_worker(rank, world):
    from test_mesh import OPTS, GatedMLP, _wrap, record
    from test_mesh_plan import INTER_EXPENSIVE

    model = GatedMLP()
    _wrap("hsdp", model)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, **OPTS), cost_model=INTER_EXPENSIVE)  # default planner
    record(model, opt)
    homes = {ex.layout.matrices[i].key: tuple(ex.homes[i]) for ex in opt.exchanges() for i in ex.active}
    s = opt.summary()
    return dict(summary=dataclasses.asdict(s), homes=homes, sent=sum(ex.bytes_sent for ex in opt.exchanges()),
                planner=opt.planner, plan=s.plan_rows(["auto"], INTER_EXPENSIVE)[0])


def test_hsdp_summary_and_its_plan_table_are_the_optimizers_plan(tmp_path):
    """HSDP 2x2 where bytes between replica groups are dear: the default planner gives every matrix one
    home per replica group.  The summary's homes and per-rank NS are the exchanges', and its planner's
    table (``plan_rows``, ``ds-muon plan --summary``) plans on the same input, replica groups included,
    so its "auto" row moves the bytes the exchanges move."""
    out = dist_harness.run(_hsdp_worker, 4, timeout=240)
    homes = out[0]["homes"]
    assert out[0]["planner"] == "auto"
    assert all(sorted(h // 2 for h in hs) == [0, 1] for hs in homes.values()), homes  # one per replica group
    matrices = [m for t in out[0]["summary"]["tensors"] for m in t["matrices"]]
    assert {m["key"]: tuple(m["homes"]) for m in matrices} == homes
    assert all(tuple(map(tuple, m["groups"])) == ((0, 1), (2, 3)) for m in matrices), matrices
    flops = {m["key"]: m["ns_flops"] for m in matrices}
    for rank, r in enumerate(out):
        assert r["homes"] == homes
        mine = sum(flops[k] for k, hs in homes.items() if rank in hs)
        assert [x["ns_flops"] for x in r["summary"]["ranks"] if x["rank"] == rank] == [mine]
        assert [x["bytes_sent"] for x in r["summary"]["ranks"] if x["rank"] == rank] == [r["sent"]]
    plan = out[0]["plan"]
    ranks = out[0]["summary"]["ranks"]
    assert plan["max_bytes_sent"] == max(x["bytes_sent"] for x in ranks) > 0
    assert plan["total_bytes_moved"] == sum(x["bytes_sent"] for x in ranks)
    mean = sum(x["ns_flops"] for x in ranks) / 4
    assert plan["ns_max_over_mean"] == round(max(x["ns_flops"] for x in ranks) / mean, 4)
    # saved and loaded (ds-muon plan --summary): the same table
    from ds_muon.engine.report.rows import Summary
    from test_mesh_plan import INTER_EXPENSIVE

    path = tmp_path / "hsdp.json"
    path.write_text(json.dumps(out[0]["summary"]))
    assert Summary.load(str(path)).plan_rows(["auto"], INTER_EXPENSIVE)[0] == plan
