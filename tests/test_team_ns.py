"""Team Newton–Schulz (ds_muon.engine.plan.team): one matrix orthogonalized by several ranks in column blocks.

Not bitwise equal to one process (the members' products are summed in another order), so these
tests bound it instead: against float64 NS and against the one-home result, in fp32 and bf16, at
W=2–4 on gloo with uneven flat partitions (matrices split across ranks, empty ranges); and check
that the planner teams only what pays and that plain one-home plans are untouched.
"""

import random

import pytest
import torch
from torch import nn

import ds_muon
from ds_muon.engine.exchange.layout import Piece, ParamBinding, slots_in_range
from ds_muon.engine.plan.cost_model import CostModel, MatrixTask
from ds_muon.engine.plan.planner import plan_multi_homes
from ds_muon.engine.plan.team_plan import plan_teams, team_seconds
from ds_muon.engine.plan.team import block_shape, segments, team_bounds

import dist_harness
from conftest import FAST_NS_DTYPE
from models import HandAdapter

# one large wide and one large tall matrix (the teams), small ones beside (one home each)
SHAPES = [(48, 200), (12, 16), (120, 24), (16, 24), (8, 3, 3), (20, 20)]
# NS dominates and moving bytes is free: the planner teams the large matrices at every W >= 2
FORCE = CostModel(flops_per_s=1e9, bytes_per_s=1e15, intra_bytes_per_s=1e15, allreduce_hop_s=0.0)
# relative Frobenius team-vs-one-home bounds on these (Gaussian) matrices (measured: docs/PERFORMANCE.md,
# "Team NS"); on rank-deficient or ill-conditioned ones only the 3x-one-home bound holds (test below)
BOUND = {torch.float32: 1e-5, torch.bfloat16: 4e-2}


# -- the blocks: segments cut every piece exactly -------------------------------------------------
def test_segments_rebuild_every_block_from_any_pieces():
    rng = random.Random(0)
    for _ in range(60):
        rows, cols = rng.randint(1, 30), rng.randint(1, 30)
        G = torch.arange(rows * cols, dtype=torch.float64).view(rows, cols)
        numel = rows * cols
        cuts = sorted({0, numel, *(rng.randint(0, numel) for _ in range(rng.randint(0, 4)))})
        k = rng.randint(1, min(5, max(rows, cols)))
        for c0, c1 in team_bounds(rows, cols, k):
            want = G[c0:c1] if rows > cols else G[:, c0:c1]
            assert tuple(want.shape) == block_shape(rows, cols, c0, c1)
            got = torch.full((want.numel(),), -1.0, dtype=torch.float64)
            for lo, hi in zip(cuts, cuts[1:]):
                local = G.reshape(-1)[lo:hi]
                for seg in segments(Piece(lo, hi - lo), rows, cols, c0, c1):
                    dst = seg.dst.view_in(got)
                    assert (dst == -1).all(), "two pieces wrote the same element"
                    dst.copy_(seg.src.view_in(local))
            assert torch.equal(got.view(want.shape), want), (rows, cols, cuts, k, c0, c1)


def test_team_bounds_uneven():
    assert team_bounds(10, 7, 3) == [(0, 3), (3, 6), (6, 10)]
    assert team_bounds(4, 9, 2) == [(0, 4), (4, 9)]


# -- the planner ----------------------------------------------------------------------------------
def _tasks(shapes, world, whole_at=None):
    out = []
    for i, (r, c) in enumerate(shapes):
        held = [0] * world
        held[(i if whole_at is None else whole_at) % world] = r * c
        out.append(MatrixTask(r, c, 5, 2, tuple(held)))
    return out


def test_planner_teams_the_matrix_that_bounds_the_step_where_it_pays():
    cpu = CostModel.for_device("cpu")
    for world in (2, 4, 8):
        tasks = _tasks([(2048, 2048)] + [(256, 256)] * 3, world)
        homes = plan_multi_homes(tasks, world, cpu, "auto")
        teams = plan_teams(tasks, world, homes, cpu)
        assert list(teams) == [0] and len(teams[0]) >= 2 and list(teams[0]) == sorted(teams[0])
        # it shortens the modelled step, and the same inputs give the same teams (every rank)
        one = team_seconds(tasks[0], teams[0], cpu).max()
        assert one < plan_step(tasks, world, cpu, homes) and plan_teams(tasks, world, homes, cpu) == teams
    # small matrices: all-reduce latency and bytes cost more than the NS they would share
    tasks = _tasks([(128, 128)] * 2, 2)
    assert plan_teams(tasks, 2, plan_multi_homes(tasks, 2, cpu, "auto"), cpu) == {}
    # balanced already (as many equal matrices as ranks): nothing to gain
    tasks = _tasks([(2048, 2048)] * 4, 4)
    assert plan_teams(tasks, 4, plan_multi_homes(tasks, 4, cpu, "auto"), cpu) == {}
    # not eligible: stays home
    tasks = _tasks([(2048, 2048), (64, 64)], 2)
    assert plan_teams(tasks, 2, plan_multi_homes(tasks, 2, cpu, "auto"), cpu, eligible=[False, True]) == {}


