"""Optimizer-state offload: DeepSpeed ZeRO-Offload and FSDP2 ``CPUOffloadPolicy`` with Muon, exact.

W=2 gloo ranks.  Each spawned run builds the same model with and without offload and
trains both on the same batches: the fp32 masters must be bitwise equal (Muon's update
does not depend on where the state lives), and Muon's state must sit in host memory.
DeepSpeed engines are slow to build, so one run covers many cases.
"""

import pytest
import torch

import dist_harness

pytest.importorskip("deepspeed")

from ds_muon import deepspeed as ds_muon_deepspeed  # noqa: E402
from test_deepspeed import ENV, PARAMS, VOCAB, TinyLM, ds_config, full_fp32, train  # noqa: E402

OFFLOAD = {"device": "cpu", "pin_memory": True}


class StackLM(TinyLM):
    """test_deepspeed's TinyLM and two more square layers: a home stacks same-shape matrices."""

    def __init__(self):
        super().__init__()
        dim = self.mix.in_features
        self.mix2, self.mix3 = torch.nn.Linear(dim, dim, bias=False), torch.nn.Linear(dim, dim, bias=False)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        h = h + self.mix3(torch.tanh(self.mix2(h)))
        h = h + self.proj(torch.tanh(self.gate(self.mix(h))))
        logits = self.lm_head(self.norm(h)).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


MUON_NAMES = ["up.weight", "down.weight", "mix.weight", "mix2.weight", "mix3.weight", "gate.weight", "proj.weight"]


def make_model():
    torch.manual_seed(0)
    return StackLM()
STEPS = 3


def offload_config(stage, ns_dtype, offload, bf16=False, clip=0.0):
    cfg = ds_config(stage, bf16=bf16, params=dict(PARAMS, ns_dtype=ns_dtype), clip=clip)
    if offload:  # what a DeepSpeed user writes: no zero_force_ds_cpu_optimizer
        cfg["zero_optimization"]["offload_optimizer"] = dict(OFFLOAD)
    return cfg


def _run(cfg, steps=STEPS):
    engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=cfg)
    train(engine, steps)
    muon = engine.basic_optimizer
    devices = {str(t.device) for s in muon.state.values() for t in s.values() if torch.is_tensor(t)}
    info = {"wrapper": type(engine.optimizer).__name__, "state_devices": devices,
            "offload": getattr(muon.adapter, "offload", None),
            "momenta": sum("momentum_buffer" in s for s in muon.state.values())}
    return full_fp32(engine), info


# (stage, ns_dtype, bf16 model, gradient_clipping)
DS_CASES = [(1, "float32", False, 0.0), (1, "bfloat16", False, 1.0), (2, "bfloat16", False, 0.0),
            (2, "float32", True, 1.0), (3, "float32", False, 0.0), (3, "bfloat16", True, 0.0)]


def _chunks_recorded():
    """Run NS on offloaded stacks one matrix per chunk (the pipeline's chunk loop, on the host here),
    recording (matrices in the stack, matrices per chunk) of each NS call."""
    from ds_muon.engine.memory import offload

    offload.SCRATCH_BYTES = 1
    seen = []
    chunk_matrices = offload.chunk_matrices

    def recording(stack, out_dtype, budget=None):
        n = chunk_matrices(stack, out_dtype, budget)
        seen.append((len(stack), n))
        return n
    offload.chunk_matrices = recording
    return seen


def _deepspeed_worker(rank, world):
    seen = _chunks_recorded()
    out = []
    for stage, ns_dtype, bf16, clip in DS_CASES:
        pair = []
        for off in (False, True):
            seen.clear()
            result, info = _run(offload_config(stage, ns_dtype, off, bf16, clip))
            info["chunked"] = list(seen)
            pair.append((result, info))
        out.append(pair)
    return out


def _all_deepspeed_worker(rank, world, path, cpu_adam):
    """Every DeepSpeed case in one spawned run (engines are slow to build, imports slower)."""
    return (_deepspeed_worker(rank, world), _checkpoint_worker(rank, world, path),
            _cpu_adam_worker(rank, world) if cpu_adam else None)


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    """Per rank: (parity results, checkpoint results, CPU Adam results or None)."""
    path = str(tmp_path_factory.mktemp("offload_ckpt"))
    return dist_harness.run(_all_deepspeed_worker, 2, path, _cpu_adam_built(), timeout=600, env=ENV)


