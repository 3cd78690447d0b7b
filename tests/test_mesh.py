"""ds_muon on 2-D DTensor meshes at W=4: HSDP 2x2 and FSDP2 x tensor parallel 2x2.

Each rank trains a small gated MLP wrapped by torch's own APIs (``fully_shard`` on a
``(replicate, shard)`` mesh; ``parallelize_module`` with ColwiseParallel/RowwiseParallel
on the ``tp`` dim, then ``fully_shard`` on ``dp``), with uneven shards everywhere.  TP's
forward sums partial products in another order than one matmul, so the reference is
not a single-process forward: every rank records the full gradients its step saw and
the full parameters after it, and a single-process ds_muon fed those gradients must
produce ``torch.equal`` parameters (fp32 and bf16 Newton–Schulz).  HSDP also checks
that each matrix is orthogonalized once in the whole world, not once per replica.
"""

from __future__ import annotations

import torch
from torch import nn

import ds_muon

import dist_harness

OPTS = dict(lr=0.02, adam_lr=3e-3, weight_decay=0.1, adam_weight_decay=0.01)
STEPS = 2
DTYPES = (torch.float32, torch.bfloat16)


class GatedMLP(nn.Module):
    """Llama-style FFN (w_in, w_gate column-parallel; w_out row-parallel) and an untouched proj.
    Uneven: 22 hidden rows split 11/11 by TP then 6/5 by FSDP; 13 output rows split 7/6."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(10, 10, bias=False)  # the input layer (AdamW): the FFN reads hidden states
        self.w_in = nn.Linear(10, 22, bias=False)
        self.w_gate = nn.Linear(10, 22, bias=False)
        self.w_out = nn.Linear(22, 13, bias=False)
        self.proj = nn.Linear(13, 9)
        self.out = nn.Linear(9, 5)  # the output layer (AdamW): proj stays a hidden matrix

    def forward(self, x):
        x = self.inp(x)
        return self.out(torch.tanh(self.proj(torch.relu(self.w_out(torch.nn.functional.silu(self.w_gate(x)) *
                                                                    self.w_in(x))))))


def _batch(step):
    return torch.randn(6, 10, generator=torch.Generator().manual_seed(100 + step))


def _wrap(kind, model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
        return
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"w_in": ColwiseParallel(), "w_gate": ColwiseParallel(),
                                           "w_out": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])


def _ns_work(opt, rank):
    """(NS FLOPs this rank runs per step, {matrix: (home ranks, FLOPs of one NS run)}) from summary()."""
    s = opt.summary()
    return (sum(r.ns_flops for r in s.ranks if r.rank == rank),
            {m.key: (tuple(m.homes), m.ns_flops) for m in s.matrices})


SPLITS = {"w_in.weight": {"q": 9, "k": 13}, "w_out.weight": {"a": 5, "b": 8}}  # blocks across shard borders


def _split(model):
    """Fused projections: row blocks orthogonalized apart (ds_muon.split_rows), on strided row shards
    (w_in) and on column blocks (w_out)."""
    params = dict(model.named_parameters())
    for n, sizes in SPLITS.items():
        ds_muon.split_rows(params[n], sizes)


def _worker(rank, world, kind, split=False, overlap=False):
    out = {}
    for ns_dtype in DTYPES:
        model = GatedMLP()
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        _wrap(kind, model)
        if split:
            _split(model)
        # planner="locality": one home per matrix in the whole world (check_once_in_the_world); the default
        # "auto" chooses per HSDP matrix by the cost model (tests/test_mesh_plan.py)
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model, **OPTS), momentum=0.9, ns_dtype=ns_dtype,
                           overlap=overlap, model=model if overlap else None, planner="locality")
        grads, params = record(model, opt)
        out[ns_dtype] = dict(init=init, grads=grads, params=params, ns_work=_ns_work(opt, rank), split=split,
                             placements={n: str(p.placements) for n, p in model.named_parameters()})
    return out


def record(model, opt, batch=None):
    """STEPS sharded steps: the full gradients each step saw and the full parameters after it."""
    batch = batch or _batch
    grads, params = [], []
    for step in range(STEPS):
        model(batch(step)).square().mean().backward()
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        opt.flush()  # a no-op unless apply_in_forward=True
        params.append({n: p.full_tensor().detach().clone() for n, p in model.named_parameters()})
    return grads, params


def replay(model, init, grads, ns_dtype):
    """Single-process ds_muon on plain tensors (``model``, set to ``init``) fed the gradients the
    sharded run saw; the parameters after each step."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(init[n])
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, **OPTS), momentum=0.9, ns_dtype=ns_dtype)
    after = []
    for g in grads:
        for n, p in model.named_parameters():
            p.grad = g[n].clone()
        opt.step()
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return after


