"""What the step's one all_reduce also checks: settings agree across ranks, replicas stay replicas.

Every failure must be the same error on every rank, before anything changes.
"""

import pytest
import torch
from torch import nn

import ds_muon
from ds_muon import agreement

import dist_harness


def test_hashes_differ_exactly_when_contributions_differ():
    rows = lambda hs: [sum(col) for col in zip(*(agreement.hashed_row(h) for h in hs))]  # noqa: E731
    assert not agreement.hashes_differ(rows([7, 7, 7, 7]))
    assert not agreement.hashes_differ(rows([agreement.HASH_MOD - 1] * 3))
    assert agreement.hashes_differ(rows([7, 7, 8, 7]))
    assert agreement.hashes_differ(rows([0, 14]))  # same sum as (7, 7), different squares
    assert not agreement.hashes_differ(rows([5]))  # one contributor agrees with itself
    g = torch.randn(100)
    a = agreement.minmax_hash(torch.stack(torch.aminmax(g)).unsqueeze(0))
    b = agreement.minmax_hash(torch.stack(torch.aminmax(g.clone())).unsqueeze(0))
    c = agreement.minmax_hash(torch.stack(torch.aminmax(g * 1.0001)).unsqueeze(0))
    assert a.item() == b.item() != c.item()


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in [(8, 12), (12, 8), (8,)]]


def _groups(ps):
    return [{"params": ps[:2], "param_names": ["w1", "w2"]},
            {"params": ps[2:], "param_names": ["bias"], "use_muon": False, "lr": 1e-3}]


def _set_grads(ps, seed):
    g = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)


def _attempt(opt, ps):
    before = [p.detach().clone() for p in ps]
    try:
        opt.step()
    except (ValueError, RuntimeError) as e:
        return type(e).__name__, str(e), all(torch.equal(a, b) for a, b in zip(before, ps))
    return None, None, None


def _agreement_worker(rank, world):
    out = {}
    # settings that differ from construction on
    ps = _params()
    opt = ds_muon.Muon(_groups(ps), ns_steps=5 + rank)
    _set_grads(ps, 0)
    out["ns_steps"] = _attempt(opt, ps)
    # a setting edited on one rank after construction
    ps = _params()
    opt = ds_muon.Muon(_groups(ps))
    _set_grads(ps, 0)
    opt.step()
    if rank == 1:
        opt.param_groups[1]["lr"] = 2e-3
    out["lr"] = _attempt(opt, ps)
    # replicas whose gradients differ: a model that is not wrapped in DDP
    ps = _params()
    opt = ds_muon.Muon(_groups(ps))
    _set_grads(ps, 0)
    opt.step()
    _set_grads(ps, 1 + rank)
    out["drift"] = _attempt(opt, ps) + (float(opt.state[ps[0]]["momentum_buffer"].abs().sum()),)
    # the same gradients everywhere: no false alarm
    _set_grads(ps, 5)
    out["same"] = _attempt(opt, ps)
    return out


def test_settings_and_replicas_checked_on_every_rank():
    results = dist_harness.run(_agreement_worker, 2, timeout=120)
    for out in results:
        kind, msg, unchanged = out["ns_steps"]
        assert kind == "ValueError" and unchanged
        assert "['ns_steps'] is 5 on rank 0, 6 on rank 1" in msg
        kind, msg, unchanged = out["lr"]
        assert kind == "ValueError" and unchanged and "param_groups[1]['lr'] is 0.001 on rank 0, 0.002 on rank 1" in msg
        kind, msg, unchanged, momentum = out["drift"]
        assert kind == "RuntimeError" and unchanged and msg.startswith("ds_muon: w1 (and 2 more) is replicated")
        assert "Wrap the model in DDP" in msg
        assert out["same"] == (None, None, None)
    # momentum from the one good step only, and equal on both ranks
    assert results[0]["drift"][3] == results[1]["drift"][3] > 0


def _submesh_worker(rank, world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh("cpu", [0])  # every rank builds it; only rank 0 trains on it
    if rank != 0:
        return None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    fully_shard(model, mesh=mesh)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model))
    model(torch.randn(2, 8)).sum().backward()
    before = model[0].weight.full_tensor().clone()
    opt.step()  # with the world as its group this would wait for rank 1 forever
    return not torch.equal(before, model[0].weight.full_tensor())


def test_fsdp2_on_a_sub_mesh_steps_in_the_mesh_group():
    assert dist_harness.run(_submesh_worker, 2, timeout=60) == [True, None]