def plan_step(tasks, world, cm, homes):
    from ds_muon.engine.plan.cost_model import _Costs
    costs = _Costs(tasks, world, cm)
    return sum(costs(i, tuple(h)) for i, h in enumerate(homes)).max()


def test_allreduce_cost_is_a_ring():
    cm = CostModel(bytes_per_s=1e9, allreduce_hop_s=1e-5)
    assert cm.allreduce_seconds([0], 1e6) == 0.0
    assert cm.allreduce_seconds([0, 1], 1e6) == pytest.approx(2 * (1e-5 + 0.5e-3))
    assert cm.allreduce_seconds(range(4), 4e6) == pytest.approx(6 * (1e-5 + 1e-3))
    node = CostModel(bytes_per_s=1e9, intra_bytes_per_s=1e11, ranks_per_node=4, allreduce_hop_s=0.0)
    assert node.allreduce_seconds([0, 1], 1e6) == pytest.approx(1e-5)  # one node: NVLink-class rate
    assert node.allreduce_seconds([3, 4], 1e6) == pytest.approx(1e-3)


# -- the step at W = 2..4 against one home and float64 --------------------------------------------
def _initial():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(s, generator=g) * 0.1 for s in SHAPES]


def _grads():
    g = torch.Generator().manual_seed(11)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _opts(ns_dtype, method="standard"):
    # a team iterates the standard way; test_auto_teams_what_standard_teams checks auto (Gram at one home)
    return dict(lr=0.05, momentum=0.9, ns_dtype=ns_dtype, ns_method=method, cost_model=FORCE)


def _reference(ns_dtype, method="standard"):
    """One process: the one-home result (and, with float64, the exact one)."""
    with dist_harness.one_thread():
        mats = [nn.Parameter(m) for m in _initial()]
        opt = ds_muon.Muon([{"params": mats}], **_opts(ns_dtype, method))
        for p, g in zip(mats, _grads()):
            p.grad = g
        opt.step()
        return torch.cat([m.detach().reshape(-1) for m in mats])


