"""What the step's collectives assume of the peers: the same optimizers, in the same order; peers that fail.

Several ``Muon`` optimizers in one job: two over disjoint halves of a model, stepped
in *different* orders on different ranks, would pair each other's collectives (one
rank's first optimizer with the other's second).  The agreement's one all_reduce
carries what each optimizer steps, so the pairing is the same clear error on every
rank before anything changes; stepped in the same order on every rank, they train
exactly as in one process.

Timeouts: with the world group made with a 2 s timeout, the exchange's own group (a
twin of the layout's group) and a flattened mesh group get the timeout of what they
stand for, not the backend's 30 minutes; so when one rank raises inside the step (as
out of memory would) and stays alive, the other fails in the exchange within about
that timeout instead of hanging.

Both run in one spawned job (the timeouts last: they replace the world group).
"""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ds_muon
from ds_muon.engine.agreement.timeouts import flattened_group, timeout_of

import dist_harness

STEPS = 2
TIMEOUT = 2.0  # seconds, the world group's in the timeout phase


# -- several optimizers ------------------------------------------------------------------------------
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


def _several_optimizers(rank, world):
    """Three phases in one job: the same order on every rank (trains as one process), then rank 1
    swaps the order at a later step, then two fresh optimizers are swapped from their first step."""
    swapped = (1, 0) if rank == 1 else (0, 1)
    model, opts = _fsdp2_halves(world)
    same = _train(model, opts, lambda t: (0, 1))
    later = _raises(model, opts, swapped)
    model, opts = _fsdp2_halves(world)
    first = _raises(model, opts, swapped)
    return same, later, first


# -- timeouts ------------------------------------------------------------------------------------------
def _short_world(rank, world, path):
    """Replace the harness's world group by one made with ``TIMEOUT``."""
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT))


def _optimizer():
    torch.manual_seed(0)
    mats = [nn.Parameter(torch.randn(16, 16)) for _ in range(4)]
    # planner="locality": one home per matrix, so results travel back in an all_to_all
    return mats, ds_muon.Muon([{"params": mats}], planner="locality", ns_dtype=torch.float32, log_summary=False)


def _step(mats, opt, t):
    g = torch.Generator().manual_seed(t)
    for p in mats:
        p.grad = torch.randn(p.shape, generator=g)  # the same on every rank: replicas agree
    opt.step()


def _timeouts(rank, world, path):
    _short_world(rank, world, path)
    out = {"world": timeout_of(None)}
    # a flattened sub-mesh that DeviceMesh must create, of dimension groups given the world's timeout
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    for name in ("dp", "tp"):
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=TIMEOUT), mesh.get_group(name))
    out["flattened"] = timeout_of(flattened_group(mesh["dp", "tp"]))

    mats, opt = _optimizer()
    _step(mats, opt, 0)
    made = [g for g in opt.runtime.exchange_groups._made.values() if g is not None]
    out["exchange"] = [timeout_of(g) for g in made]

    if rank == 1:  # raises inside the step, after the agreement, and stays alive
        def oom(*a, **k):
            raise MemoryError("simulated out of memory")

        opt.runtime.adamw = oom
    start = time.monotonic()
    try:
        _step(mats, opt, 1)
        out["failed"] = None
    except (MemoryError, RuntimeError) as e:
        out["failed"] = type(e).__name__
    out["seconds"] = time.monotonic() - start
    # rank 1 stays alive in the harness's closing barrier on the world group (given time to wait for rank
    # 0 now); rank 0 must leave the exchange by itself (the old code waited there for 30 minutes)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=60))
    return out


def _worker(rank, world, path):
    several = _several_optimizers(rank, world)
    return {"several": several, "timeouts": _timeouts(rank, world, path)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("pg") / "store"
    return dist_harness.run(_worker, 2, str(path), timeout=90)  # the old code hangs in both phases


def test_same_order_on_every_rank_trains_as_one_process(results):
    with dist_harness.one_thread():
        model = _model()
        ref = _train(model, _halves(model), lambda t: (0, 1))
    for rank, (same, _, _) in enumerate(r["several"] for r in results):
        for i, (a, b) in enumerate(zip(same, ref)):
            assert torch.equal(a, b), f"rank {rank} tensor {i}"


@pytest.mark.parametrize("phase", [1, 2], ids=["later_step", "first_step"])
def test_different_orders_are_one_clear_error_on_every_rank(results, phase):
    errors = [r["several"][phase] for r in results]
    messages = [m for m, _ in errors]
    assert None not in messages, "a rank stepped with the other rank's optimizer"
    assert messages[0] == messages[1]
    assert "different optimizers" in messages[0] and "same order" in messages[0], messages[0]
    assert all(unchanged for _, unchanged in errors), "a tensor changed before the error"


def test_every_group_ds_muon_makes_has_the_world_timeout(results):
    want = timedelta(seconds=TIMEOUT)
    for rank, out in enumerate(r["timeouts"] for r in results):
        assert out["world"] == want
        assert out["exchange"] and all(t == want for t in out["exchange"]), (rank, out["exchange"])
        assert out["flattened"] == want, (rank, out["flattened"])


def test_a_failed_peer_that_stays_alive_fails_the_others_within_the_timeout(results):
    assert results[1]["timeouts"]["failed"] == "MemoryError"
    assert results[0]["timeouts"]["failed"] == "RuntimeError"  # gloo's timeout in the exchange
    assert results[0]["timeouts"]["seconds"] < 2 * TIMEOUT, results[0]["timeouts"]["seconds"]  # not 30 minutes
