"""The sharded engine against the single-process optimizer, bitwise, at world sizes 1–4.

Two layouts exercise everything the stacks will describe: replicated tensors
(DDP: every rank holds every matrix) and a flat partition (all matrices end to
end, each rank holding one uneven contiguous range: matrices split across ranks,
matrices whole on one rank, empty ranges), like ZeRO-1/2 and FSDP1.
"""

import math

import pytest
import torch
from torch import nn

import ds_muon
from ds_muon.engine.exchange.layout import ParamBinding, slots_in_range

import dist_harness
from conftest import FAST_NS_DTYPE
from models import HandAdapter

SHAPES = [(16, 24), (16, 24), (16, 24), (40, 12), (12, 40), (20, 20), (2, 3), (1, 17), (19, 1), (8, 3, 3, 3),
          (24, 16), (33, 7)]
BIAS = 24
STEPS = 3


def _grads(step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) for s in SHAPES], torch.randn(BIAS, generator=g)


def _initial():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=g) * 0.1 for s in SHAPES], torch.randn(BIAS, generator=g) * 0.1


def _opts(ns_dtype):
    return dict(lr=0.05, momentum=0.9, weight_decay=0.1, ns_dtype=ns_dtype)


def reference(ns_dtype, steps=STEPS, **extra):
    """Single-process ds_muon on full tensors (one thread, like each rank)."""
    with dist_harness.one_thread():
        mats, bias = _initial()
        mats = [nn.Parameter(m) for m in mats]
        bias = nn.Parameter(bias)
        opt = ds_muon.Muon([{"params": mats}, {"params": [bias], "use_muon": False, "lr": 1e-2}],
                           **_opts(ns_dtype), **extra)
        for t in range(steps):
            gm, gb = _grads(t)
            for p, g in zip(mats, gm):
                p.grad = g
            bias.grad = gb
            opt.step()
        return [m.detach() for m in mats], bias.detach()


def boundaries(total, world):
    """Uneven cuts of [0, total): rank 0 gets a big range, one rank may be empty."""
    if world == 1:
        return [(0, total)]
    weights = [3, 0, 2, 1][:world] if world >= 3 else [3, 1]
    s = sum(weights)
    cuts = [0]
    for w in weights[:-1]:
        cuts.append(cuts[-1] + total * w // s)
    cuts.append(total)
    return [(cuts[r], cuts[r + 1]) for r in range(world)]


def end_to_end(mats):
    """(key, shape, offset) of each matrix laid end to end in one flat buffer, and its length."""
    offsets, pos = [], 0
    for i, m in enumerate(mats):
        offsets.append((f"m{i}", tuple(m.shape), pos))
        pos += m.numel()
    return offsets, pos


def _flat_worker(rank, world, ns_dtype, mode, profile):
    """Flat-partition layout: one local 1-D parameter per rank holding [lo, hi) of all matrices."""
    mats, bias = _initial()
    offsets, pos = end_to_end(mats)
    full = torch.cat([m.reshape(-1) for m in mats])
    lo, hi = boundaries(pos, world)[rank]
    local = nn.Parameter(full[lo:hi].clone())
    local._ds_muon_flat = True
    bias = nn.Parameter(bias)

    def describe(p, name, context):
        return ParamBinding(p, lambda t: t.reshape(-1), slots_in_range(offsets, lo, hi))

    opt = ds_muon.Muon([{"params": [local]}, {"params": [bias], "use_muon": False, "lr": 1e-2}],
                       mode=mode, adapter=HandAdapter(describe), **_opts(ns_dtype))
    counts = None
    storage = local.data_ptr()
    for t in range(STEPS):
        gm, gb = _grads(t)
        local.grad = torch.cat([g.reshape(-1) for g in gm])[lo:hi].clone()
        bias.grad = gb
        if profile and t == STEPS - 1:
            counts = count_collectives(opt.step)
        else:
            opt.step()
    assert local.data_ptr() == storage
    return (lo, hi), local.detach().clone(), bias.detach().clone(), counts


def _replicated_worker(rank, world, ns_dtype, mode, profile):
    """DDP-like: every rank holds every tensor whole, gradients identical."""
    mats, bias = _initial()
    mats = [nn.Parameter(m) for m in mats]
    bias = nn.Parameter(bias)
    # planner="locality": one home per matrix, whose collectives are counted below (the default "auto"
    # may duplicate NS on replicas instead: tests/test_ddp_homes.py)
    opt = ds_muon.Muon([{"params": mats}, {"params": [bias], "use_muon": False, "lr": 1e-2}],
                       mode=mode, planner="locality", **_opts(ns_dtype))
    counts = None
    for t in range(STEPS):
        gm, gb = _grads(t)
        for p, g in zip(mats, gm):
            p.grad = g
        bias.grad = gb
        if profile and t == STEPS - 1:
            counts = count_collectives(opt.step)
        else:
            opt.step()
    return [m.detach().clone() for m in mats], bias.detach().clone(), counts


def count_collectives(fn):
    from torch.profiler import profile

    with profile() as prof:
        fn()
    names = [e.name for e in prof.events()]
    return {
        "all_to_all": sum(1 for n in names if n.startswith(("gloo:all_to_all", "nccl:all_to_all"))),
        "all_reduce": sum(1 for n in names if n.startswith(("gloo:all_reduce", "nccl:all_reduce"))),
    }


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flat_partition_bitwise(world, ns_dtype):
    ref_mats, ref_bias = reference(ns_dtype)
    ref_flat = torch.cat([m.reshape(-1) for m in ref_mats])
    results = dist_harness.run(_flat_worker, world, ns_dtype, "sharded", world == 3)
    covered = 0
    for rank, ((lo, hi), local, bias, counts) in enumerate(results):
        assert torch.equal(local, ref_flat[lo:hi]), f"rank {rank} [{lo},{hi}) differs"
        assert torch.equal(bias, ref_bias)
        covered += hi - lo
    assert covered == ref_flat.numel()
    if world == 3:  # one agreement all_reduce, two all_to_all for all matrices
        for counts in [r[3] for r in results]:
            assert counts == {"all_to_all": 2, "all_reduce": 1}, counts


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["sharded", "duplicated"])
def test_replicated_bitwise(world, mode):
    ref_mats, ref_bias = reference(FAST_NS_DTYPE)  # homes, not dtypes: the machine's fast NS dtype
    results = dist_harness.run(_replicated_worker, world, FAST_NS_DTYPE, mode, True)
    for rank, (mats, bias, counts) in enumerate(results):
        for i, (a, b) in enumerate(zip(mats, ref_mats)):
            assert torch.equal(a, b), f"rank {rank} matrix {i} {SHAPES[i]}"
        assert torch.equal(bias, ref_bias)
        # replicated: homes already hold everything, so only the scatter moves data
        # in sharded mode; duplicated mode computes everything everywhere and moves nothing
        assert counts["all_to_all"] == (1 if mode == "sharded" else 0), counts