def _cuts(total, world):
    weights = [3, 0, 2, 1][:world] if world >= 3 else [3, 2]
    c = [0]
    for w in weights[:-1]:
        c.append(c[-1] + total * w // sum(weights))
    return list(zip(c, c[1:] + [total]))


def _flat_partition(rank, world):
    """The matrices, their (name, shape, offset) in one flat tensor, and this rank's range of it."""
    mats = _initial()
    offsets, pos = [], 0
    for i, m in enumerate(mats):
        offsets.append((f"m{i}", tuple(m.shape), pos))
        pos += m.numel()
    lo, hi = _cuts(pos, world)[rank]
    return mats, offsets, lo, hi


def _worker(rank, world, configs):
    """One flat partition per rank (uneven, one range empty at W >= 3); a step per (dtype, team_ns)."""
    mats, offsets, lo, hi = _flat_partition(rank, world)
    out = []
    for ns_dtype, team_ns, layout, *method in configs:
        kw = _opts(ns_dtype, *method)
        if layout == "replicated":  # DDP-like: every rank holds every matrix whole (the default adapter)
            params = [nn.Parameter(m.clone()) for m in mats]
            opt = ds_muon.Muon([{"params": params, "param_names": [f"m{i}" for i in range(len(mats))]}],
                               team_ns=team_ns, **kw)
            for p, g in zip(params, _grads()):
                p.grad = g
            opt.step()
            summary = opt.summary()
            teams = {m.key: m.homes for m in summary.matrices if m.team}
            out.append(((0, sum(m.numel() for m in mats)), torch.cat([p.detach().reshape(-1) for p in params]), teams, str(summary)))
            continue
        local = nn.Parameter(torch.cat([m.reshape(-1) for m in mats])[lo:hi].clone())
        local._ds_muon_flat = True

        def describe(p, name, context):
            return ParamBinding(p, lambda t: t.reshape(-1), slots_in_range(offsets, lo, hi))

        opt = ds_muon.Muon([{"params": [local]}], adapter=HandAdapter(describe), team_ns=team_ns, **kw)
        local.grad = torch.cat([g.reshape(-1) for g in _grads()])[lo:hi].clone()
        opt.step()
        summary = opt.summary()
        teams = {m.key: m.homes for m in summary.matrices if m.team}
        out.append(((lo, hi), local.detach().clone(), teams, str(summary)))
    return out


def _sharded(world, configs):
    """Per config: the whole flat result, the teams (equal on every rank) and rank 0's summary."""
    per_rank = dist_harness.run(_worker, world, configs)
    results = []
    for c in range(len(configs)):
        out = [r[c] for r in per_rank]
        if configs[c][2] == "replicated":  # every rank holds the whole result: they must agree
            assert all(torch.equal(o[1], out[0][1]) for o in out), "replicas differ"
        full = torch.empty(max(hi for (lo, hi), *_ in out))
        for (lo, hi), piece, _, _ in out:
            full[lo:hi] = piece
        assert all(o[2] == out[0][2] for o in out), "ranks disagree on the teams"
        results.append((full, out[0][2], out[0][3]))
    return results


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("world", [2, 3, 4])
def test_team_step_within_the_bound_of_one_home_and_float64(world):
    """Each teamed matrix: within BOUND of the one-home result and at most 2x its error against float64;
    every other matrix bitwise the one-home result; team_ns=False bitwise one home everywhere."""
    p0 = torch.cat([m.reshape(-1) for m in _initial()])
    exact = _reference(torch.float64) - p0
    spans, at = [], 0
    for s in SHAPES:
        n = torch.Size(s).numel()
        spans.append((at, at + n))
        at += n
    dtypes = (torch.float32, torch.bfloat16) if world == 2 else (FAST_NS_DTYPE,)  # W=2 keeps both dtypes
    configs = [(d, True, "flat") for d in dtypes]
    if world == 2:
        configs += [(torch.bfloat16, False, "flat"), (torch.bfloat16, True, "replicated")]
    results = _sharded(world, configs)
    for (dtype, team_ns, layout), (team, teams, text) in zip(configs, results):
        home = _reference(dtype) - p0
        team = team - p0
        if not team_ns:
            assert teams == {} and "team of" not in text and torch.equal(team, home)
            continue
        assert "m0" in teams and (world != 2 or "m2" in teams), (teams, layout)  # the large wide (and tall) one
        assert all(len(t) >= 2 for t in teams.values())
        assert "team of" in text and "Team NS" in text
        for k, (a, z) in enumerate(spans):
            if f"m{k}" not in teams:  # not a team: bitwise as today
                assert torch.equal(team[a:z], home[a:z]), (k, layout)
                continue
            e_home = _rel(home[a:z], exact[a:z])
            e_team = _rel(team[a:z], exact[a:z])
            assert _rel(team[a:z], home[a:z]) <= BOUND[dtype], (k, dtype, e_home, e_team)
            assert e_team <= 2 * e_home, (k, dtype, e_team, e_home)


def test_auto_teams_what_standard_teams():
    """Under ``ns_method="auto"`` the wide and tall fp32 matrices would take the Gram iteration at one home;
    where the team's step is shorter (here NS dominates: FORCE), they are teamed as under ``"standard"``
    (issue 51: auto had kept them at one home), within BOUND of auto's one-home (Gram) result; the others
    bitwise auto's one-home result."""
    from ds_muon.rules.newton_schulz import resolve_method

    if resolve_method("auto", *SHAPES[0], 5, torch.float32, "cpu") != "gram":
        pytest.skip("auto does not take the Gram iteration for fp32 on this machine")
    p0 = torch.cat([m.reshape(-1) for m in _initial()])
    (std, std_teams, _), (auto, auto_teams, _) = _sharded(3, [(torch.float32, True, "flat", "standard"),
                                                              (torch.float32, True, "flat", "auto")])
    assert auto_teams == std_teams and "m0" in auto_teams, (auto_teams, std_teams)
    home = _reference(torch.float32, "auto") - p0
    at = 0
    for k, s in enumerate(SHAPES):
        a, at = at, at + torch.Size(s).numel()
        if f"m{k}" in auto_teams:
            assert _rel(auto[a:at] - p0[a:at], home[a:at]) <= BOUND[torch.float32], k
        else:
            assert torch.equal(auto[a:at] - p0[a:at], home[a:at]), k


def test_team_ns_setting_is_checked_carried_and_in_the_plan_table():
    from ds_muon.engine.plan import costs

    p = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="team_ns"):  # the keyword booleans' check (ds_muon.engine.agreement.settings)
        ds_muon.Muon([p], team_ns="yes")
    import copy
    assert copy.deepcopy(ds_muon.Muon([p], team_ns=False)).team_ns is False
    # the "team" row of ds-muon plan: one large matrix beside small ones at W=4 (CPU rates)
    tasks = _tasks([(2048, 2048)] + [(256, 256)] * 3, 4)
    rows = {r["strategy"]: r for r in costs.compare(tasks, 4, CostModel.for_device("cpu"), ["auto", "team"])}
    assert rows["team"]["teams"] == 1 and rows["team"]["max_team"] >= 2 and rows["team"]["vs_auto"] > 1
    assert rows["team"]["modelled_step_ms"] < rows["auto"]["modelled_step_ms"]


