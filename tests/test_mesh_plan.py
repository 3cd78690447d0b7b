"""HSDP: per matrix, one home in the world, one home per replica group, or NS at every holder, by the cost model.

The planner (``planner="auto"``) weighs the bytes between replica groups (other nodes
under ``CostModel.ranks_per_node``) against running NS again; with one home per group
each group's home gathers from and scatters to its own group only.  W=4 gloo runs the
2x2 HSDP GatedMLP of test_mesh.py and checks bitwise parity with single process.
"""

from __future__ import annotations

import torch

import ds_muon
from ds_muon.engine.exchange.routes import replica_groups
from ds_muon.engine.plan.cost_model import CostModel, MatrixTask, pair_traffic
from ds_muon.engine.plan.planner import plan_multi_homes

import dist_harness
from test_mesh import DTYPES, OPTS, GatedMLP, _check_parity, _ns_work, _wrap, record

# Replica groups {0,1} and {2,3} are the two nodes; bytes between them are slow, NS is cheap.
INTER_EXPENSIVE = CostModel(flops_per_s=1e15, bytes_per_s=1e6, ranks_per_node=2, intra_bytes_per_s=1e12)
NS_EXPENSIVE = CostModel(flops_per_s=1e3, bytes_per_s=1e12, ranks_per_node=2, intra_bytes_per_s=1e12)
CASES = {"inter_expensive": INTER_EXPENSIVE, "ns_expensive": NS_EXPENSIVE}


def _hsdp_task(n=1024):
    """A square matrix sharded in halves over 2 replica groups (ranks 0,2 hold rows 0..n/2; 1,3 the rest)."""
    return MatrixTask(n, n, 5, 2, (n * n // 2,) * 4, groups=replica_groups([[0, 2], [1, 3]]))


def test_replica_groups_from_piece_holders():
    assert replica_groups([[0, 2], [1, 3]]) == ((0, 1), (2, 3))
    assert replica_groups([[3, 1], [2, 0]]) == ((0, 1), (2, 3))  # holders in any order
    assert replica_groups([[0, 1, 2, 3]]) == ()  # DDP: whole copies, handled as whole holders
    assert replica_groups([[0], [1]]) == ()  # plain FSDP: no replicas
    assert replica_groups([[0, 2], [1]]) == ()  # pieces not replicated alike


def test_hsdp_choice_flips_with_the_cost_model():
    tasks = [_hsdp_task()] * 4
    per_group = plan_multi_homes(tasks, 4, CostModel(ranks_per_node=2), "auto")  # NVLink inside, 50 GB/s across
    assert per_group == [(0, 2), (1, 3), (0, 2), (1, 3)], per_group
    assert plan_multi_homes(tasks, 4, CostModel(), "auto") == [(0,), (1,), (2,), (3,)]  # flat: one home in the world
    assert plan_multi_homes(tasks, 4, CostModel(flops_per_s=1e12, ranks_per_node=2), "auto") == [(0,), (1,), (2,), (3,)]
    assert plan_multi_homes(tasks, 4, CostModel(ranks_per_node=2), "locality") == [(0,), (1,), (2,), (3,)]


def test_one_home_per_replica_group_moves_nothing_between_groups():
    t = _hsdp_task(8)
    pairs = pair_traffic(t, (0, 2))
    assert pairs == {(1, 0): 32, (0, 1): 32, (3, 2): 32, (2, 3): 32}, pairs
    assert set(pair_traffic(t, (0, 1, 2, 3))) == {(1, 0), (0, 1), (3, 2), (2, 3)}  # every holder: gather only


def _worker(rank, world):
    out = {}
    for case, cm in CASES.items():
        out[case] = {}
        for ns_dtype in DTYPES:
            model = GatedMLP()
            init = {n: p.detach().clone() for n, p in model.named_parameters()}
            _wrap("hsdp", model)
            opt = ds_muon.Muon(ds_muon.muon_param_groups(model, **OPTS), momentum=0.9, ns_dtype=ns_dtype,
                               planner="auto", cost_model=cm, team_ns=False)  # whole homes: bitwise
            grads, params = record(model, opt)
            # elements this rank sends to ranks of the other replica group (mesh row: rank // 2)
            across = sum(ex.split_send_g[d] + ex.split_send_s[d] for ex in opt.exchanges()
                         for d in range(world) if d // 2 != rank // 2)
            out[case][ns_dtype] = dict(init=init, grads=grads, params=params, ns_work=_ns_work(opt, rank),
                                       split=False, across=across,
                                       placements={n: str(p.placements) for n, p in model.named_parameters()})
    return out


def test_hsdp_2x2_home_per_replica_group_or_once_in_the_world_by_cost_model():
    results = dist_harness.run(_worker, 4, timeout=180)
    for case in CASES:
        _check_parity([res[case] for res in results])
    for ns_dtype in DTYPES:
        grouped = [res["inter_expensive"][ns_dtype] for res in results]
        matrices = grouped[0]["ns_work"][1]
        assert len(matrices) == 4, matrices
        for key, (homes, _) in matrices.items():  # one home in each replica group
            assert sorted(h // 2 for h in homes) == [0, 1], (key, homes)
        once = sum(f for _, f in matrices.values())
        assert sum(r["ns_work"][0] for r in grouped) == 2 * once  # each replica group orthogonalizes it
        assert [r["across"] for r in grouped] == [0] * 4  # nothing crosses between replica groups

        world = [res["ns_expensive"][ns_dtype] for res in results]
        matrices = world[0]["ns_work"][1]
        assert all(len(homes) == 1 for homes, _ in matrices.values()), matrices
        once = sum(f for _, f in matrices.values())
        assert sum(r["ns_work"][0] for r in world) == once
        assert sum(r["across"] for r in world) > 0
