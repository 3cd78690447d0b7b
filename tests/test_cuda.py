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
    dispatched = opt._dispatch.dispatched if opt._dispatch is not None else 0
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
