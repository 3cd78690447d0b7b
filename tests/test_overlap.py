"""overlap=True: gathers issued from backward, waves pipelined with NS; with apply_in_forward=True
(opt-in) updates applied by the next forward.

Always bitwise equal to overlap=False; deferred updates are applied before any
module uses its parameters, before state dicts are taken, and at the next step;
learning-rate changes after step() do not leak into the deferred update.  Gathers
dispatched from backward are redone at step() when gradients or settings changed
in between (clipping), dropped under gradient accumulation until the last
micro-batch, and leave the momentum untouched when the step is skipped.
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
                         nn.Tanh(), nn.Linear(24, 8), nn.Tanh(), nn.Linear(8, 8))  # 8: the output layer (AdamW)


def batch(step, rank=0):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(12, 16, generator=g), torch.randn(12, 8, generator=g)


def train(model, opt, steps=STEPS, scheduler=None, micro=1, between=None, poison=()):
    """``micro`` backward passes per step; ``between(model, opt, t)`` runs after backward;
    steps in ``poison`` get a NaN input (and are skipped with nonfinite="skip")."""
    for t in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(t * micro + m)
            if t in poison:
                x[0, 0] = float("nan")
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        if between is not None:
            between(model, opt, t)
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return loss


def assert_same(ref, ovl):
    for (n, a), b in zip(ref.named_parameters(), ovl.parameters()):
        assert torch.equal(a, b), n


def run_pair(ns_dtype=torch.float32, **kw):
    ref, ovl = make_model(), make_model()
    o_ref = ds_muon.Muon(ds_muon.muon_param_groups(ref, adam_lr=1e-2), ns_dtype=ns_dtype, **kw)
    o_ovl = ds_muon.Muon(ds_muon.muon_param_groups(ovl, adam_lr=1e-2), ns_dtype=ns_dtype, overlap=True,
                         waves=3, model=ovl, apply_in_forward=True, **kw)
    return ref, o_ref, ovl, o_ovl


def test_single_process_deferred_apply_is_bitwise_and_lazy():
    ref, o_ref, ovl, o_ovl = run_pair()
    train(ref, o_ref)
    train(ovl, o_ovl)
    assert o_ovl.runtime.deferred.pending > 0  # the last step's updates wait for a forward
    before = ovl[6].weight.detach().clone()
    ovl(torch.zeros(1, 16))  # the forward pulls every wave in
    assert o_ovl.runtime.deferred.pending == 0
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


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_dispatch_single_process(ns_dtype):
    ref, o_ref, ovl, o_ovl = run_pair(ns_dtype)
    train(ref, o_ref, 1)
    train(ovl, o_ovl, 1)
    assert o_ovl.runtime.dispatch.dispatched == 0  # the first step compiles the waves and arms the hooks
    x, y = batch(7)
    for m, o in ((ref, o_ref), (ovl, o_ovl)):
        o.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
    assert o_ovl.runtime.dispatch.in_flight == 3  # every wave's gather left during backward
    o_ref.step()
    o_ovl.step()
    assert o_ovl.runtime.dispatch.dispatched == 3 and o_ovl.runtime.dispatch.redone == 0
    o_ovl.flush()
    assert_same(ref, ovl)


def _clip(model, opt, t):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def _momentum_change(model, opt, t):
    for g in opt.param_groups:
        if g["use_muon"]:  # (on an AdamW group momentum does nothing, and is refused: issue 33)
            g["momentum"] = 0.9 - 0.1 * t


@pytest.mark.parametrize("between", [_clip, _momentum_change], ids=["clip", "momentum"])
def test_changes_after_backward_are_seen(between):
    """Gradient clipping (or a new momentum) between backward and step: the early gathers are
    stale; step() waits them out and redoes them, so the result is still exact."""
    ref, o_ref, ovl, o_ovl = run_pair()
    train(ref, o_ref, between=between)
    train(ovl, o_ovl, between=between)
    assert o_ovl.runtime.dispatch.redone == STEPS - 1
    o_ovl.flush()
    assert_same(ref, ovl)


def test_gradient_accumulation_dispatches_last_micro_batch():
    ref, o_ref, ovl, o_ovl = run_pair()
    train(ref, o_ref, micro=3)
    train(ovl, o_ovl, micro=3)
    assert o_ovl.runtime.dispatch.dispatched == 3 and o_ovl.runtime.dispatch.redone == 0
    o_ovl.flush()
    assert_same(ref, ovl)


def test_skipped_step_leaves_momentum_alone():
    ref, o_ref, ovl, o_ovl = run_pair(nonfinite="skip")
    with pytest.warns(RuntimeWarning, match="skipped step"):
        train(ref, o_ref, steps=4, poison=(2,))
    with pytest.warns(RuntimeWarning, match="skipped step"):
        train(ovl, o_ovl, steps=4, poison=(2,))
    assert o_ovl.nonfinite_skips == 1 and o_ovl.runtime.dispatch.dispatched == 3
    o_ovl.flush()
    assert_same(ref, ovl)
    for a, b in zip(ref.parameters(), ovl.parameters()):
        sa, sb = o_ref.state[a], o_ovl.state[b]
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def test_unused_layer_leaves_its_wave_to_step():
    """A layer without a gradient in some step: the waves it is in never fill up in backward."""
    ref, o_ref, ovl, o_ovl = run_pair()
    for t in range(STEPS + 1):
        for m, o in ((ref, o_ref), (ovl, o_ovl)):
            x, y = batch(t)
            h = m[:5](x) if t == 2 else m[:6](x)  # step 2 skips the Tanh + last Linear's input path
            out = m[6](h) if t != 2 else h[:, :8]
            o.zero_grad(set_to_none=True)
            nn.functional.mse_loss(out, y).backward()
            o.step()
    o_ovl.flush()
    assert_same(ref, ovl)


def test_load_state_dict_between_backward_and_step():
    import copy

    ref, o_ref, ovl, o_ovl = run_pair()
    train(ref, o_ref, 2)
    train(ovl, o_ovl, 2)
    sd = copy.deepcopy(o_ref.state_dict())
    for st in sd["state"].values():
        if "momentum_buffer" in st:
            st["momentum_buffer"].mul_(0.5)
    x, y = batch(9)
    for m, o in ((ref, o_ref), (ovl, o_ovl)):
        o.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        o.load_state_dict(copy.deepcopy(sd))  # the early gathers used the momentum being replaced
        o.step()
    o_ovl.flush()
    assert_same(ref, ovl)


def test_dropped_optimizer_stops_dispatching():
    import gc
    import weakref

    m = make_model()
    opt = ds_muon.Muon(ds_muon.muon_param_groups(m), overlap=True, model=m)
    train(m, opt, 2)
    assert opt.runtime.dispatch.dispatched == 3
    gone = weakref.ref(opt.runtime.dispatch)
    del opt
    gc.collect()
    assert gone() is None  # the hooks on the parameters did not keep it alive
    m(batch(0)[0]).sum().backward()  # the hooks stay on the parameters but find no optimizer
    m.zero_grad()
    again = ds_muon.Muon(ds_muon.muon_param_groups(m), overlap=True, model=m)
    train(m, again, 2)
    assert again.runtime.dispatch.dispatched == 3


def test_dispatch_in_backward_can_be_turned_off():
    m = make_model()
    opt = ds_muon.Muon(ds_muon.muon_param_groups(m), overlap=True, model=m, dispatch_in_backward=False)
    train(m, opt)
    assert opt.runtime.dispatch is None


def test_bad_waves():
    with pytest.raises(ValueError, match="waves"):
        ds_muon.Muon([nn.Parameter(torch.zeros(3, 3))], overlap=True, waves=0)


# -- distributed ---------------------------------------------------------------------------------
def _ddp_worker(rank, world, overlap, skip_forward_on_rank1):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from test_sharded_engine import count_collectives

    model = make_model()
    ddp = DDP(model)
    # planner="locality": one home per matrix, so one scatter per wave is counted (the default "auto"
    # may duplicate NS on DDP replicas and move nothing: tests/test_ddp_homes.py)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=1e-2), ns_dtype=torch.float32,
                       overlap=overlap, waves=3, model=model, planner="locality", apply_in_forward=overlap)
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
    pending = opt.runtime.deferred.pending if opt.runtime.deferred else 0
    opt.flush()
    if overlap:  # DDP reduces after the grad hooks fire: nothing may leave from backward
        assert opt.runtime.dispatch.dispatched == 0 and opt.runtime.dispatch.in_flight == 0
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


def _fsdp2_worker(rank, world, overlap, variant="plain", ns_dtype=torch.float32):
    """``variant``: "plain"; "no_sync" (2 micro-batches, FSDP reduces only the last);
    "reduce_every" (2 micro-batches, both reduced); "clip" (clip_grad_norm_ before step);
    "hsdp_bf16" (2 x 2 HSDP mesh, bf16 parameters in forward and backward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model()
    if variant == "hsdp_bf16":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mesh, mp = init_device_mesh("cpu", (world,)), MixedPrecisionPolicy()
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=1e-2), ns_dtype=ns_dtype,
                       overlap=overlap, waves=3, model=model, apply_in_forward=overlap)
    storages = [p.to_local().data_ptr() for p in model.parameters()]
    losses, in_backward = [], []
    micro = 2 if variant in ("no_sync", "reduce_every") else 1
    for t in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(t * micro + m, rank)
            if variant == "no_sync":
                model.set_requires_gradient_sync(m == micro - 1)
            loss = nn.functional.mse_loss(model(x).float(), y)  # applies the previous step's deferred waves first
            losses.append(loss.item())
            loss.backward()
            in_backward.append(opt.runtime.dispatch.in_flight if opt.runtime.dispatch is not None else 0)  # gathers left
        if variant == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    opt.flush()
    assert storages == [p.to_local().data_ptr() for p in model.parameters()]
    d = opt.runtime.dispatch
    stats = (d.dispatched, d.redone, in_backward) if d is not None else None
    return losses, [p.to_local().detach().clone() for p in model.parameters()], stats


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fsdp2_overlap_bitwise(ns_dtype):
    ref = dist_harness.run(_fsdp2_worker, 2, False, "plain", ns_dtype)
    ovl = dist_harness.run(_fsdp2_worker, 2, True, "plain", ns_dtype)
    for (lr_, pr, _), (lo, po, stats) in zip(ref, ovl):
        assert lr_ == lo  # forwards saw exactly the same weights
        for a, b in zip(pr, po):
            assert torch.equal(a, b)
        dispatched, redone, in_backward = stats
        assert dispatched == 3 and redone == 0
        assert in_backward == [0, 3, 3]  # from the second step on, every gather leaves in backward


