"""Lent buffers are written before they are read (ds_muon.engine.memory.lending): with every re-taken buffer
filled with NaN first (``DS_MUON_POISON_LENT=1``), training gives the same bits as without, in one process and
in ranks.  Without the check a read-before-write would see the allocator's leftovers: zeros in a new process,
an earlier call's data in a long-lived (pooled) rank, so a parity test could pass alone and fail in a suite
(issue 51's MoE run was looked at this way too: it holds)."""

from __future__ import annotations

import os

import pytest
import torch

import ds_muon
from ds_muon.engine.memory import lending

import dist_harness
from hf_models import hf_batches, hf_loss, tiny_qwen2_moe
from models import batches, lm_loss, make_gpt

STEPS = 3


def _gpt_run(ns_dtype, model=None, wrap=None):
    model = model or make_gpt()
    if wrap is not None:
        model = wrap(model)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=0.02), ns_dtype=ns_dtype)
    for idx in batches(STEPS):
        lm_loss(model, idx).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_poisoned_lent_memory_changes_no_bit_in_one_process(ns_dtype, monkeypatch):
    with dist_harness.one_thread():
        plain = [p.detach().clone() for p in _gpt_run(ns_dtype).parameters()]
        monkeypatch.setenv(lending.POISON_ENV, "1")
        before = lending._poisoned[0]
        poisoned = [p.detach().clone() for p in _gpt_run(ns_dtype).parameters()]
    assert lending._poisoned[0] > before  # buffers were given back and taken again, poisoned
    assert all(torch.equal(a, b) for a, b in zip(plain, poisoned))


def _ranks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert os.environ.get(lending.POISON_ENV) == "1"
    out = {}
    model = tiny_qwen2_moe()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=0.02), ns_dtype=torch.bfloat16)
    for idx in hf_batches(STEPS):
        hf_loss(model, idx).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["fsdp2_moe_bf16"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    ddp = _gpt_run(torch.float32, wrap=DDP)
    out["ddp_gpt_fp32"] = [p.detach().clone() for p in ddp.module.parameters()]
    out["poisoned"] = lending._poisoned[0]
    return out


def test_poisoned_lent_memory_changes_no_bit_in_ranks():
    """FSDP2 with a bf16 NS on the Qwen2-MoE of issue 51's failure, and DDP with fp32 stacks (Nesterov
    written into the home stack), W=2, poisoned ranks: equal to one unpoisoned process."""
    with dist_harness.one_thread():
        moe = tiny_qwen2_moe()
        opt = ds_muon.Muon(ds_muon.muon_param_groups(moe, lr=0.02), ns_dtype=torch.bfloat16)
        for idx in hf_batches(STEPS):
            hf_loss(moe, idx).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        gpt = [p.detach().clone() for p in _gpt_run(torch.float32).parameters()]
    results = dist_harness.run(_ranks, 2, timeout=240, env={lending.POISON_ENV: "1"})
    for out in results:
        assert out["poisoned"] > 0
        for n, p in moe.named_parameters():
            assert torch.equal(out["fsdp2_moe_bf16"][n], p.detach()), n
        assert all(torch.equal(a, b) for a, b in zip(out["ddp_gpt_fp32"], gpt))
