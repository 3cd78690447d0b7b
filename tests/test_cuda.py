"""The engine on CUDA/NCCL, where GPUs exist (skipped, not failed, without them).

The CPU suite runs everything on gloo; these check the same maths and exchange on
the device path: CUDA tensors, NCCL all_to_all, NS on the GPU.
"""

import pytest
import torch
from torch import nn

import ds_muon

import dist_harness

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = [(256, 256), (256, 1024), (1024, 256), (96, 200), (1, 64), (64, 1)]


def _mats(device):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=g) * 0.02).to(device) for s in SHAPES]


def _grads(step, device):
    g = torch.Generator().manual_seed(10 + step)
    return [torch.randn(s, generator=g).to(device) for s in SHAPES]


def _run(params, opt, device, steps=3):
    for t in range(steps):
        for p, gr in zip(params, _grads(t, device)):
            p.grad = gr
        opt.step()
    return [p.detach().cpu() for p in params]


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_gpu_single_process_close_to_cpu(ns_dtype):
    dev = torch.device("cuda")
    gpu = [nn.Parameter(m) for m in _mats(dev)]
    cpu = [nn.Parameter(m) for m in _mats("cpu")]
    got = _run(gpu, ds_muon.Muon(gpu, ns_dtype=ns_dtype), dev)
    want = _run(cpu, ds_muon.Muon(cpu, ns_dtype=ns_dtype), "cpu")
    tol = 1e-4 if ns_dtype == torch.float32 else 2e-3
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=tol)


def _nccl_worker(rank, world, ns_dtype):
    dev = torch.device("cuda", torch.cuda.current_device())
    params = [nn.Parameter(m) for m in _mats(dev)]
    opt = ds_muon.Muon(params, ns_dtype=ns_dtype)
    out = _run(params, opt, dev)
    homes = sorted({h for ex in opt.exchanges() for hs in ex.homes.values() for h in hs})
    return out, homes


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL ranks")
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_nccl_replicated_matches_single_gpu(ns_dtype):
    dev = torch.device("cuda", 0)
    ref_params = [nn.Parameter(m) for m in _mats(dev)]
    ref = _run(ref_params, ds_muon.Muon(ref_params, ns_dtype=ns_dtype), dev)
    results = dist_harness.run(_nccl_worker, 2, ns_dtype, env={"DS_MUON_TEST_BACKEND": "nccl"})
    for out, homes in results:
        assert homes == [0, 1]
        for a, b in zip(out, ref):
            # cuBLAS may pick other kernels for other batch sizes: close, and usually equal
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6 if ns_dtype == torch.float32 else 1e-3)


