"""What a step does with gradients it cannot use as they are, and settings that would do nothing.

* A DTensor gradient placed unlike its parameter (``Replicate`` for a ``Shard(0)`` weight, as DTensor's
  backward of a row-wise embedding gives) is redistributed by ``Muon`` itself: at W=2 under a 1-D mesh the
  step equals the one-process step bitwise, Muon matrix and AdamW vector alike; a plain-tensor gradient of a
  DTensor parameter is refused naming it, on every rank.
* A step in which no tensor of the Muon has a gradient warns once, on rank 0 (a Muon built on tensors that
  a stack replaced after trains nothing, silently).
* ``normuon_beta2`` on a ``variant="muon"`` group is refused, given, edited or loaded, like the other settings
  that would do nothing.
"""

import warnings

import pytest
import torch
from torch import nn

import ds_muon
import dist_harness


def _weights():
    torch.manual_seed(0)
    return torch.randn(8, 6), torch.randn(8), torch.randn(8, 6), torch.randn(8)


def _groups(w, b):
    return [{"params": [w], "param_names": ["proj.weight"]},
            {"params": [b], "param_names": ["proj.bias"], "use_muon": False}]


def _placement_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    w0, b0, gw, gb = _weights()
    mesh = init_device_mesh("cpu", (world,))
    w = nn.Parameter(distribute_tensor(w0, mesh, [Shard(0)]))
    b = nn.Parameter(distribute_tensor(b0, mesh, [Shard(0)]))
    opt = ds_muon.Muon(_groups(w, b), log_summary=False)
    out = {}
    for step in range(2):
        w.grad = distribute_tensor(gw * (step + 1), mesh, [Replicate()])  # placed unlike the parameter
        b.grad = distribute_tensor(gb * (step + 1), mesh, [Replicate()])
        opt.step()
    out["w"], out["b"] = w.full_tensor(), b.full_tensor()
    out["placed"] = tuple(w.grad.placements) == tuple(w.placements)
    before, placed = w.full_tensor(), distribute_tensor(gw, mesh, [Shard(0)])  # (collectives: on both ranks)
    w.grad = gw.clone() if rank == 1 else placed  # one rank's plain gradient: every rank raises, none waits
    try:
        opt.step()
    except (ValueError, RuntimeError) as e:
        out["one_rank"] = str(e)
    out["unchanged"] = torch.equal(w.full_tensor(), before)
    w.grad = gw.clone()  # a plain tensor for a DTensor parameter, on every rank
    try:
        opt.step()
    except (ValueError, RuntimeError) as e:
        out["plain"] = str(e)
    return out


def test_dtensor_gradient_placed_unlike_its_parameter():
    w0, b0, gw, gb = _weights()
    with dist_harness.one_thread():
        w, b = nn.Parameter(w0.clone()), nn.Parameter(b0.clone())
        opt = ds_muon.Muon(_groups(w, b), log_summary=False)
        for step in range(2):
            w.grad, b.grad = gw * (step + 1), gb * (step + 1)
            opt.step()
    for found in dist_harness.run(_placement_worker, 2, timeout=120):
        assert found["placed"]
        assert torch.equal(found["w"], w.detach()) and torch.equal(found["b"], b.detach())
        assert "proj.weight" in found.get("plain", ""), found.get("plain")
        assert found.get("one_rank") and found["unchanged"], found.get("one_rank")


def _no_grad_worker(rank, world):
    model = nn.Sequential(nn.Linear(7, 9), nn.Linear(9, 9), nn.Linear(9, 5))  # shapes of its own: pooled ranks count Muons per shape
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model), log_summary=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
        opt.step()
    return [str(w.message) for w in seen if "no gradient" in str(w.message)]


def test_a_step_without_gradients_warns_once_on_rank_0():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model), log_summary=False)
    with pytest.warns(RuntimeWarning, match="no gradient on any of this Muon's 6 tensor"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once only
        model(torch.randn(2, 8)).sum().backward()
        opt.step()  # with gradients: nothing to say
    said = dist_harness.run(_no_grad_worker, 2, timeout=120)
    assert len(said[0]) == 1 and said[1] == [], said


def test_normuon_beta2_on_a_muon_variant_group_is_refused():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"normuon_beta2=0.9 is given but only variant='normuon' reads it"):
        ds_muon.Muon(ds_muon.muon_param_groups(model, normuon_beta2=0.9), log_summary=False)
    ds_muon.Muon(ds_muon.muon_param_groups(model, normuon_beta2=0.9, variant="normuon"), log_summary=False)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model), log_summary=False)
    saved = opt.state_dict()
    opt.param_groups[0]["normuon_beta2"] = 0.5
    model(torch.randn(2, 8)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"normuon_beta2=0.5 is set but only variant='normuon'"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    saved["param_groups"][0]["normuon_beta2"] = 0.5
    fresh = ds_muon.Muon(ds_muon.muon_param_groups(model), log_summary=False)
    with pytest.raises(ValueError, match=r"loaded .*normuon_beta2=0.5 is saved .* nothing was loaded"):
        fresh.load_state_dict(saved)