def test_zero_offload_bitwise_equals_no_offload(deepspeed_runs):
    """ZeRO-1/2/3, fp32 and bf16 NS, fp32 and bf16 models, with and without clipping:
    offload changes nothing in the result."""
    init = make_model().state_dict()
    stacked = {}  # case -> some home cut a stack of several matrices into chunks
    for rank, results in enumerate(r[0] for r in deepspeed_runs):
        for case, ((plain, plain_info), (off, off_info)) in zip(DS_CASES, results):
            assert off_info["offload"] is True and plain_info["offload"] is False, (case, off_info, plain_info)
            assert off_info["state_devices"] == {"cpu"}, (case, off_info)
            assert not plain_info["chunked"], (case, plain_info)  # without offload NS runs on whole stacks
            stacks = off_info["chunked"]  # with offload every stack at this home went through the chunk loop
            assert all(n == 1 for _, n in stacks), (case, stacks)
            stacked[case] = stacked.get(case, False) or any(k > 1 for k, _ in stacks)
            assert off_info["momenta"] >= 1, (case, off_info)
            assert off_info["wrapper"] == ("DeepSpeedZeroOptimizer_Stage3" if case[0] == 3
                                           else "DeepSpeedZeroOptimizer"), (case, off_info)
            for name, want in plain.items():
                assert torch.equal(off[name], want), f"{case} rank {rank}: {name} differs with offload " \
                    f"(max {float((off[name] - want).abs().max()):.3g})"
            assert all(float((plain[n] - init[n]).abs().max()) > 1e-3 for n in MUON_NAMES), case
    assert stacked == dict.fromkeys(DS_CASES, True), stacked


# -- checkpoints: save/load with offload resumes bitwise, and a run may switch offload on or off --
CKPT_CASES = [(2, False, True, True), (3, False, True, True), (1, True, True, True), (2, False, False, True),
              (3, False, True, False)]  # (stage, bf16 model, offload when saved, offload when resumed)


def _checkpoint_worker(rank, world, path):
    out = []
    for k, (stage, bf16, save_off, load_off) in enumerate(CKPT_CASES):
        cfg = offload_config(stage, "bfloat16", save_off, bf16)
        engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=cfg)
        train(engine, 2)
        engine.save_checkpoint(path, tag=f"case{k}")
        train(engine, 2, start=2)
        want = full_fp32(engine)
        torch.manual_seed(123)  # a different init: everything must come from the checkpoint
        engine2, _, _, _ = ds_muon_deepspeed.initialize(model=StackLM(),
                                                        config=offload_config(stage, "bfloat16", load_off, bf16))
        engine2.load_checkpoint(path, tag=f"case{k}")
        muon2 = engine2.basic_optimizer
        devices = {str(s["momentum_buffer"].device) for s in muon2.state.values() if "momentum_buffer" in s}
        train(engine2, 2, start=2)
        out.append((want, full_fp32(engine2), devices, engine2.global_steps))
    return out


def test_offload_checkpoint_resume_bitwise(deepspeed_runs):
    for results in (r[1] for r in deepspeed_runs):
        for case, (want, got, devices, steps) in zip(CKPT_CASES, results):
            assert steps == 4, case
            assert devices == {"cpu"}, (case, devices)  # momentum restored beside the host partition
            for name in want:
                assert torch.equal(want[name], got[name]), f"{case}: {name} differs after resume"


def test_config_a_deepspeed_user_writes():
    """The entry lets DeepSpeed take Muon under offload (DeepSpeed refuses client optimizers there
    unless zero_force_ds_cpu_optimizer is false); without offload the key is left alone."""
    cfg, muon = ds_muon_deepspeed.optimizer_from_config(make_model(), offload_config(2, "float32", True))
    assert cfg["zero_force_ds_cpu_optimizer"] is False and muon is not None
    cfg, _ = ds_muon_deepspeed.optimizer_from_config(make_model(), offload_config(2, "float32", False))
    assert "zero_force_ds_cpu_optimizer" not in cfg
    forced = dict(offload_config(3, "float32", True), zero_force_ds_cpu_optimizer=True)
    with pytest.raises(ValueError, match="zero_force_ds_cpu_optimizer.*remove it"):
        ds_muon_deepspeed.optimizer_from_config(make_model(), forced)