@pytest.mark.parametrize("world,variant", [(3, "plain"), (2, "no_sync"), (2, "reduce_every"), (2, "clip"),
                                           (4, "hsdp_bf16")])
def test_fsdp2_backward_dispatch_variants(world, variant):
    """Uneven shards at W=3; HSDP with mixed precision; gradient accumulation with and without FSDP's no-sync (only the
    last micro-batch's dispatch is used); clipping after backward (redone at step)."""
    ref = dist_harness.run(_fsdp2_worker, world, False, variant)
    ovl = dist_harness.run(_fsdp2_worker, world, True, variant)
    for (lr_, pr, _), (lo, po, (dispatched, redone, in_backward)) in zip(ref, ovl):
        assert lr_ == lo
        for a, b in zip(pr, po):
            assert torch.equal(a, b)
        assert redone == (STEPS - 1 if variant == "clip" else 0)
        assert dispatched == (0 if variant == "clip" else 3)
        if variant == "no_sync":  # FSDP reduces, and so dispatches, only in the last micro-batch
            assert in_backward[2::2] == [0] * (STEPS - 1) and in_backward[3::2] == [3] * (STEPS - 1)


def test_param_groups_changed_between_backward_and_step():
    """A tensor moved out of Muon after its wave left: the dispatch is stale, redone at step()."""
    ref, o_ref, ovl, o_ovl = run_pair()
    train(ref, o_ref, 2)
    train(ovl, o_ovl, 2)
    x, y = batch(5)
    for m, o in ((ref, o_ref), (ovl, o_ovl)):
        o.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        muon, adam = (next(g for g in o.param_groups if g["use_muon"] is u) for u in (True, False))
        adam["params"].append(muon["params"].pop())  # edited in place: the last Muon matrix now takes AdamW
        adam["param_names"].append(muon["param_names"].pop())
        o.step()
    o_ovl.flush()
    assert_same(ref, ovl)


