"""Issue 32: blocks read from the forward go through the same path as the rules' fused blocks on every stack.
Mamba's ``in_proj``/``x_proj`` (row blocks), Qwen3-Next's ``in_proj_qkvz``/``in_proj_ba`` (rows interleaved
per key-head group) and Llama 4's expert stacks (column blocks of ``[E, in, out]`` stacks) under FSDP2
(``Shard(0)``) and FSDP1 flat parameters at W=2 equal one process, ``torch.equal``."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import ds_muon  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import dist_harness  # noqa: E402
from hf_models import hf_batches, hf_loss  # noqa: E402

GROUPS = dict(lr=0.02, adam_lr=3e-3, weight_decay=0.1, adam_weight_decay=0.01)
STEPS = 2
FAMILIES = ("mamba", "qwen3_next", "llama4")


def _build(family):
    import test_trace as T

    return {"mamba": T.tiny_mamba, "qwen3_next": T.tiny_qwen3_next, "llama4": T.tiny_llama4}[family]()


def _layers(model):
    base = getattr(model, "model", None) or getattr(model, "backbone")
    return base.layers


def _groups(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ds_muon.muon_param_groups(model, **GROUPS)


def _train(model, opt):
    for idx in hf_batches(STEPS):
        hf_loss(model, idx).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _single(family):
    with dist_harness.one_thread():
        model = _build(family)
        opt = ds_muon.Muon(_groups(model), ns_dtype=torch.float32)
        _train(model, opt)
        keys = sorted(m.key for b in opt.runtime.bindings.values() for m in b.matrices)
        return {n: p.detach().clone() for n, p in model.named_parameters()}, keys


def _worker(rank, world, cases):
    out = {}
    for family, stack in cases:
        model = _build(family)
        if stack == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in _layers(model):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = ds_muon.Muon(_groups(model), ns_dtype=torch.float32)
            _train(model, opt)
            full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            fsdp = FSDP(model, device_id=torch.device("cpu"),
                        auto_wrap_policy=ModuleWrapPolicy({type(m) for m in _layers(model)}))
            opt = ds_muon.Muon(_groups(fsdp), model=fsdp, ns_dtype=torch.float32)
            _train(fsdp, opt)
            with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT):
                full = {n: t.detach().clone() for n, t in fsdp.state_dict().items()}
        out[family, stack] = full
    return out


def test_traced_blocks_sharded_equal_single_process():
    cases = [(f, s) for f in FAMILIES for s in ("fsdp2", "fsdp1")]
    results = dist_harness.run(_worker, 2, cases, timeout=600)
    for family, stack in cases:
        want, keys = _single(family)
        if family == "mamba":  # the blocks the forward reads: [x | z] and dt | B | C
            assert "backbone.layers.0.mixer.in_proj.weight[1]" in keys and \
                "backbone.layers.0.mixer.x_proj.weight[2]" in keys, keys
        if family == "qwen3_next":
            assert "model.layers.0.linear_attn.in_proj_qkvz.weight[3]" in keys, keys
        if family == "llama4":
            assert "model.layers.0.feed_forward.experts.gate_up_proj[0][1]" in keys, keys
        for out in results:
            got = out[family, stack]
            for n, t in want.items():
                assert torch.equal(got[n], t), (family, stack, n)
