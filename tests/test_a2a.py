"""The exchange's transport: batched p2p with only the ranks it talks to moves the same bytes as all_to_all."""

import pytest
import torch
from torch import nn

import ds_muon
from ds_muon.engine.exchange.layout import ParamBinding, slots_in_range
from ds_muon.engine.plan.cost_model import CostModel

import dist_harness
from models import HandAdapter
from test_sharded_engine import boundaries, end_to_end

SHAPES = [(16, 8), (8, 8), (12, 4)]  # fewer matrices than ranks: a rank without a piece may talk to no one
STEPS = 3


def _run(rank, world, exchange, comm_dtype):
    """Flat partition with uneven cuts (rank 1 holds nothing); a few steps; parameters and peers."""
    g = torch.Generator().manual_seed(3)
    mats = [torch.randn(s, generator=g) for s in SHAPES]
    offsets, pos = end_to_end(mats)
    lo, hi = boundaries(pos, world)[rank]
    full = torch.cat([m.reshape(-1) for m in mats])
    local = nn.Parameter(full[lo:hi].clone())
    local._ds_muon_flat = True
    opt = ds_muon.Muon([local], lr=0.05, ns_dtype=torch.float32, comm_dtype=comm_dtype,
                       cost_model=CostModel(exchange=exchange), adapter=HandAdapter(
                           lambda p, n, context: ParamBinding(p, lambda t: t.reshape(-1),
                                                              slots_in_range(offsets, lo, hi))))
    for step in range(STEPS):
        local.grad = torch.randn(pos, generator=torch.Generator().manual_seed(100 + step))[lo:hi]
        opt.step()
    (ex,) = opt.exchanges()
    held = {i: [m.held_numel(r) for r in range(world)] for i, m in enumerate(ex.layout.matrices)}
    return local.detach().clone(), ex.transport, ex.peers, {i: ex.homes[i] for i in ex.active}, held


def _worker(rank, world):
    """Both transports, fp32 and bf16 communication, in one set of processes (one spawn)."""
    return {(dt, ex): _run(rank, world, ex, dt) for dt in (None, torch.bfloat16) for ex in ("all_to_all", "p2p")}


def _implied_peers(rank, homes, held):
    """Who ``rank`` must talk to from the plan alone: its pieces go to their matrix's home and
    come back; a home hears from every other holder of its matrices."""
    send, recv = set(), set()
    for i, (h,) in homes.items():
        if rank != h and held[i][rank] > 0:
            send.add(h)
        if rank == h:
            recv |= {r for r, n in enumerate(held[i]) if n > 0 and r != h}
    return send, recv


def test_p2p_equals_all_to_all_and_names_only_real_peers():
    results = dist_harness.run(_worker, 4, timeout=60)
    for comm_dtype in (None, torch.bfloat16):
        silent = 0
        for rank, res in enumerate(results):
            pa, ta, peers_a, homes, held = res[(comm_dtype, "all_to_all")]
            pp, tp, peers_p, _, _ = res[(comm_dtype, "p2p")]
            assert (ta, tp) == ("all_to_all", "p2p")
            assert torch.equal(pa, pp), f"rank {rank}, comm {comm_dtype}: p2p and all_to_all parameters differ"
            assert peers_a == peers_p
            send, recv = _implied_peers(rank, homes, held)
            assert set(peers_p.gather_send) == send == set(peers_p.scatter_recv)
            assert set(peers_p.gather_recv) == recv == set(peers_p.scatter_send)
            silent += not peers_p.all()
        assert silent >= 1, "the plan should leave a rank (the empty shard) with no peers"
        assert any(res[(comm_dtype, "p2p")][2].all() for res in results)


def test_auto_transport_picks_by_modelled_latency():
    cm = CostModel(exchange="auto")
    assert cm.transport(world=4, peers=3) == "all_to_all"
    assert cm.transport(world=8192, peers=16) == "p2p"
    t = cm.transport_seconds(8192, 16)
    assert t["p2p"] < t["all_to_all"]
    assert CostModel(exchange="p2p").transport(world=2, peers=1) == "p2p"


def test_unknown_exchange_is_named():
    with pytest.raises(ValueError, match="exchange='nccl'.*all_to_all"):
        CostModel(exchange="nccl")
