"""The fused exchange: what crosses the wire is exactly what the homes lack."""

import torch
from torch import nn

import ds_muon
from ds_muon.engine.exchange.layout import ParamBinding, slots_in_range

import dist_harness
from models import HandAdapter
from test_sharded_engine import _initial, boundaries, end_to_end


def test_exchange_moves_each_element_at_most_once():
    """Flat partition, W=3: gathered bytes equal what homes lack, nothing more."""
    results = dist_harness.run(_traffic_worker, 3)
    sent_total = sum(r[0] for r in results)
    lacking_total = sum(r[1] for r in results)
    assert sent_total == lacking_total > 0


def _traffic_worker(rank, world):
    mats, _ = _initial()
    offsets, pos = end_to_end(mats)
    lo, hi = boundaries(pos, world)[rank]
    local = nn.Parameter(torch.zeros(hi - lo))
    local._ds_muon_flat = True
    opt = ds_muon.Muon([local], lr=0.05, ns_dtype=torch.float32, adapter=HandAdapter(
        lambda p, n, context: ParamBinding(p, lambda t: t.reshape(-1), slots_in_range(offsets, lo, hi))))
    local.grad = torch.randn(hi - lo)
    opt.step()
    (ex,) = opt.exchanges()
    layout = ex.layout
    lacking = sum(info.numel - info.held_numel(rank) for i, info in enumerate(layout.matrices)
                  if rank in ex.homes[i])
    return sum(ex.split_send_g), lacking


ACTIVE_STEPS = 30


def _active_pattern(step, n):
    """Which matrices get a gradient at ``step``: a random subset, the same on every rank
    (MoE experts without tokens, frozen parts, set_to_none); every matrix at step 0."""
    g = torch.Generator().manual_seed(500 + step)
    return [True] * n if step == 0 else (torch.rand(n, generator=g) < 0.6).tolist()


def _run_active_subsets(opt, mats):
    from test_sharded_engine import _grads

    held = []
    for t in range(ACTIVE_STEPS):
        gm, _ = _grads(t)
        for p, g, on in zip(mats, gm, _active_pattern(t, len(mats))):
            p.grad = g if on else None
        opt.step()
        held.append((len(opt.runtime.exchanges), sum(ex.buffer_bytes() for ex in opt.exchanges())))
    return [m.detach().clone() for m in mats], held


def _active_subsets_worker(rank, world):
    mats = [nn.Parameter(m) for m in _initial()[0]]
    return _run_active_subsets(ds_muon.Muon(mats, lr=0.05, ns_dtype=torch.float32), mats)


def test_changing_active_sets_keep_compiled_exchanges_bounded():
    """A new set of tensors with gradients every step: the compiled exchanges (and the bytes
    their buffers hold) stay bounded by a few sets per layout; results stay bitwise."""
    from ds_muon.engine.plan.compile import EXCHANGES_PER_LAYOUT

    with dist_harness.one_thread():
        mats = [nn.Parameter(m) for m in _initial()[0]]
        ref, _ = _run_active_subsets(ds_muon.Muon(mats, lr=0.05, ns_dtype=torch.float32), mats)
    for out, held in dist_harness.run(_active_subsets_worker, 2):
        for i, (a, b) in enumerate(zip(out, ref)):
            assert torch.equal(a, b), f"matrix {i}"
        all_active_bytes = held[0][1]  # step 0: every matrix active, the largest exchange
        assert all_active_bytes > 0
        assert max(keys for keys, _ in held) == EXCHANGES_PER_LAYOUT
        assert max(b for _, b in held) <= EXCHANGES_PER_LAYOUT * all_active_bytes


def _two_steps(**options):
    """The engine tests' matrices after two steps of their gradients; (parameters, optimizer)."""
    from test_sharded_engine import _grads

    mats = [nn.Parameter(m) for m in _initial()[0]]
    opt = ds_muon.Muon(mats, lr=0.05, ns_dtype=torch.float32, **options)
    for t in range(2):
        for p, g in zip(mats, _grads(t)[0]):
            p.grad = g
        opt.step()
    return mats, opt


def _own_group_worker(rank, world):
    import torch.distributed as dist

    pair = dist.new_group([0, 1])  # every rank creates it; only ranks 0 and 1 step on it
    mats, opt = _two_steps()
    groups = {id(ex.group) for ex in opt.exchanges()}
    (ex,) = opt.exchanges()
    out = {"whole": [m.detach().clone() for m in mats], "own": len(groups) == 1 and ex.group is not None
           and ex.group is not dist.group.WORLD, "ranks": dist.get_process_group_ranks(ex.group)}
    if rank < 2:  # a smaller group: rank 2 never steps this optimizer, so no world collective may be needed
        from test_sharded_engine import _grads

        sub = [nn.Parameter(m) for m in _initial()[0]]
        opt2 = ds_muon.Muon(sub, lr=0.05, ns_dtype=torch.float32, process_group=pair)
        for p, g in zip(sub, _grads(0)[0]):
            p.grad = g
        opt2.step()
        out["sub_is_pair"] = all(ex.group is pair for ex in opt2.exchanges())
    return out


def test_exchange_runs_on_its_own_group():
    """A layout over the whole world exchanges on a group of its own (same ranks), so FSDP's
    collectives and the exchange do not queue on one communicator; a layout over a smaller group
    (ranks outside never step it) keeps that group instead of a world collective that would hang."""
    with dist_harness.one_thread():
        mats, _ = _two_steps()
    results = dist_harness.run(_own_group_worker, 3, timeout=90)
    for rank, out in enumerate(results):
        assert out["own"] and out["ranks"] == [0, 1, 2]
        assert all(torch.equal(a, b.detach()) for a, b in zip(out["whole"], mats))
        assert out.get("sub_is_pair", rank == 2)
