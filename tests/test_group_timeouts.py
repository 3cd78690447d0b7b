"""Process groups ds_muon creates inherit the timeout of the group they come from.

The world group is made with a 2 s timeout.  The exchange's own group (a twin of the
layout's group) and a flattened mesh group get the timeout of what they stand for,
not the backend's 30 minutes; so when one rank raises inside the step (as out of
memory would) and stays alive, the other fails in the exchange within about that
timeout instead of hanging.
"""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ds_muon
from ds_muon.timeouts import flattened_group, timeout_of

import dist_harness

TIMEOUT = 2.0  # seconds, the world group's
STALL = 2.5 * TIMEOUT  # how long the failed rank stays alive before it goes on (old code: rank 0 waited it out)


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


def _worker(rank, world, path):
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
    made = [g for g in opt._exchange_groups._made.values() if g is not None]
    out["exchange"] = [timeout_of(g) for g in made]

    if rank == 1:  # raises inside the step, after the agreement, and stays alive
        def oom(*a, **k):
            raise MemoryError("simulated out of memory")

        opt._adamw_all = oom
    start = time.monotonic()
    try:
        _step(mats, opt, 1)
        out["failed"] = None
    except (MemoryError, RuntimeError) as e:
        out["failed"] = type(e).__name__
    out["seconds"] = time.monotonic() - start
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=60))  # the harness's closing barrier waits for rank 1
    if rank == 1:
        time.sleep(STALL)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("pg") / "store"
    return dist_harness.run(_worker, 2, str(path), timeout=60)


def test_every_group_ds_muon_makes_has_the_world_timeout(results):
    want = timedelta(seconds=TIMEOUT)
    for rank, out in enumerate(results):
        assert out["world"] == want
        assert out["exchange"] and all(t == want for t in out["exchange"]), (rank, out["exchange"])
        assert out["flattened"] == want, (rank, out["flattened"])


def test_a_failed_peer_that_stays_alive_fails_the_others_within_the_timeout(results):
    assert results[1]["failed"] == "MemoryError"
    assert results[0]["failed"] == "RuntimeError"  # gloo's timeout in the exchange
    assert results[0]["seconds"] < 2 * TIMEOUT, results[0]["seconds"]  # not the STALL, not 30 minutes