# -- the NS pipeline's chunk loop (on the host here; tests/test_cuda.py runs it on a GPU) --------
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_chunked_ns_bitwise_equals_whole_stack(ns_dtype):
    from ds_muon.engine.plan.compile import NSSettings
    from ds_muon.engine.memory.offload import chunk_matrices, run_ns, scratch_bytes

    ns = NSSettings(5, "keller", ns_dtype, 1e-7, "standard")
    g = torch.Generator().manual_seed(0)
    for shape in [(7, 24, 40), (5, 40, 24), (1, 16, 16)]:
        stack = torch.randn(shape, generator=g)
        whole = ns.run(stack)
        per = scratch_bytes(shape[1] * shape[2], 1, stack.element_size(), ns_dtype.itemsize)
        for budget in (1, 2 * per, 3 * per + 1, 10**9):
            want_chunk = max(1, min(shape[0], budget // per))
            assert chunk_matrices(stack, ns_dtype, budget) == want_chunk
            got = run_ns(ns.run, stack, ns_dtype, device=torch.device("cpu"), budget=budget)
            assert got.dtype == whole.dtype and torch.equal(got, whole), (shape, budget)


def test_host_state_and_exchange_device_without_accelerator():
    from ds_muon.engine.memory.offload import accelerator, exchange_device, host_state

    t = torch.zeros(3, 3)
    assert not host_state(t) and host_state(t, offload=True)
    if accelerator() is None:  # a CPU-only machine: everything stays on the host
        assert exchange_device(torch.device("cpu"), None) == torch.device("cpu")


# -- FSDP2 with CPUOffloadPolicy ---------------------------------------------------------
FSDP_CASES = [("float32", False), ("bfloat16", False), ("float32", True)]  # (ns_dtype, bf16 mixed precision)


def _fsdp2(offload, ns_dtype, mixed, seed=0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    import ds_muon
    from models import make_gpt

    model = make_gpt(seed=seed, gate=True)
    kw = {"mesh": init_device_mesh("cpu", (torch.distributed.get_world_size(),))}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)  # pinning needs an accelerator
    if mixed:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=0.02, adam_lr=3e-3, weight_decay=0.1),
                       momentum=0.95, ns_dtype=getattr(torch, ns_dtype))
    return model, opt


def _fsdp2_train(model, opt, data):
    from models import lm_loss

    for idx in data:
        lm_loss(model, idx).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _fsdp2_worker(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    from models import batches

    data = batches(5, batch=4, seq=16, vocab=64, seed=1)
    out = []
    for k, (ns_dtype, mixed) in enumerate(FSDP_CASES):
        full = []
        for offload in (False, True):
            model, opt = _fsdp2(offload, ns_dtype, mixed)
            _fsdp2_train(model, opt, data[:3])
            full.append({n: p.full_tensor().clone() for n, p in model.named_parameters()})
            if offload:  # save at step 3, train 2 more; a fresh offloaded model resumes from the save
                state_devices = {str(t.to_local().device) for s in opt.state.values() for t in s.values()
                                 if hasattr(t, "to_local")}
                ckpt = f"{path}/case{k}"
                dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                         checkpoint_id=ckpt)
                _fsdp2_train(model, opt, data[3:])
                straight = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
                model2, opt2 = _fsdp2(True, ns_dtype, mixed, seed=7)
                _fsdp2_train(model2, opt2, data[:1])  # state to load into
                state = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
                dcp.load(state, checkpoint_id=ckpt)
                set_model_state_dict(model2, state["model"])
                set_optimizer_state_dict(model2, opt2, state["optim"])
                _fsdp2_train(model2, opt2, data[3:])
                resumed = {n: p.full_tensor().clone() for n, p in model2.named_parameters()}
        out.append((full[0], full[1], straight, resumed, state_devices))
    return out


def test_fsdp2_cpu_offload_bitwise_equals_no_offload(tmp_path):
    """FSDP2 with CPUOffloadPolicy, fp32 and bf16 NS, bf16 mixed precision: bitwise the run without
    offload, and a DCP save/load resumes bitwise."""
    from models import make_gpt

    init = {n: p.detach() for n, p in make_gpt(seed=0, gate=True).named_parameters()}
    for results in dist_harness.run(_fsdp2_worker, 2, str(tmp_path), timeout=300):
        for case, (plain, off, straight, resumed, devices) in zip(FSDP_CASES, results):
            assert devices == {"cpu"}, (case, devices)
            for name, want in plain.items():
                assert torch.equal(off[name], want), f"{case}: {name} differs with CPUOffloadPolicy"
                assert torch.equal(resumed[name], straight[name]), f"{case}: {name} differs after resume"
            moved = [n for n, p in init.items() if p.ndim == 2 and float((plain[n] - p).abs().max()) > 1e-3]
            assert len(moved) >= 4, (case, moved)


