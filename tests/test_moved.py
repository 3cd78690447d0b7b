"""Old engine paths (ds_muon.engine.moved): every name an old module had is still served, warned about
at its new home, and a monkeypatch through an old path reaches the module that reads the name."""

import importlib
import json
import subprocess
import sys
import warnings

import pytest

import ds_muon  # noqa: F401 - installs the old paths
from ds_muon.engine.moved import MOVED

# The top-level names of the old modules whose names were split between several modules since.
OLD_NAMES = {
    "ds_muon.engine.planner": """STRATEGIES TEAM_SIZES EXCHANGES CostModel ranks_per_node_from_env MatrixTask Plan
        host_traffic gather_traffic task_traffic _lpt_order plan_homes _plan_locality _home_seconds pair_traffic
        replica_homes rank_seconds plan_multi_homes _Costs MOVE_WORK MOVE_WORK_MIN_RANKS _local_moves _best_duplication
        team_widths team_member_flops team_seconds team_traffic plan_teams _greedy_teams rebalance_homes
        gather_source replica_group_of replica_groups scatter_source""",
    "ds_muon.engine.costs": """SHARDED BASELINES STRATEGIES StrategyCost ns_lower_bound sharded_cost peer_counts
        duplicated_cost deepspeed_owner_cost duplicate_surplus_cost multi_home_cost team_cost compare holdings
        tasks_for MESH_STRATEGIES MeshCost parse_mesh dedupe_pays hsdp_cost tp_cost mesh_tasks planned_mesh_cost
        mesh_rows""",
    "ds_muon.engine.summary": """logger USER_GROUP MB MatrixRow TensorRow RankRow Summary update_scale summarize
        ZERO3_NOTE PLANNED summarize_planned log_first_step _bound_sets _format""",
    "ds_muon.engine.agreement": """HASH_MOD HAS_GRAD NO_GRAD NONFINITE N_HASHED HASH HASH_SQ COLUMNS minmax_hash
        text_hash hashed_row hashes_differ settings_of STEPPED settings_hash first_difference Verdict Rows Agreement
        LocalFailure ACTIVE CONFLICT DRIFT NONFINITE_BIT STALE FAILED FAILED_AT""",
}


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_an_old_path_serves_every_name_from_its_new_home(old):
    module = importlib.import_module(old)
    for name in OLD_NAMES[old].split():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(module, name)
        (w,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        new = str(w.message).split(" moved to ")[1].split(";")[0]
        home, _, attr = new.rpartition(".")
        assert attr == name and home != old and importlib.import_module(home).__dict__[name] is value, (old, name, new)


def test_split_paths_are_listed_with_their_homes():
    assert MOVED["ds_muon.engine.planner"][-1] == "ds_muon.engine.plan.planner"
    assert MOVED["ds_muon.engine.layout"] == ("ds_muon.engine.exchange.layout",)
    with pytest.warns(DeprecationWarning, match="ds_muon.engine.exchange.layout"):
        layout = importlib.import_module("ds_muon.engine.layout")
    assert layout is importlib.import_module("ds_muon.engine.exchange.layout")  # moved whole: the same module


def test_a_monkeypatch_through_a_split_path_reaches_every_reader(monkeypatch):
    from ds_muon.engine.plan import cost_model, planner

    old = importlib.import_module("ds_muon.engine.planner")
    monkeypatch.setattr(old, "MOVE_WORK", 0)
    assert planner.MOVE_WORK == 0
    marker = object()
    monkeypatch.setattr(old, "CostModel", marker)  # defined in cost_model, read by planner too
    assert cost_model.CostModel is marker and planner.CostModel is marker
    monkeypatch.undo()
    assert planner.MOVE_WORK == 5_000_000 and planner.CostModel is cost_model.CostModel is not marker
    with pytest.raises(AttributeError):
        old.no_such_name  # noqa: B018


def test_every_old_path_moved_whole_is_its_new_module_and_warns_once():
    # a fresh interpreter, so each old path is imported there for the first time and its warning is seen
    code = """
import importlib, json, warnings
import ds_muon
from ds_muon.engine.moved import MOVED
out = {}
for old, homes in MOVED.items():
    if len(homes) == 1:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        out[old] = [module is importlib.import_module(homes[0]),
                    [str(w.message) for w in seen if w.category is DeprecationWarning]]
print(json.dumps(out))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(got) == sorted(old for old, homes in MOVED.items() if len(homes) == 1) and len(got) >= 15
    for old, (same, warned) in got.items():
        assert same, f"{old} is not the module {MOVED[old][0]}"
        assert warned == [f"{old} moved to {MOVED[old][0]}; import it from there (the old path goes in the next "
                          "release)"], old


@pytest.mark.parametrize("old, name, new", [("ds_muon.engine.exchange", "Exchange", "ds_muon.engine.exchange.all_to_all"),
                                            ("ds_muon.engine.agreement", "Agreement", "ds_muon.engine.agreement.check")])
def test_an_old_module_that_is_now_a_package_still_hands_out_its_names(old, name, new):
    package = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"{old}.{name} moved to {new}.{name}"):
        got = getattr(package, name)
    assert got is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        package.NotAName  # noqa: B018
