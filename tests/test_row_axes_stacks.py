"""Matrices whose rows are a run of leading axes (``ds_muon.row_axes``) on every stack, bitwise one process.

A T5X/MaxText-style block keeps its projections as raw tensors applied by equations: ``wq: [D, H, hd]``
(``[in, out…]``), ``wo: [H, hd, D]`` applied by ``einsum("bshk,hkd->bsd")`` as one ``[H·hd, D]`` matrix
(rows = the first two axes, inputs), ``w_up: [o1, o2, D]`` applied by ``F.linear(x, w_up.flatten(0, 1))``
and ``w_down: [i1, i2, D]`` by ``x @ w_down.flatten(0, 1)``.  The traced forward tags each (no hand tags),
and every stack must step them as the one-process run does: DDP, FSDP1 (flat and ``use_orig_params``),
FSDP2 (``Shard(0)`` over 3 heads: uneven at W=2), DeepSpeed ZeRO-2 and ZeRO-3 under ``zero.Init``, at W=2,
fp32 and bf16 NS.  Every rank sees the same batch, so the reduced gradient is each rank's exactly (ZeRO:
the one-process step is taken on the gradients the engine stepped on, its ZeRO-3 backward summing in
another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dist_harness
import ds_muon

V, D, H, HD = 13, 10, 3, 4
STEPS = 2
ENV = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1"}
ROW_AXES = {"wo": 2, "w_up": 2, "w_down": 2}  # what the trace must tag (wq stays [D, H·hd], rows 1 axis)


class EinsumBlock(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.wq = nn.Parameter(torch.randn(D, H, HD, generator=g) / D ** 0.5)
        self.wv = nn.Parameter(torch.randn(D, H, HD, generator=g) / D ** 0.5)
        self.wo = nn.Parameter(torch.randn(H, HD, D, generator=g) / (H * HD) ** 0.5)
        self.w_up = nn.Parameter(torch.randn(3, 5, D, generator=g) / D ** 0.5)
        self.w_down = nn.Parameter(torch.randn(3, 5, D, generator=g) / 15 ** 0.5)
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        x = self.embed(idx)
        q = torch.einsum("bsd,dhk->bshk", x, self.wq)
        v = torch.einsum("bsd,dhk->bshk", x, self.wv)
        x = x + torch.einsum("bshk,hkd->bsd", torch.tanh(q) * v, self.wo)
        x = x + torch.relu(F.linear(x, self.w_up.flatten(0, 1))) @ self.w_down.flatten(0, 1)
        return self.head(x)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(100 + step))


def _loss(model, step: int) -> torch.Tensor:
    idx = _batch(step)
    return F.cross_entropy(model(idx).flatten(0, 1), torch.roll(idx, 1, 1).flatten())


def _groups(model):
    return ds_muon.muon_param_groups(model, lr=0.02, adam_lr=3e-3, example_inputs=(_batch(0),))


def _muon(groups, ns_dtype, model=None):
    return ds_muon.Muon(groups, ns_dtype=getattr(torch, ns_dtype), ns_method="standard", log_summary=False,
                        **({"model": model} if model is not None else {}))


def _tags(model) -> dict:
    return {n: getattr(p, "_ds_muon_row_axes", None) for n, p in model.named_parameters()
            if getattr(p, "_ds_muon_row_axes", None)}


def _single(ns_dtype: str, init=None, grads=None) -> dict:
    """One process: its own backward, or the ``grads`` a sharded run stepped on from ``init``."""
    with dist_harness.one_thread():
        torch.manual_seed(0)
        model = EinsumBlock()
        if init is not None:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(init[n])
        groups = _groups(model)
        assert _tags(model) == ROW_AXES, _tags(model)
        muon = {n for g in groups if g["use_muon"] for n in g["param_names"]}
        assert muon == {"wq", "wv", "wo", "w_up", "w_down"}, muon
        opt = _muon(groups, ns_dtype)
        for step in range(STEPS):
            _loss(model, step).backward()
            if grads is not None:
                for n, p in model.named_parameters():
                    p.grad.copy_(grads[step][n])
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _torch_stack(stack: str, world: int, ns_dtype: str) -> dict:
    torch.manual_seed(0)
    model = EinsumBlock()
    if stack == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
        opt = _muon(_groups(wrapped), ns_dtype, wrapped)
    elif stack == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        opt = _muon(_groups(wrapped), ns_dtype, wrapped)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        wrapped = FSDP(model, device_id=torch.device("cpu"), use_orig_params=stack == "fsdp1-orig")
        opt = _muon(_groups(wrapped), ns_dtype, wrapped)
    for step in range(STEPS):
        _loss(wrapped, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if stack.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

        with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT):
            sd = wrapped.state_dict()
        return {n: sd[n].detach().clone() for n, _ in EinsumBlock().named_parameters()}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _torch_worker(rank, world, runs):
    return {run: _torch_stack(*run[:1], world, run[1]) for run in runs}


def _zero(stage: int, ns_dtype: str) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from ds_muon import deepspeed as ds_muon_deepspeed

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    torch.manual_seed(0)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = EinsumBlock()
    else:
        model = EinsumBlock()
    opt = _muon(_groups(model), ns_dtype, model)
    tags = _tags(model)
    engine, _, _, _ = ds_muon_deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    init = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    grads = []
    for step in range(STEPS):
        engine.backward(_loss(engine, step))
        grads.append({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()})
        engine.step()
    assert engine.skipped_steps == 0
    final = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    return {"tags": tags, "init": init, "grads": grads, "final": final}


def _zero_worker(rank, world, runs):
    return {run: _zero(*run) for run in runs}


TORCH_RUNS = [(s, d) for s in ("ddp", "fsdp1", "fsdp1-orig", "fsdp2") for d in ("float32", "bfloat16")]
ZERO_RUNS = [(stage, d) for stage in (2, 3) for d in ("float32", "bfloat16")]


def test_row_axes_matrices_on_ddp_fsdp1_fsdp2_equal_one_process():
    results = dist_harness.run(_torch_worker, 2, TORCH_RUNS, timeout=300)
    for ns_dtype in ("float32", "bfloat16"):
        want = _single(ns_dtype)
        for rank, out in enumerate(results):
            for stack, d in TORCH_RUNS:
                if d == ns_dtype:
                    for n, t in want.items():
                        assert torch.equal(out[stack, d][n], t), (stack, d, rank, n)


def test_row_axes_matrices_on_zero2_and_zero3_equal_one_process():
    pytest.importorskip("deepspeed")
    results = dist_harness.run(_zero_worker, 2, ZERO_RUNS, timeout=300, env=ENV)
    for stage, ns_dtype in ZERO_RUNS:
        got = results[0][stage, ns_dtype]
        assert got["tags"] == ROW_AXES, (stage, got["tags"])
        want = _single(ns_dtype, got["init"], got["grads"])
        moved = min(float((want[n] - got["init"][n]).abs().max()) for n in ROW_AXES)
        assert moved > 1e-3, moved  # Muon stepped them
        for rank, out in enumerate(results):
            for n, t in want.items():
                assert torch.equal(out[stage, ns_dtype]["final"][n], t), (stage, ns_dtype, rank, n)


def test_row_axes_refuses_what_it_cannot_mean():
    w = nn.Parameter(torch.randn(3, 4, 5))
    for k in (0, 3, 1.5, True):
        with pytest.raises(ValueError, match=r"row_axes: k=.*shape \(3, 4, 5\).*1 to 2 leading"):
            ds_muon.row_axes(w, k)
    e = ds_muon.expert_weight(nn.Parameter(torch.randn(2, 3, 4, 5)))
    ds_muon.row_axes(e, 2)  # per expert: [3·4, 5]
    from ds_muon.engine.exchange.slots import logical_blocks
    assert logical_blocks(e, "e") == [("e[0]", (12, 5), 0), ("e[1]", (12, 5), 60)]
    s = ds_muon.split_rows(nn.Parameter(torch.randn(6, 4, 5)), [2, 4])
    with pytest.raises(NotImplementedError, match="before split_rows"):
        ds_muon.row_axes(s, 2)
    r = ds_muon.split_rows(ds_muon.row_axes(nn.Parameter(torch.randn(2, 3, 5)), 2), {"a": 2, "b": 4})
    assert logical_blocks(r, "r") == [("r[a]", (2, 5), 0), ("r[b]", (4, 5), 10)]


def _shard1_worker(rank, world):
    """FSDP2 with the [H, hd, D] output projection (row_axes 2: rows H·hd) sharded along dim 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    model = EinsumBlock()
    wo = model.wo
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrapped = fully_shard(model, mesh=init_device_mesh("cpu", (world,)),
                          shard_placement_fn=lambda p: Shard(1) if p is wo else None)
    try:
        opt = _muon(_groups(wrapped), "float32", wrapped)
        _loss(wrapped, 0).backward()
        opt.step()
    except NotImplementedError as e:
        after = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        return str(e), all(torch.equal(after[n], before[n]) for n in before)
    return None, False


def test_fsdp2_row_axes_matrix_sharded_past_dim_0_is_refused_on_every_rank_before_any_write():
    """A [H, hd, D] parameter read as one [H·hd, D] matrix (row_axes 2) holds whole matrices of rows only in dim-0
    slices; FSDP2 ``Shard(1)`` (``shard_placement_fn``) splits each row, so every rank refuses it, naming the
    tensor and what to do, and no parameter has changed."""
    results = dist_harness.run(_shard1_worker, 2, timeout=300)
    for msg, unchanged in results:
        assert msg is not None and "wo" in msg and "row_axes" in msg and "Shard it along dim 0" in msg, msg
        assert unchanged