def _fsdp2_overlap_worker(rank, world, overlap):
    """FSDP2 on CUDA: with overlap the gathers leave from hooks on FSDP's reduce-scatter stream."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from test_overlap import STEPS, batch, make_model

    dev = torch.device("cuda", torch.cuda.current_device())
    model = make_model().to(dev)
    mesh = init_device_mesh("cuda", (world,))
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=1e-2), ns_dtype=torch.float32, overlap=overlap,
                       waves=3, model=model)
    for t in range(STEPS + 1):
        x, y = (v.to(dev) for v in batch(t, rank))
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.flush()
    dispatched = opt.runtime.dispatch.dispatched if opt.runtime.dispatch is not None else 0
    return [p.to_local().detach().cpu() for p in model.parameters()], dispatched


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_overlap_on_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs for NCCL ranks")
    env = {"DS_MUON_TEST_BACKEND": "nccl"}
    ref = dist_harness.run(_fsdp2_overlap_worker, world, False, env=env)
    ovl = dist_harness.run(_fsdp2_overlap_worker, world, True, env=env)
    for (pr, _), (po, dispatched) in zip(ref, ovl):
        assert dispatched == 3  # every wave's gather left from backward
        for a, b in zip(pr, po):
            # waves batch fewer matrices per NS call, and cuBLAS may pick other kernels for them
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# -- every stack on GPUs, against one GPU ------------------------------------------------------------
# Each run trains test_overlap's model (or test_deepspeed's TinyLM) for STEPS steps with the same batch
# on every rank, so the averaged gradient is the single-GPU gradient, and compares every parameter with a
# single-GPU ds_muon run (NS in fp32).  The workers take their device from the backend, so the same code
# runs on gloo/CPU (the CPU suite covers those stacks bitwise in test_fsdp/test_overlap/test_deepspeed).
NCCL = {"DS_MUON_TEST_BACKEND": "nccl"}
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLD = min(2, GPUS)  # 2 ranks where 2 GPUs exist; one rank still runs the device paths (streams, hooks)
ATOL = 1e-6  # cuBLAS may pick other kernels for NS stacks of other sizes: close, and usually equal


def _device():
    if dist_harness.backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reference(device, steps=None, mixed_precision=False, comm_dtype=None):
    """Single-device ds_muon on test_overlap's model; names -> parameters (on the CPU).  With
    ``mixed_precision`` it does what FSDP2's bf16 policy does: a bf16 copy computes, fp32 shards step."""
    from test_overlap import STEPS, batch, make_model

    model = make_model().to(device)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=1e-2), ns_dtype=torch.float32,
                       comm_dtype=comm_dtype)
    compute = make_model().to(device, torch.bfloat16) if mixed_precision else model
    for t in range(STEPS if steps is None else steps):
        x, y = (v.to(device) for v in batch(t))
        if mixed_precision:
            with torch.no_grad():
                for c, p in zip(compute.parameters(), model.parameters()):
                    c.copy_(p)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(compute(x.to(next(compute.parameters()).dtype)).float(), y).backward()
        if mixed_precision:
            for c, p in zip(compute.parameters(), model.parameters()):
                p.grad, c.grad = c.grad.float(), None
        opt.step()
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _wrap(stack, model, world, device, opts):
    """(model to call, Muon) for ``stack`` in "ddp", "fsdp1", "fsdp2", "hsdp" with ``opts``:
    overlap, apply_in_forward, prefetch (FSDP forward prefetch), mixed_precision (bf16 params), comm_dtype."""
    groups = ds_muon.muon_param_groups(model, adam_lr=1e-2)
    muon = dict(ns_dtype=torch.float32, overlap=opts.get("overlap", False), waves=3,
                apply_in_forward=opts.get("apply_in_forward", False), comm_dtype=opts.get("comm_dtype"))
    if stack == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device] if device.type == "cuda" else None
        return DDP(model, device_ids=ids), ds_muon.Muon(groups, model=model, **muon)
    if stack == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        fsdp = FSDP(model, device_id=device, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True,
                    forward_prefetch=opts.get("prefetch", False))
        return fsdp, ds_muon.Muon(groups, model=fsdp, **muon)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if stack == "hsdp":
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if opts.get("mixed_precision") else MixedPrecisionPolicy()
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if opts.get("prefetch"):
        model.set_modules_to_forward_prefetch([model[0]])
        model[0].set_modules_to_forward_prefetch([model[2], model[4]])
    return model, ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=1e-2), model=model, **muon)


def _full_named(stack, model):
    """Every parameter whole, by the unwrapped model's names (a collective under FSDP)."""
    if stack == "ddp":
        return {n: p.detach().cpu().clone() for n, p in model.module.named_parameters()}
    if stack == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            return {n: t.detach().cpu().clone() for n, t in model.state_dict().items()}
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():  # the root keeps its parameters gathered after a forward
        if isinstance(m, FSDPModule):
            m.reshard()
    return {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}


def _train(model, opt, device, start, stop):
    from test_overlap import batch

    for t in range(start, stop):
        x, y = (v.to(device) for v in batch(t))
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
    opt.flush()


def _stack_worker(rank, world, stack, opts, ckpt=None):
    """Train ``stack`` STEPS steps; with ``ckpt`` (FSDP2), stop after 2, save with DCP, rebuild from
    another init, load and train the last step.  Returns the full parameters and the wire dtypes."""
    from test_overlap import STEPS, make_model

    dev = _device()
    model, opt = _wrap(stack, make_model().to(dev), world, dev, opts)
    if ckpt is None:
        _train(model, opt, dev, 0, STEPS)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        _train(model, opt, dev, 0, STEPS - 1)
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=ckpt)
        model, opt = _wrap(stack, make_model(seed=123).to(dev), world, dev, opts)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        _train(model, opt, dev, STEPS - 1, STEPS)
    wire = sorted({str(ex.gather_dtype) for ex in opt.exchanges()})
    return _full_named(stack, model), wire


def _assert_close(results, ref, atol=ATOL):
    for rank, (got, _) in enumerate(results):
        assert sorted(got) == sorted(ref)
        for name, want in ref.items():
            torch.testing.assert_close(got[name], want, rtol=0, atol=atol, msg=f"rank {rank} {name}")


def _need(world):
    if GPUS < world:
        pytest.skip(f"needs {world} GPUs for NCCL ranks")


STACKS = {  # name: (stack, options, world)
    "ddp": ("ddp", {}, WORLD),
    "ddp_overlap": ("ddp", dict(overlap=True), WORLD),
    "fsdp1": ("fsdp1", {}, WORLD),
    "fsdp1_prefetch_overlap": ("fsdp1", dict(prefetch=True, overlap=True, apply_in_forward=True), WORLD),
    "fsdp2_prefetch_overlap": ("fsdp2", dict(prefetch=True, overlap=True, apply_in_forward=True), WORLD),
    "hsdp": ("hsdp", {}, 4),
    "hsdp_overlap": ("hsdp", dict(overlap=True, apply_in_forward=True), 4),
}