# -- the bound over generated matrices: Gaussian, rank-deficient, ill-conditioned, any scale ------
def _generated(seed, m, n, kind, scale):
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if kind != "gauss":
        U, S, Vh = torch.linalg.svd(G, full_matrices=False)
        if kind == "lowrank":
            S = torch.where(torch.arange(len(S)) < max(1, len(S) // 4), S, torch.zeros_like(S))
        else:  # ill-conditioned: singular values 1 ... 1e-6
            S = torch.logspace(0, -6, len(S), dtype=torch.float64)
        G = (U * S) @ Vh
    return (G * scale).float()


def _generated_worker(rank, world, cases):
    from ds_muon.engine.plan.compile import NSSettings
    from ds_muon.engine.plan.team import team_newton_schulz

    out = []
    for seed, m, n, kind, scale, dtype in cases:
        G = _generated(seed, m, n, kind, scale)
        tall = m > n
        c0, c1 = team_bounds(m, n, world)[rank]
        block = (G[c0:c1] if tall else G[:, c0:c1]).contiguous()
        mine = team_newton_schulz(block, tall, NSSettings(5, "keller", dtype, 1e-7, "standard"), None)
        parts = [None] * world
        torch.distributed.all_gather_object(parts, mine.float())
        out.append(torch.cat(parts, 0 if tall else 1))
    return out


def test_team_error_is_within_three_times_one_home_on_generated_matrices():
    """The bound that holds (docs/ADVANCED.md, "Team NS"): a team's error against float64 NS is at
    most 3× the one-home error (measured ≤ 2.65×, on thin matrices with a side of 2–4; ≤ 1.55× on others) on
    Gaussian, rank-deficient and ill-conditioned matrices at scales 1e-30…1e30.  The distance
    team ↔ one home is *not* small on rank-deficient or ill-conditioned matrices in bf16
    (0.1–0.37): there bf16 NS itself is 0.2–1.6 from float64 (bf16 rounding fills the null space,
    and NS lifts those singular values towards one), one home and team alike."""
    rng = random.Random(3)
    cases = []
    for i in range(28):
        m, n = rng.randint(2, 56), rng.randint(2, 56)
        cases.append((i, m, n, ["gauss", "lowrank", "illcond"][i % 3], rng.uniform(1, 10) * 10.0 ** rng.randint(-30, 30),
                      torch.bfloat16 if i % 4 else torch.float32))
    results = dist_harness.run(_generated_worker, 2, cases)[0]
    far = 0
    for (seed, m, n, kind, scale, dtype), team in zip(cases, results):
        G = _generated(seed, m, n, kind, scale)
        exact = ds_muon.newton_schulz(G.double(), dtype=torch.float64)
        home = ds_muon.newton_schulz(G, dtype=dtype)
        e_home, e_team = _rel(home.double(), exact), _rel(team.double(), exact)
        assert torch.isfinite(team).all() and e_team <= 3 * e_home + 1e-7, (kind, m, n, scale, dtype, e_team, e_home)
        far += _rel(team.double(), home.double()) > BOUND[dtype]
    assert far, "the old bound (team within BOUND of one home on every matrix) held here: re-measure the docs"
