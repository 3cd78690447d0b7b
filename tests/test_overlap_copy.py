"""A copy of a model with pending updates (``apply_in_forward=True``): ``copy.deepcopy`` (the usual
way to make an EMA or reference model) and pickling (``torch.save(model)``), of the bare module
and through ``DDP.module``, at W=1 and W=2.

Before the fix the hooks held the optimizer's pending updates through closures and bound methods:
through ``DDP.module`` the copy dragged the DDP wrapper in (AttributeError), and a bare copy
carried hooks that applied the original's pending updates (then the original applied them again,
on released buffers: SIGSEGV).  Now a copy flushes the pending updates first and carries inert
hooks: the copy equals the model with its updates applied, using it changes nothing of the
original, and the original goes on bitwise equal to a run that made no copy.
"""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import ds_muon

import dist_harness
from test_overlap import batch, make_model

STEPS, COPY_AT = 4, 2


def _copy(model, how):
    if how == "deepcopy":
        return copy.deepcopy(model)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _train(rank, world, wrap, how):
    """Trains with apply_in_forward (a copy made after step COPY_AT) or plainly (how=None);
    returns the weights after each step and the copy's weights and its outputs."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    outer = DDP(model) if wrap == "ddp" else model
    deferred = how is not None
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=1e-2), ns_dtype=torch.float32,
                       overlap=deferred, waves=3, apply_in_forward=deferred, model=outer if deferred else None)
    after, copied = [], None
    for t in range(STEPS):
        x, y = batch(t, rank)
        opt.zero_grad()
        nn.functional.mse_loss(outer(x), y).backward()
        opt.step()
        if t == COPY_AT and deferred:
            assert opt.runtime.deferred.pending > 0  # the habit under test: a copy while updates wait
            twin = _copy(model, how)
            twin(torch.zeros(1, 16))  # the copy is used: a forward, a state_dict
            sd = twin.state_dict()
            copied = [p.detach().clone() for p in twin.parameters()]
            assert all(torch.equal(sd[n], p) for (n, _), p in zip(model.named_parameters(), copied))
            ema = twin  # an EMA update of the copy, as EMA code does, touches only the copy
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.5)
        if not deferred:
            after.append([p.detach().clone() for p in model.parameters()])
    if deferred:  # the last step's updates land by the forwards alone until here
        opt.flush()
        after.append([p.detach().clone() for p in model.parameters()])
    return after, copied


def _worker(rank, world, cases):
    return [_train(rank, world, wrap, how) for wrap, how in cases]


@pytest.mark.parametrize("world", [1, 2])
def test_copy_of_a_model_with_pending_updates(world):
    cases = [(wrap, how) for wrap in ("bare", "ddp") for how in ("deepcopy", "torch.save")]
    if world == 1:
        cases.append(("bare", "pickle"))
    out = dist_harness.run(_worker, world, [(None, None)] + cases)
    for rank in range(world):
        (plain, _), *copies = out[rank]
        for (wrap, how), (after, copied) in zip(cases, copies):
            assert all(torch.equal(a, b) for a, b in zip(copied, plain[COPY_AT])), (wrap, how, "copy")
            # the original goes on as if no copy was made
            assert all(torch.equal(a, b) for a, b in zip(after[-1], plain[-1])), (wrap, how)