def test_waves_split_by_each_matrix_ns_cost():
    """Waves hold about equal NS work as each matrix's own ns_steps sets it (once a fixed 5
    steps for all): a 10-step matrix outweighs three 1-step ones of its shape."""
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(8, 8)) for _ in range(4)]
    opt = ds_muon.Muon([dict(params=ps[:1], ns_steps=10), dict(params=ps[1:], ns_steps=1)],
                       ns_dtype=torch.float32, overlap=True, waves=2)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    assert [ex.active for ex in opt.exchanges()] == [[0], [1, 2, 3]]


# -- FSDP forward prefetch: a unit gathered before its own pre-forward -----------------------------
def _prefetch_model(kind, world):
    """``kind``: "fsdp2" (each Linear a unit, each unit prefetching the next two), "fsdp2_grouped"
    (``fully_shard([a, b])``: one all-gather for two modules), "fsdp1_flat" / "fsdp1_orig"
    (each Linear wrapped, ``forward_prefetch=True``).  Returns (model to call, param groups, model=)."""
    model = make_model()
    if kind.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        if kind == "fsdp2_grouped":
            fully_shard([model[2], model[4]], mesh=mesh)
            fully_shard(model[0], mesh=mesh)
        else:
            for i in (0, 2, 4):
                fully_shard(model[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
        if kind == "fsdp2":
            model.set_modules_to_forward_prefetch([model[0]])
            model[0].set_modules_to_forward_prefetch([model[2], model[4]])
        return model, ds_muon.muon_param_groups(model, adam_lr=1e-2), model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ds_muon.fsdp import fsdp_param_groups

    orig = kind == "fsdp1_orig"
    groups = ds_muon.muon_param_groups(model, adam_lr=1e-2) if orig else None
    fsdp = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                use_orig_params=orig, forward_prefetch=True)
    return fsdp, groups or fsdp_param_groups(fsdp, adam_lr=1e-2), fsdp


def _full(kind, model):
    if kind.startswith("fsdp2"):
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():  # the root keeps its parameters gathered after a forward
            if isinstance(m, FSDPModule):
                m.reshard()
        return [p.full_tensor().detach().clone() for p in model.parameters()]
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return [t.detach().clone() for t in model.state_dict().values()]


def _prefetch_worker(rank, world, overlap, kinds):
    """Every kind trained 3 steps with overlap on or off; losses and full parameters per kind."""
    out = {}
    for kind in kinds:
        model, groups, owner = _prefetch_model(kind, world)
        opt = ds_muon.Muon(groups, ns_dtype=torch.float32, overlap=overlap, waves=3, model=owner,
                           apply_in_forward=overlap)
        losses, pending = [], []
        for t in range(STEPS + 1):  # the last forward runs on the third step's deferred updates
            pending.append(opt.runtime.deferred.pending if opt.runtime.deferred is not None else 0)
            x, y = batch(t, rank)
            loss = nn.functional.mse_loss(model(x), y)
            losses.append(loss.item())
            if t < STEPS:
                opt.zero_grad()
                loss.backward()
                opt.step()
        opt.flush()
        out[kind] = (losses, _full(kind, model), pending)
    return out


PREFETCH_KINDS = ["fsdp2", "fsdp2_grouped", "fsdp1_flat", "fsdp1_orig"]


def test_forward_prefetch_sees_landed_updates():
    """FSDP gathers a prefetched unit (and every module of a grouped ``fully_shard``) before that
    unit's own pre-forward: its deferred update must land first, or the forward uses stale weights."""
    ref = dist_harness.run(_prefetch_worker, 2, False, PREFETCH_KINDS)
    ovl = dist_harness.run(_prefetch_worker, 2, True, PREFETCH_KINDS)
    for r, o in zip(ref, ovl):
        for kind in PREFETCH_KINDS:
            (lr_, pr, _), (lo, po, pending) = r[kind], o[kind]
            assert pending == [0] + [3] * STEPS, (kind, pending)  # each forward had every wave to land
            assert lr_ == lo, kind  # every forward saw the same weights
            for i, (a, b) in enumerate(zip(pr, po)):
                assert torch.equal(a, b), (kind, i)
