"""overlap=True: waves of exchanges pipelined with NS, updates applied by the next forward.

Always bitwise equal to overlap=False; deferred updates are applied before any
module uses its parameters, before state dicts are taken, and at the next step;
learning-rate changes after step() do not leak into the deferred update.
"""

import pytest
import torch
from torch import nn

import ds_muon

import dist_harness

STEPS = 3


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 24),
                         nn.Tanh(), nn.Linear(24, 8))


def batch(step, rank=0):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(12, 16, generator=g), torch.randn(12, 8, generator=g)


def train(model, opt, steps=STEPS, scheduler=None):
    for t in range(steps):
        x, y = batch(t)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return loss


def run_pair(**kw):
    ref, ovl = make_model(), make_model()
    o_ref = ds_muon.Muon(ds_muon.muon_param_groups(ref, adam_lr=1e-2), ns_dtype=torch.float32, **kw)
    o_ovl = ds_muon.Muon(ds_muon.muon_param_groups(ovl, adam_lr=1e-2), ns_dtype=torch.float32, overlap=True,
                         waves=3, model=ovl, **kw)
    return ref, o_ref, ovl, o_ovl


def test_single_process_deferred_apply_is_bitwise_and_lazy():
    ref, o_ref, ovl, o_ovl = run_pair()
    train(ref, o_ref)
    train(ovl, o_ovl)
    assert o_ovl._deferred.pending > 0  # the last step's updates wait for a forward
    before = ovl[6].weight.detach().clone()
    ovl(torch.zeros(1, 16))  # the forward pulls every wave in
    assert o_ovl._deferred.pending == 0
    assert not torch.equal(before, ovl[6].weight)
    for (n, a), b in zip(ref.named_parameters(), ovl.parameters()):
        assert torch.equal(a, b), n


def test_state_dict_and_step_flush():
    ref, o_ref, ovl, o_ovl = run_pair()
    train(ref, o_ref)
    train(ovl, o_ovl)
    sd = ovl.state_dict()  # a checkpoint never sees stale weights
    for k, v in ref.state_dict().items():
        assert torch.equal(v, sd[k]), k
    train(ref, o_ref, 1)
    train(ovl, o_ovl, 1)
    o_ovl.flush()
    for a, b in zip(ref.parameters(), ovl.parameters()):
        assert torch.equal(a, b)


def test_scheduler_after_step_does_not_change_the_deferred_update():
    ref, o_ref, ovl, o_ovl = run_pair()
    train(ref, o_ref, scheduler=torch.optim.lr_scheduler.StepLR(o_ref, 1, gamma=0.5))
    train(ovl, o_ovl, scheduler=torch.optim.lr_scheduler.StepLR(o_ovl, 1, gamma=0.5))
    o_ovl.flush()
    for a, b in zip(ref.parameters(), ovl.parameters()):
        assert torch.equal(a, b)


def test_bad_waves():
    with pytest.raises(ValueError, match="waves"):
        ds_muon.Muon([nn.Parameter(torch.zeros(3, 3))], overlap=True, waves=0)


# -- distributed ---------------------------------------------------------------------------------
def _ddp_worker(rank, world, overlap, skip_forward_on_rank1):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from test_sharded_engine import count_collectives

    model = make_model()
    ddp = DDP(model)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=1e-2), ns_dtype=torch.float32,
                       overlap=overlap, waves=3, model=model)
    counts = None
    for t in range(STEPS):
        x, y = batch(t)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        if t == 0:  # async scatters finish in the flush: count them inside the window
            counts = count_collectives(lambda: (opt.step(), opt.flush()))
        else:
            opt.step()
    if skip_forward_on_rank1 and rank == 1:
        pass  # never runs a forward: its pending waves stay pending until flushed, no rank waits on it
    else:
        model[0](torch.zeros(1, 16))  # only the first layer's forward: later waves stay pending
    pending = opt._deferred.pending if opt._deferred else 0
    opt.flush()
    return [p.detach().clone() for p in model.parameters()], counts, pending


@pytest.mark.parametrize("skip", [False, True])
def test_ddp_overlap_bitwise_and_collectives(skip):
    ref = dist_harness.run(_ddp_worker, 2, False, False)
    ovl = dist_harness.run(_ddp_worker, 2, True, skip)
    for (pr, cr, _), (po, co, pending) in zip(ref, ovl):
        for a, b in zip(pr, po):
            assert torch.equal(a, b)
        assert cr["all_to_all"] == 1  # replicated: only the scatter moves data
        assert co["all_to_all"] == 3  # one scatter per wave
        assert pending >= 1


def _fsdp2_worker(rank, world, overlap):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    mesh = init_device_mesh("cpu", (world,))
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=1e-2), ns_dtype=torch.float32,
                       overlap=overlap, waves=3, model=model)
    storages = [p.to_local().data_ptr() for p in model.parameters()]
    losses = []
    for t in range(STEPS):
        x, y = batch(t)
        loss = nn.functional.mse_loss(model(x), y)  # applies the previous step's deferred waves first
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    opt.flush()
    assert storages == [p.to_local().data_ptr() for p in model.parameters()]
    return losses, [p.to_local().detach().clone() for p in model.parameters()]


def test_fsdp2_overlap_bitwise():
    ref = dist_harness.run(_fsdp2_worker, 2, False)
    ovl = dist_harness.run(_fsdp2_worker, 2, True)
    for (lr_, pr), (lo, po) in zip(ref, ovl):
        assert lr_ == lo  # forwards saw exactly the same weights
        for a, b in zip(pr, po):
            assert torch.equal(a, b)
