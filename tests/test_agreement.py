"""What the step's one all_reduce also checks: settings agree across ranks, replicas stay replicas.

Every failure must be the same error on every rank, before anything changes.
"""

import pytest
import torch
from torch import nn

import ds_muon
from ds_muon.engine.agreement import fingerprints, table
from ds_muon.engine.plan.cost_model import CostModel

import dist_harness
import test_ns_kernels


def test_hashes_differ_exactly_when_contributions_differ():
    rows = lambda hs: [sum(col) for col in zip(*(table.hashed_row(h) for h in hs))]  # noqa: E731
    assert not table.hashes_differ(rows([7, 7, 7, 7]))
    assert not table.hashes_differ(rows([fingerprints.HASH_MOD - 1] * 3))
    assert table.hashes_differ(rows([7, 7, 8, 7]))
    assert table.hashes_differ(rows([0, 14]))  # same sum as (7, 7), different squares
    assert not table.hashes_differ(rows([5]))  # one contributor agrees with itself
    g = torch.randn(100)
    a = fingerprints.minmax_hash(torch.stack(torch.aminmax(g)).unsqueeze(0))
    b = fingerprints.minmax_hash(torch.stack(torch.aminmax(g.clone())).unsqueeze(0))
    c = fingerprints.minmax_hash(torch.stack(torch.aminmax(g * 1.0001)).unsqueeze(0))
    assert a.item() == b.item() != c.item()


def test_copies_group_the_ranks_with_equal_keys():
    from ds_muon.engine.exchange.copies import holders

    assert holders([5, None, 5, 7, 7, 9]) == [[0, 2], [3, 4]]  # a key held once is no copy
    assert holders([None, None]) == [] and holders([1, 2, 3]) == []


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
    # the planner's rates are compared, not how they were given: one rank's default (a CPU's) against
    # the same rates passed explicitly steps; a GPU's rates on one rank would plan other homes
    for key, chosen in (("same_rates", CostModel.for_device("cpu")), ("other_rates", CostModel.for_device("cuda"))):
        ps = _params()
        opt = ds_muon.Muon(_groups(ps), cost_model=chosen if rank == 1 else None)
        _set_grads(ps, 0)
        out[key] = _attempt(opt, ps)
    out["ns_kernels"] = test_ns_kernels.kernels_worker(rank)  # NS kernel choices: pinned apart, then calibrated
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
        assert out["same_rates"] == (None, None, None)
        kind, msg, unchanged = out["other_rates"]
        assert kind == "ValueError" and unchanged and msg.startswith("ds_muon: optimizer settings differ between ranks: "
                                                                     'cost_model is "CostModel(flops_per_s=500000000000.0')
    test_ns_kernels.check_kernels_agreed([out["ns_kernels"] for out in results])
    # momentum from the one good step only, and equal on both ranks
    assert results[0]["drift"][3] == results[1]["drift"][3] > 0


def _submesh_worker(rank, world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh("cpu", [0])  # every rank builds it; only rank 0 trains on it
    if rank != 0:
        return None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))  # input, hidden, output
    fully_shard(model, mesh=mesh)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model))
    model(torch.randn(2, 8)).sum().backward()
    before = model[1].weight.full_tensor().clone()
    opt.step()  # with the world as its group this would wait for rank 1 forever
    return not torch.equal(before, model[1].weight.full_tensor())


def test_fsdp2_on_a_sub_mesh_steps_in_the_mesh_group():
    assert dist_harness.run(_submesh_worker, 2, timeout=60) == [True, None]


READS = ("cpu", "item", "tolist", "__bool__", "__int__", "__float__")


def count_host_reads(fn):
    """Calls to what makes the host wait for a tensor's value (``.cpu()``, ``.item()``, ``.tolist()``,
    ``bool()``/``int()``/``float()`` of a tensor, ``torch.equal``) while ``fn`` runs."""
    count = [0]
    saved = {k: getattr(torch.Tensor, k) for k in READS}
    saved_equal = torch.equal

    def counted(f):
        def wrapper(*args, **kwargs):
            count[0] += 1
            return f(*args, **kwargs)
        return wrapper

    try:
        for k, f in saved.items():
            setattr(torch.Tensor, k, counted(f))
        torch.equal = counted(saved_equal)
        fn()
    finally:
        for k, f in saved.items():
            setattr(torch.Tensor, k, f)
        torch.equal = saved_equal
    return count[0]


def _reads_worker(rank, world):
    ps = _params()[:2]
    opt = ds_muon.Muon(ps, lr=0.02)
    reads = []
    for t in range(3):
        _set_grads(ps, t)
        reads.append(count_host_reads(opt.step))
    return reads


def _overlap_reads():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12, bias=False), nn.Linear(12, 8, bias=False))
    opt = ds_muon.Muon(model.parameters(), lr=0.02, overlap=True, model=model, waves=2)
    reads = []
    for t in range(4):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(t))).square().sum().backward()
        reads.append(count_host_reads(opt.step))
        model.zero_grad(set_to_none=True)
    return reads, opt.runtime.dispatch.dispatched


def test_one_host_read_per_step():
    """The step waits for the device once: the agreement's table (finite flags, replica fingerprints,
    "an early dispatch is stale") is filled and reduced on the device and read back once."""
    for reads in dist_harness.run(_reads_worker, 2):  # the first step also builds layouts (object collectives)
        assert reads[1:] == [1, 1], reads
    reads, dispatched = _overlap_reads()  # gathers sent from backward: their staleness is read along
    assert dispatched > 0 and reads[1:] == [1] * 3, (reads, dispatched)