def test_duplicated_flat_bitwise():
    ref_mats, _ = reference(torch.float32)
    ref_flat = torch.cat([m.reshape(-1) for m in ref_mats])
    results = dist_harness.run(_flat_worker, 3, torch.float32, "duplicated", True)
    for (lo, hi), local, _, counts in results:
        assert torch.equal(local, ref_flat[lo:hi])
        assert counts["all_to_all"] == 1  # gather everything everywhere, nothing to scatter


def _mismatch_worker(rank, world):
    mats, _ = _initial()
    mats = [nn.Parameter(m) for m in mats]
    opt = ds_muon.Muon(mats, lr=0.05)
    gm, _ = _grads(0)
    for i, (p, g) in enumerate(zip(mats, gm)):
        p.grad = None if (rank == 1 and i == 4) else g
    before = [m.detach().clone() for m in mats]
    try:
        opt.step()
    except RuntimeError as e:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, mats))
        return str(e), unchanged
    return None, None


def test_grad_presence_mismatch_raises_everywhere():
    results = dist_harness.run(_mismatch_worker, 3, timeout=90)
    for msg, unchanged in results:
        assert msg is not None and "param_groups[0]['params'][4]" in msg and "gradient on 2 rank" in msg
        assert unchanged


def _skip_worker(rank, world):
    mats, _ = _initial()
    mats = [nn.Parameter(m) for m in mats]
    opt = ds_muon.Muon(mats, lr=0.05)
    gm, _ = _grads(0)
    for i, (p, g) in enumerate(zip(mats, gm)):
        p.grad = None if i == 2 else g  # no rank has a gradient for matrix 2
    before = mats[2].detach().clone()
    opt.step()
    return torch.equal(before, mats[2]), float(opt.state[mats[2]]["momentum_buffer"].abs().sum())


def test_matrix_without_grad_anywhere_is_skipped():
    for unchanged, mom in dist_harness.run(_skip_worker, 2):
        assert unchanged and mom == 0.0


def _nan_worker(rank, world):
    mats, _ = _initial()
    mats = [nn.Parameter(m) for m in mats]
    opt = ds_muon.Muon(mats, lr=0.05)
    gm, _ = _grads(0)
    for p, g in zip(mats, gm):
        p.grad = g.clone()
    if rank == world - 1:
        mats[5].grad[0, 0] = float("nan")
    try:
        opt.step()
    except FloatingPointError as e:
        return str(e), all(float(opt.state[m]["momentum_buffer"].abs().sum()) == 0 for m in mats)
    return None, None


def test_nonfinite_on_one_rank_raises_on_all():
    for msg, untouched in dist_harness.run(_nan_worker, 2):
        assert msg and "param_groups[0]['params'][5]" in msg
        assert untouched