def _reference(init, grads, ns_dtype, split):
    with dist_harness.one_thread():
        model = GatedMLP()
        if split:
            _split(model)
        return replay(model, init, grads, ns_dtype)


def _check_parity(results):
    for ns_dtype in DTYPES:
        for rank, res in enumerate(results):
            r = res[ns_dtype]
            want = _reference(r["init"], r["grads"], ns_dtype, r["split"])
            for step, (got, ref) in enumerate(zip(r["params"], want)):
                for n in ref:
                    assert torch.equal(got[n], ref[n]), (
                        f"{ns_dtype} rank {rank} step {step} {n} ({r['placements'][n]}): "
                        f"max diff {(got[n] - ref[n]).abs().max().item():.3g}")


def test_fsdp2_tp_2x2_matches_single_process():
    results = dist_harness.run(_worker, 4, "fsdp_tp", timeout=120)
    placements = results[0][torch.float32]["placements"]
    assert "_StridedShard" in placements["w_in.weight"], placements  # TP Shard(0) then FSDP Shard(0)
    assert "Shard(dim=1)" in placements["w_out.weight"], placements  # TP Shard(1), FSDP Shard(0)
    _check_parity(results)


def test_fsdp2_tp_2x2_split_rows_matches_single_process():
    results = dist_harness.run(_worker, 4, "fsdp_tp", True, timeout=120)
    keys = results[0][torch.float32]["ns_work"][1]
    assert {"w_in.weight[q]", "w_in.weight[k]", "w_out.weight[a]", "w_out.weight[b]"} <= set(keys), keys
    _check_parity(results)


def test_fsdp2_tp_2x2_overlap_matches_single_process():
    """overlap=True: from the second step the gather starts in FSDP2's post-reduce-scatter hook."""
    results = dist_harness.run(_worker, 4, "fsdp_tp", False, True, timeout=120)
    _check_parity(results)


def test_hsdp_2x2_matches_single_process_and_orthogonalizes_once():
    results = dist_harness.run(_worker, 4, "hsdp", timeout=120)
    _check_parity(results)
    check_once_in_the_world(results)  # each replica group used to run all of them: twice this at 2 replicas


def check_once_in_the_world(results):
    """Every matrix has one home in the whole world, and the ranks together run exactly those NS."""
    for ns_dtype in DTYPES:
        per_rank = [res[ns_dtype]["ns_work"][0] for res in results]
        matrices = results[0][ns_dtype]["ns_work"][1]
        assert sorted(matrices) == ["proj.weight", "w_gate.weight", "w_in.weight", "w_out.weight"], matrices
        assert all(len(homes) == 1 for homes, _ in matrices.values()), matrices
        once = sum(f for _, f in matrices.values())
        assert once > 0 and sum(per_rank) == once, (per_rank, once)


def _unsupported_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world,))
    cases = {  # rows 0 and 2 on rank 0 (row 1 on rank 1): not one range; a conv weight sharded along its input channels
        "interleaved": ((3, 4), [_StridedShard(0, split_factor=2)]),
        "dim1_of_3d": ((4, 6, 3), [Shard(1)]),
    }
    out = {}
    for case, (shape, placements) in cases.items():
        local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
        stride = torch.empty(shape).stride()
        p = nn.Parameter(DTensor.from_local(torch.randn(local_shape), mesh, placements, shape=shape, stride=stride,
                                            run_check=False))
        p.grad = torch.zeros_like(p)
        opt = ds_muon.Muon([p], lr=0.02)
        try:
            opt.step()
            out[case] = None
        except NotImplementedError as e:
            out[case] = str(e)
    return out


def test_unsupported_placements_raise_on_every_rank():
    results = dist_harness.run(_unsupported_worker, 2, timeout=60)
    for res in results:
        assert "not one range" in res["interleaved"], res
        assert "sharded along a dim past 0" in res["dim1_of_3d"], res
