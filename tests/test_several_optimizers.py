"""Several ``Muon`` optimizers in one job: what each steps is part of the step's agreement.

Two optimizers over disjoint halves of a model, stepped in *different* orders on
different ranks, would pair each other's collectives (one rank's first optimizer
with the other's second).  The agreement's one all_reduce carries a fingerprint of
the tensors each optimizer steps, so the pairing is the same clear error on every
rank before anything changes; stepped in the same order on every rank, they train
exactly as in one process.
"""

import pytest
import torch
from torch import nn

import ds_muon

import dist_harness

STEPS = 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())])


def _halves(model):
    """Two optimizers over disjoint halves with the same structure (same counts and shapes of
    tensors per group), so that only their identity tells them apart."""
    opts = []
    for half in ((model[0], model[2]), (model[4], model[6])):
        mats, rest = [m.weight for m in half], [m.bias for m in half]
        opts.append(ds_muon.Muon([{"params": mats}, {"params": rest, "use_muon": False, "lr": 1e-2}],
                                 ns_dtype=torch.float32, log_summary=False))
    return opts


def _train(model, opts, order_of_step, steps=STEPS):
    for t in range(steps):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g)
        for o in opts:
            o.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for k in order_of_step(t):
            opts[k].step()
    return [_full(p) for p in model.parameters()]


def _local(p):
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


def _full(p):
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _fsdp2_halves(world):
    """FSDP2 over every layer (shards: no replica fingerprint can notice a pairing), two optimizers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _halves(model)


def _raises(model, opts, order):
    """One step in ``order``: the error's text, and whether every local shard is unchanged."""
    before = [_local(p).clone() for p in model.parameters()]
    try:
        _train(model, opts, lambda t: order, steps=1)
    except ValueError as e:
        return str(e), all(torch.equal(a, _local(p)) for a, p in zip(before, model.parameters()))
    return None, None


def _worker(rank, world):
    """Three phases in one job: the same order on every rank (trains as one process), then rank 1
    swaps the order at a later step, then two fresh optimizers are swapped from their first step."""
    swapped = (1, 0) if rank == 1 else (0, 1)
    model, opts = _fsdp2_halves(world)
    same = _train(model, opts, lambda t: (0, 1))
    later = _raises(model, opts, swapped)
    model, opts = _fsdp2_halves(world)
    first = _raises(model, opts, swapped)
    return same, later, first


@pytest.fixture(scope="module")
def results():
    return dist_harness.run(_worker, 2, timeout=60)  # the old code hangs in the later step's exchange


def test_same_order_on_every_rank_trains_as_one_process(results):
    with dist_harness.one_thread():
        model = _model()
        ref = _train(model, _halves(model), lambda t: (0, 1))
    for rank, (same, _, _) in enumerate(results):
        for i, (a, b) in enumerate(zip(same, ref)):
            assert torch.equal(a, b), f"rank {rank} tensor {i}"


@pytest.mark.parametrize("phase", [1, 2], ids=["later_step", "first_step"])
def test_different_orders_are_one_clear_error_on_every_rank(results, phase):
    errors = [r[phase] for r in results]
    messages = [m for m, _ in errors]
    assert None not in messages, "a rank stepped with the other rank's optimizer"
    assert messages[0] == messages[1]
    assert "different optimizers" in messages[0] and "same order" in messages[0], messages[0]
    assert all(unchanged for _, unchanged in errors), "a tensor changed before the error"