# -- ds-muon plan: host<->device traffic of offload ------------------------------------------
def test_plan_models_offload_pcie_traffic(capsys):
    """Each rank copies its pieces to the device and the results back (2 x held x bytes); that time
    is added at the PCIe rate, and it never moves a home."""
    import json

    from ds_muon import cli
    from ds_muon.engine.plan import costs
    from ds_muon.engine.plan.cost_model import CostModel, MatrixTask, host_traffic
    from ds_muon.engine.plan.planner import plan_homes

    tasks = [MatrixTask(64, 32, held=(2048, 0)), MatrixTask(32, 32, held=(512, 512)), MatrixTask(16, 64, held=(0, 1024))]
    assert host_traffic(tasks, 2) == [2 * 2 * (2048 + 512), 2 * 2 * (512 + 1024)]
    plain, off = CostModel(), CostModel(pcie_bytes_per_s=1e9, offload=True)
    a, b = plan_homes(tasks, 2, cost_model=plain), plan_homes(tasks, 2, cost_model=off)
    assert a.homes == b.homes
    for t0, t1, h in zip(a.step_time(), b.step_time(), host_traffic(tasks, 2)):
        assert t1 == pytest.approx(t0 + h / 1e9)
    row = costs.compare(tasks, 2, off, ["locality", "duplicated"])
    assert [r["max_host_bytes"] for r in row] == [max(host_traffic(tasks, 2))] * 2
    assert "max_host_bytes" not in costs.compare(tasks, 2, plain, ["locality"])[0]

    assert cli.main(["plan", "--preset", "gpt-125m", "--world-sizes", "8", "--strategies", "locality", "--json"]) == 0
    base = json.loads(capsys.readouterr().out)[0]
    assert cli.main(["plan", "--preset", "gpt-125m", "--world-sizes", "8", "--strategies", "locality", "--json",
                     "--offload", "--pcie-gbps", "200"]) == 0
    with_offload = json.loads(capsys.readouterr().out)[0]
    assert with_offload["max_host_bytes"] > 0
    extra_ms = with_offload["modelled_step_ms"] - base["modelled_step_ms"]
    assert extra_ms == pytest.approx(with_offload["max_host_bytes"] / 25e9 * 1e3, rel=1e-3)


# -- opt-in: DeepSpeed's CPU Adam for the AdamW tensors on the host ---------------------------
def _cpu_adam_built() -> bool:
    """DeepSpeed JIT-builds its CPU Adam on first use (minutes); the test runs where it is built."""
    import os

    from torch.utils.cpp_extension import _get_build_directory

    try:
        return os.path.exists(os.path.join(_get_build_directory("cpu_adam", False), "cpu_adam.so"))
    except Exception:
        return False


def _cpu_adam_worker(rank, world):
    out = []
    for kernel in ("torch", "deepspeed_cpu"):
        cfg = offload_config(2, "float32", True)
        cfg["optimizer"]["params"]["adam_kernel"] = kernel
        out.append(_run(cfg)[0])
    return out


@pytest.mark.skipif(not _cpu_adam_built(), reason="DeepSpeed's cpu_adam extension is not built here (first use "
                    "builds it, minutes): run `python -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; "
                    "CPUAdamBuilder().load()'` once")
def test_deepspeed_cpu_adam_opt_in_is_close_not_bitwise(deepspeed_runs):
    """``"adam_kernel": "deepspeed_cpu"``: AdamW through DeepSpeed's CPU Adam, within rounding of torch's
    (benchmarks/cpu_adam_parity.py measures how far); the default stays torch's."""
    from ds_muon.integrations.deepspeed_cpu_adam import DeepSpeedCPUAdamKernel, adamw_kernel

    with pytest.raises(ValueError, match="adam_kernel.*deepspeed_cpu"):
        adamw_kernel("cpu")
    assert adamw_kernel("torch") is None and isinstance(adamw_kernel("deepspeed_cpu"), DeepSpeedCPUAdamKernel)
    adam_names = ["embed.weight", "lm_head.weight", "norm.weight", "up.bias"]
    for torch_run, ds_run in (r[2] for r in deepspeed_runs):
        assert any(not torch.equal(torch_run[n], ds_run[n]) for n in adam_names)  # the kernel really ran
        for name, want in torch_run.items():
            torch.testing.assert_close(ds_run[name], want, rtol=0, atol=1e-5, msg=name)
