"""A check that fails on one rank only, before the step's agreement, fails on every rank.

A setting edited into one rank's ``param_groups``, a state tensor that does not fit on one
rank, a sparse gradient on one rank: the failing rank's own check raises, and the others
must not wait in the agreement's all_reduce for the group's timeout but raise an error of
the same type naming that rank and its message, with nothing changed on any rank.  The
step group gets a short timeout, so the old behaviour (the good rank hangs) fails fast.
"""

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import ds_muon

import dist_harness

TIMEOUT_S = 8  # the step group's: a hang on the old code costs this, once per case


def _model():
    torch.manual_seed(0)  # the same replica on every rank (no wrapper: the grads must agree too)
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 4))


def _backward(model, sparse_on=None):
    torch.manual_seed(1)
    model(torch.randn(5, 8)).square().mean().backward()
    if sparse_on is not None:
        w = model[0].weight
        w.grad = w.grad.to_sparse()


def _tensors(model, opt):
    """Every parameter and state tensor, by (parameter, key)."""
    out = {}
    for i, p in enumerate(model.parameters()):
        out[i, "param"] = p.detach().clone()
        out.update({(i, k): v.clone() for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v)})
    return out


def _same(before, after):
    return all(k in after and after[k].shape == v.shape and torch.equal(after[k], v) for k, v in before.items())


def _bad_setting(rank, model, opt):
    if rank == 1:
        opt.param_groups[0]["momentum"] = 1.5
    _backward(model)


def _bad_state(rank, model, opt):
    if rank == 1:  # a momentum buffer from another model (e.g. a state dict edited or loaded by hand)
        opt.state[model[2].weight]["momentum_buffer"] = torch.zeros(3, 3)
    _backward(model)


def _sparse_grad(rank, model, opt):
    _backward(model, sparse_on=1 if rank == 1 else None)


CASES = {  # name: (make it fail on rank 1, steps before, what rank 0's error must name)
    "setting": (_bad_setting, 1, "momentum"),
    "setting at the first step": (_bad_setting, 0, "momentum"),
    "state": (_bad_state, 1, "momentum_buffer"),
    "sparse gradient": (_sparse_grad, 1, "sparse gradient"),
}


def _worker(rank, world):
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))
    out = {}
    for case, (fault, steps, _) in CASES.items():
        model = _model()
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model), lr=0.02, process_group=group)
        for _ in range(steps):
            _backward(model)
            opt.step()
            opt.zero_grad()
        fault(rank, model, opt)
        before = _tensors(model, opt)
        t0 = time.monotonic()
        try:
            opt.step()
            error = None
        except Exception as e:  # noqa: BLE001 - the test reports which error, and how fast
            error = (type(e).__name__, str(e))
        out[case] = dict(error=error, seconds=time.monotonic() - t0,
                         unchanged=_same(before, _tensors(model, opt)))
    return out


def test_a_check_failing_on_one_rank_raises_on_every_rank_at_once():
    results = dist_harness.run(_worker, 2, timeout=60)
    for case, (_, _, named) in CASES.items():
        r0, r1 = results[0][case], results[1][case]
        assert r1["error"] is not None and named in r1["error"][1], (case, r1)
        assert r0["error"] is not None, (case, r0)
        assert r0["error"][0] == r1["error"][0], (case, r0["error"], r1["error"])
        assert "rank(s) [1]" in r0["error"][1] and r1["error"][1] in r0["error"][1], (case, r0["error"])
        assert r0["seconds"] < TIMEOUT_S / 2 and r1["seconds"] < TIMEOUT_S / 2, (case, r0["seconds"], r1["seconds"])
        assert r0["unchanged"] and r1["unchanged"], case
