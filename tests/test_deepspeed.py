"""DeepSpeed integration: ds_muon under ZeRO 0/1/2/3 against the single-process optimizer.

W=2 gloo ranks, identical batches on every rank (the averaged gradient is then
exact), gradient_clipping 0.0: after 3 steps the fp32 master parameters are
bitwise equal to ``ds_muon.Muon`` run in one process on the same model.
"""

import json
import os

import pytest
import torch
from torch import nn

import dist_harness

pytest.importorskip("deepspeed")

import ds_muon  # noqa: E402
from ds_muon import deepspeed as ds_muon_deepspeed  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(REPO, "configs", "deepspeed")
VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 24, 40, 4, 8
STEPS = 3
ENV = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1"}


class TinyLM(nn.Module):
    """Embedding, Linear layers of different shapes (one straddles the ZeRO-2 cut), LayerNorm, head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.mix = nn.Linear(DIM, DIM)
        self.gate = nn.Linear(DIM, 12, bias=False)
        self.proj = nn.Linear(12, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        h = h + self.proj(torch.tanh(self.gate(self.mix(h))))
        logits = self.lm_head(self.norm(h)).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_model():
    torch.manual_seed(0)
    return TinyLM()


def batch(step, micro=0, size=BATCH):
    g = torch.Generator().manual_seed(100 * step + micro)
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


PARAMS = {"lr": 0.02, "momentum": 0.95, "adam_lr": 3e-3, "weight_decay": 0.01}


def ds_config(stage, bf16=False, gas=1, params=None, clip=0.0):
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "DsMuon", "params": dict(params or PARAMS)},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def reference(params, steps=STEPS, double=False):
    """Single-process ds_muon on the full model, one thread (like each rank)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model()
        opt = ds_muon_deepspeed.build_optimizer(model, params)
        for t in range(steps):
            if double:  # one batch of 2·BATCH = two accumulated micro-batches
                a, b = batch(t, 0), batch(t, 1)
                tokens, targets = torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])
            else:
                tokens, targets = batch(t)
            model(tokens, targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def full_fp32(engine):
    """Every parameter's fp32 master value, whole (a collective under ZeRO)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for n, p in engine.module.named_parameters():
        v = safe_get_full_fp32_param(p)
        out[n] = (p.detach() if v is None else v).float().clone()
    return out


def train(engine, steps, start=0, gas=1):
    for t in range(start, start + steps):
        for micro in range(gas):
            tokens, targets = batch(t, micro)
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()


def _engine_worker(rank, world, stage, bf16, gas, params):
    engine, opt, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=ds_config(stage, bf16, gas, params))
    train(engine, STEPS, gas=gas)
    muon = engine.basic_optimizer
    info = {
        "wrapper": type(engine.optimizer).__name__,
        "returned": type(opt).__name__,
        "exchanges": len(muon.exchanges()),
        "holders": {m.key: len(m.holders()) for lay in _all_layouts(muon) for m in lay.matrices},
    }
    return full_fp32(engine), info


def _all_layouts(muon):
    return [lay for _, layouts in muon._resolved.values() for lay in layouts]


WRAPPERS = {0: "Muon", 1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}
MUON_NAMES = ["up.weight", "down.weight", "mix.weight", "gate.weight", "proj.weight"]


@pytest.mark.parametrize("stage,ns_dtype", [(0, "float32"), (1, "bfloat16"), (2, "float32"), (3, "bfloat16")])
def test_fp32_bitwise_with_single_process(stage, ns_dtype):
    params = dict(PARAMS, ns_dtype=ns_dtype)
    ref = reference(params)
    results = dist_harness.run(_engine_worker, 2, stage, False, 1, params, timeout=240, env=ENV)
    for rank, (got, info) in enumerate(results):
        assert info["exchanges"] >= 1, info
        assert info["wrapper"] == WRAPPERS[stage], info
        assert sorted(info["holders"]) == sorted(MUON_NAMES), info
        split = [k for k, h in info["holders"].items() if h == 2]
        if stage == 3:  # every matrix is partitioned across both ranks
            assert len(split) == len(MUON_NAMES), info
        elif stage in (1, 2):  # the flat partition cuts at least one matrix
            assert split and len(split) < len(MUON_NAMES), info
        else:  # replicated
            assert info["holders"] == dict.fromkeys(MUON_NAMES, 2), info
        for name, want in ref.items():
            assert torch.equal(got[name], want), f"stage {stage} rank {rank}: {name} differs " \
                f"(max {float((got[name] - want).abs().max()):.3g})"
        moved = {n: float((ref[n] - make_model().state_dict()[n]).abs().max()) for n in MUON_NAMES}
        assert all(v > 1e-3 for v in moved.values()), moved  # Muon really stepped every matrix