@pytest.mark.parametrize("name", list(STACKS))
def test_stack_matches_single_gpu(name):
    stack, opts, world = STACKS[name]
    _need(max(world, 1))
    ref = _reference(torch.device("cuda", 0))
    _assert_close(dist_harness.run(_stack_worker, world, stack, opts, env=NCCL), ref)


def test_fsdp2_bf16_mixed_precision_matches_single_gpu():
    """bf16 forward/backward, fp32 reduction and shards, overlap on: as a bf16 copy on one GPU."""
    _need(1)
    ref = _reference(torch.device("cuda", 0), mixed_precision=True)
    results = dist_harness.run(_stack_worker, WORLD, "fsdp2", dict(mixed_precision=True, overlap=True), env=NCCL)
    # the same bf16 products on one GPU and on each rank; 1e-5 leaves room for a bf16 cast of weights that
    # NS kernels made differ in the last fp32 bit
    _assert_close(results, ref, atol=1e-5)


def test_fsdp2_dcp_resume_matches_single_gpu(tmp_path):
    _need(1)
    ref = _reference(torch.device("cuda", 0))
    results = dist_harness.run(_stack_worker, WORLD, "fsdp2", dict(overlap=True), str(tmp_path), env=NCCL)
    _assert_close(results, ref)


def test_bf16_comm_close_to_single_gpu():
    """comm_dtype=bfloat16 rounds what crosses the wire: near the fp32 run (relative to what the
    steps moved), not equal; and the exchanges really were bf16."""
    _need(2)
    from test_overlap import make_model

    dev = torch.device("cuda", 0)
    ref = _reference(dev)
    init = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    results = dist_harness.run(_stack_worker, 2, "fsdp2", dict(comm_dtype=torch.bfloat16), env=NCCL)
    for got, wire in results:
        assert wire == ["torch.bfloat16"], wire
        for name, want in ref.items():
            if name.endswith("weight"):
                moved = (want - init[name]).norm()
                assert (got[name] - want).norm() < 0.1 * moved, name


# DeepSpeed ZeRO on GPUs: test_deepspeed's model and config, imported inside the worker so that DeepSpeed
# picks its accelerator from DS_ACCELERATOR=cuda (it is fixed at DeepSpeed's first import).
DS_ENV = dict(NCCL, DS_ACCELERATOR="cuda", TORCHDYNAMO_DISABLE="1")


def _deepspeed_reference(device):
    import test_deepspeed as T

    model = T.make_model().to(device)
    opt = ds_muon.deepspeed.build_optimizer(model, dict(T.PARAMS, ns_dtype="float32"))
    for t in range(T.STEPS):
        tokens, targets = (v.to(device) for v in T.batch(t))
        model(tokens, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _deepspeed_worker(rank, world, stage):
    import test_deepspeed as T

    config = T.ds_config(stage, params=dict(T.PARAMS, ns_dtype="float32"))
    engine, _, _, _ = ds_muon.deepspeed.initialize(model=T.make_model(), config=config)
    for t in range(T.STEPS):
        tokens, targets = (v.to(engine.device) for v in T.batch(t))
        engine.backward(engine(tokens, targets))
        engine.step()
    return {n: v.cpu() for n, v in T.full_fp32(engine).items()}, type(engine.optimizer).__name__


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_matches_single_gpu(stage):
    pytest.importorskip("deepspeed")
    _need(1)
    ref = _deepspeed_reference(torch.device("cuda", 0))
    results = dist_harness.run(_deepspeed_worker, WORLD, stage, timeout=300, env=DS_ENV)
    for got, wrapper in results:
        assert wrapper == ("DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer")
        for name, want in ref.items():
            torch.testing.assert_close(got[name], want, rtol=0, atol=ATOL, msg=name)


# -- streams: a deferred update lands before FSDP's all-gather streams read the shards -------------------
def _gather_stream_probe_worker(rank, world, stack):
    """After one overlap step, model[2]'s update waits for its forward pre-hook.  The default stream is
    kept busy (a sleep queued just before that hook), so the update lands late on it; a probe placed
    between ds_muon's hook and FSDP's copies model[2]'s shard on the stream FSDP gathers it on, as FSDP's
    copy-in would.  ds_muon must make that stream wait for the update: the probe must see the new values."""
    from test_overlap import batch, make_model

    dev = _device()
    model, opt = _wrap(stack, make_model().to(dev), world, dev, dict(overlap=True, apply_in_forward=True))
    unit = model[2] if stack == "fsdp2" else model.module[2]
    seen, armed = [], []

    def shard():
        if stack == "fsdp2":
            return unit.weight.to_local()
        return unit._handle.flat_param  # FSDP1: its local shard outside forward

    def stream():
        if stack == "fsdp2":
            return unit._get_fsdp_state()._comm_ctx.all_gather_copy_in_stream
        return unit._unshard_stream

    def probe(module, args):
        if armed:
            s = stream()
            with torch.cuda.stream(s):  # no wait on the default stream: what FSDP's copy-in does
                seen.append(shard().detach().clone())

    unit.register_forward_pre_hook(probe, prepend=True)  # before FSDP's; ds_muon's will go before it
    x, y = (v.to(dev) for v in batch(0))
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert opt.runtime.deferred.pending > 0
    unit.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(200_000_000), prepend=True)  # ~0.1 s
    armed.append(True)
    model(x)
    torch.cuda.synchronize()
    opt.flush()
    return torch.equal(seen[0], shard().detach()), len(seen)


@pytest.mark.parametrize("stack", ["fsdp2", "fsdp1"])
def test_deferred_update_ordered_before_fsdp_gather_streams(stack):
    _need(1)
    for equal, probes in dist_harness.run(_gather_stream_probe_worker, WORLD, stack, env=NCCL):
        assert probes == 1
        assert equal, "FSDP's gather stream read the shard before the deferred update landed"


# -- optimizer-state offload: state on the host, NS on the GPU (ds_muon.engine.memory.offload) ---------------------
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_offload_pipelined_ns_matches_device_ns(ns_dtype):
    """A host stack run through the H2D/NS/D2H pipeline in chunks equals NS on the whole stack on the
    GPU (close; cuBLAS may pick other kernels for other batch sizes), with device scratch memory
    within the stated bound."""
    from ds_muon.engine.plan.compile import NSSettings
    from ds_muon.engine.memory.offload import run_ns, scratch_bytes

    ns = NSSettings(5, "keller", ns_dtype, 1e-7, "standard")
    stack = torch.randn(12, 256, 512, generator=torch.Generator().manual_seed(0))
    want = ns.run(stack.cuda()).cpu()
    per = scratch_bytes(256 * 512, 1, 4, ns_dtype.itemsize)
    budget = 3 * per  # four chunks of three matrices
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = run_ns(ns.run, stack, ns_dtype, device=torch.device("cuda"), budget=budget)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert got.device.type == "cpu" and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL if ns_dtype == torch.float32 else 1e-2)
    assert peak <= budget, (peak, budget)


def _offload_worker(rank, world, kind):
    """ZeRO-2/3 with offload_optimizer cpu, or FSDP2 with CPUOffloadPolicy, against the same run without."""
    import test_deepspeed as T

    out = []
    for offload in (False, True):
        if kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

            dev = torch.device("cuda", torch.cuda.current_device())
            model = T.make_model().to(dev)
            kw = {"mesh": init_device_mesh("cuda", (world,))}
            if offload:
                kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
            fully_shard(model, **kw)
            opt = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=0.02, adam_lr=3e-3), ns_dtype=torch.float32)
            for t in range(T.STEPS):
                tokens, targets = (v.to(dev) for v in T.batch(t))
                model(tokens, targets).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            state = {str(v.to_local().device.type) for s in opt.state.values() for v in s.values()
                     if hasattr(v, "to_local")}
            out.append(({n: p.full_tensor().cpu() for n, p in model.named_parameters()}, state))
            continue
        config = T.ds_config(int(kind[-1]), params=dict(T.PARAMS, ns_dtype="float32"))
        if offload:
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        engine, _, _, _ = ds_muon.deepspeed.initialize(model=T.make_model(), config=config)
        for t in range(T.STEPS):
            tokens, targets = (v.to(engine.device) for v in T.batch(t))
            engine.backward(engine(tokens, targets))
            engine.step()
        state = {t.device.type for s in engine.basic_optimizer.state.values() for t in s.values() if torch.is_tensor(t)}
        out.append(({n: v.cpu() for n, v in T.full_fp32(engine).items()}, state))
    return out


@pytest.mark.parametrize("kind", ["zero2", "zero3", "fsdp2"])
def test_offload_matches_no_offload_on_gpu(kind):
    """State on the host, NS on the GPU: close to the run that keeps everything on the GPU (momentum
    and AdamW then run on the CPU instead of the GPU, whose elementwise rounding may differ)."""
    if kind != "fsdp2":
        pytest.importorskip("deepspeed")
    _need(1)
    env = DS_ENV if kind != "fsdp2" else NCCL
    for (plain, plain_state), (off, off_state) in dist_harness.run(_offload_worker, WORLD, kind, timeout=300, env=env):
        assert plain_state == {"cuda"} and off_state == {"cpu"}, (plain_state, off_state)
        for name, want in plain.items():
            torch.testing.assert_close(off[name], want, rtol=0, atol=1e-5, msg=name)
