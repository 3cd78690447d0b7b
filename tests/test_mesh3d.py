"""ds_muon on a 3-D DTensor mesh and on meshes that do not span the world.

* HSDP x TP at W=8: ``init_device_mesh((2, 2, 2), ("replicate", "shard", "tp"))``, the
  gated MLP of test_mesh tensor-parallelized on ``tp`` (ColwiseParallel / RowwiseParallel),
  then ``fully_shard`` on the 2-D ``("replicate", "shard")`` sub-mesh, as torchtitan composes
  HSDP with TP: ``(Replicate(), _StridedShard(0), Shard(0))``, ``(Replicate(), Shard(0),
  Shard(1))`` and, for the parameter TP leaves alone, ``(Replicate(), Shard(0))`` on the
  4-rank sub-mesh.  Uneven everywhere (22 rows -> 11 -> 6/5, 13 rows 7/6, 9 rows 5/4).
  Each matrix must be orthogonalized once in the whole world of 8 ranks.
* Pipeline stages: two independent models and optimizers, one per ``pp`` coordinate, each
  on a mesh over its own half of the world: FSDP2 on a 1-D mesh of 2 ranks at W=4; at W=8
  HSDP on a 2-D ``("replicate", "shard")`` sub-mesh of 4 ranks, and FSDP2 x TP on ``("dp",
  "tp")`` (torchtitan's PP x FSDP x TP).  Every collective the optimizer issues must stay
  inside its stage's ranks (recorded by wrapping ``torch.distributed`` during ``step()``).
  A DTensor on an unnamed 2-D sub-mesh (whose ranks cannot be flattened) is refused on
  every rank, naming the tensor.

The reference is test_mesh's: every rank records the full gradients of each step and the
full parameters after it; single-process ds_muon fed those gradients must give
``torch.equal`` parameters (fp32 and bf16 Newton–Schulz).  One spawn per world size runs
every variant.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import ds_muon

import dist_harness
import test_mesh

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all",
               "all_to_all_single", "broadcast", "broadcast_object_list", "reduce_scatter_tensor", "barrier",
               "new_group", "isend", "irecv", "send", "recv", "batch_isend_irecv")


def _ranks_of(group) -> tuple:
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(sorted(dist.get_process_group_ranks(group)))


@contextlib.contextmanager
def _collectives_recorded(seen: set):
    """Add to ``seen`` the ranks of every group a ``torch.distributed`` collective runs in
    (``new_group`` counts as the world: every world rank must call it)."""
    real = {n: getattr(dist, n) for n in COLLECTIVES}

    def wrap(name, fn):
        def call(*args, **kwargs):
            if name == "new_group":
                seen.add(_ranks_of(None))
            elif name == "batch_isend_irecv":
                seen.update(_ranks_of(op.group) for op in args[0])
            else:
                seen.add(_ranks_of(kwargs.get("group")))
            return fn(*args, **kwargs)
        return call

    for n, fn in real.items():
        setattr(dist, n, wrap(n, fn))
    try:
        yield
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)


def _stage_batch(stage):
    return lambda step: torch.randn(6, 10, generator=torch.Generator().manual_seed(300 + 10 * stage + step))


def _train(model, ns_dtype, split, batch, ranks_seen, overlap=False):
    if split:
        test_mesh._split(model)
    # planner="locality": one home per matrix in the world (check_once_in_the_world); the default "auto"
    # chooses per replicated matrix by the cost model (tests/test_mesh_plan.py)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, **test_mesh.OPTS), momentum=0.9, ns_dtype=ns_dtype,
                       overlap=overlap, model=model if overlap else None, planner="locality")
    real_step = opt.step

    def step(*args, **kwargs):
        with _collectives_recorded(ranks_seen):
            return real_step(*args, **kwargs)

    opt.step = step
    return opt, test_mesh.record(model, opt, batch)


def _hsdp_tp(rank, ns_dtype, split, overlap=False):
    """HSDP x TP on the 3-D mesh: TP on ``tp``, then ``fully_shard`` on ``("replicate", "shard")``
    (``overlap``: gathers start in FSDP2's hook, after the reduce-scatter and the replicate all-reduce)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    model = test_mesh.GatedMLP()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallelize_module(model, mesh["tp"], {"w_in": ColwiseParallel(), "w_gate": ColwiseParallel(),
                                           "w_out": RowwiseParallel()})
    fully_shard(model, mesh=mesh["replicate", "shard"])
    seen = set()
    opt, (grads, params) = _train(model, ns_dtype, split, None, seen, overlap)
    return dict(init=init, grads=grads, params=params, split=split, ns_work=test_mesh._ns_work(opt, rank),
                placements={n: str(p.placements) for n, p in model.named_parameters()}, stage_ranks=None,
                seen=seen, early=(opt.runtime.dispatch.dispatched, opt.runtime.dispatch.redone) if overlap else None)


def _stages(rank, ns_dtype, sub_mesh_dims):
    """One model and optimizer per ``pp`` coordinate, on a sub-mesh over that stage's ranks:
    ``(pp, dp)`` -> FSDP2 on the 1-D ``dp`` mesh; ``(pp, replicate, shard)`` -> HSDP on a 2-D
    sub-mesh; ``(pp, dp, tp)`` -> TP on ``tp``, then FSDP2 on ``dp`` (torchtitan's PP x FSDP x TP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    shape = (2,) + (2,) * len(sub_mesh_dims)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp",) + sub_mesh_dims)
    stage = mesh["pp"].get_local_rank()
    model = test_mesh.GatedMLP(seed=stage)  # different stages, different weights and batches
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    stage_mesh = mesh[sub_mesh_dims] if len(sub_mesh_dims) > 1 else mesh[sub_mesh_dims[0]]
    if "tp" in sub_mesh_dims:
        parallelize_module(model, mesh["tp"], {"w_in": ColwiseParallel(), "w_gate": ColwiseParallel(),
                                               "w_out": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        fully_shard(model, mesh=stage_mesh)
    seen = set()
    opt, (grads, params) = _train(model, ns_dtype, False, _stage_batch(stage), seen)
    return dict(init=init, grads=grads, params=params, split=False, ns_work=test_mesh._ns_work(opt, rank),
                placements={n: str(p.placements) for n, p in model.named_parameters()},
                stage_ranks=tuple(sorted(int(r) for r in stage_mesh.mesh.flatten().tolist())), seen=seen)


def _unnamed_sub_mesh_error(rank):
    """A DTensor on a 2-D DeviceMesh without mesh_dim_names over half the world (ranks 0, 1 or 2, 3;
    fully_shard itself refuses such a mesh, distribute_tensor does not): its ranks cannot be
    flattened into one group, so step() must refuse on every rank, naming the parameter."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    meshes = [DeviceMesh("cpu", [[0], [1]]), DeviceMesh("cpu", [[2], [3]])]  # every rank builds both
    torch.manual_seed(0)
    w = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), meshes[rank // 2], [Replicate(), Shard(0)]))
    w.grad = torch.ones_like(w)
    opt = ds_muon.Muon([w], lr=0.02)
    try:
        opt.step()
    except NotImplementedError as e:
        return str(e)
    return None


def _worker(rank, world, variants, unnamed_mesh=False):
    out = {}
    for name, fn, args in variants:
        out[name] = {ns_dtype: fn(rank, ns_dtype, *args) for ns_dtype in test_mesh.DTYPES}
    if unnamed_mesh:
        out["unnamed"] = _unnamed_sub_mesh_error(rank)
    return out


def _variant(results, name):
    return [res[name] for res in results]


def _check_stages(results):
    """Parity on every rank; each stage plans and talks inside its own ranks only, and
    orthogonalizes each of its matrices once."""
    test_mesh._check_parity(results)
    for ns_dtype in test_mesh.DTYPES:
        by_stage = {}
        for rank, res in enumerate(results):
            r = res[ns_dtype]
            assert rank in r["stage_ranks"], (rank, r["stage_ranks"])
            assert r["seen"] and all(set(g) <= set(r["stage_ranks"]) for g in r["seen"]), (
                f"rank {rank}: the optimizer of the stage on ranks {r['stage_ranks']} ran collectives in groups "
                f"{sorted(r['seen'])}")
            by_stage.setdefault(r["stage_ranks"], []).append(res)
        assert len(by_stage) == 2, sorted(by_stage)
        for ranks, stage in by_stage.items():
            matrices = stage[0][ns_dtype]["ns_work"][1]
            homes = {h for hs, _ in matrices.values() for h in hs}
            assert homes <= set(ranks), (ranks, matrices)
            test_mesh.check_once_in_the_world(stage)


W8 = (("hsdp_tp", _hsdp_tp, (False,)),
      ("hsdp_tp_split", _hsdp_tp, (True,)),
      ("hsdp_tp_overlap", _hsdp_tp, (False, True)),
      ("pp_hsdp", _stages, (("replicate", "shard"),)),
      ("pp_fsdp_tp", _stages, (("dp", "tp"),)))


def test_w8_3d_meshes_hsdp_x_tp_and_pipeline_stages_on_2d_sub_meshes():
    results = dist_harness.run(_worker, 8, W8, timeout=170)

    hsdp_tp = _variant(results, "hsdp_tp")
    placements = hsdp_tp[0][torch.float32]["placements"]
    assert placements["w_in.weight"].startswith("(Replicate(), _StridedShard(dim=0"), placements
    assert placements["w_out.weight"] == "(Replicate(), Shard(dim=0), Shard(dim=1))", placements
    assert placements["proj.weight"] == "(Replicate(), Shard(dim=0))", placements  # 2-D sub-mesh of 4 ranks
    test_mesh._check_parity(hsdp_tp)
    test_mesh.check_once_in_the_world(hsdp_tp)  # one home in the 8 ranks, not one per replica or tp group

    split = _variant(results, "hsdp_tp_split")
    keys = split[0][torch.float32]["ns_work"][1]
    assert {"w_in.weight[q]", "w_in.weight[k]", "w_out.weight[a]", "w_out.weight[b]"} <= set(keys), keys
    test_mesh._check_parity(split)
    overlap = _variant(results, "hsdp_tp_overlap")
    test_mesh._check_parity(overlap)
    early = [r[ns_dtype]["early"] for r in overlap for ns_dtype in test_mesh.DTYPES]
    assert all(sent > 0 and redone == 0 for sent, redone in early), early  # last step's gathers sent from backward

    stages = _variant(results, "pp_hsdp")
    assert stages[0][torch.float32]["placements"]["proj.weight"] == "(Replicate(), Shard(dim=0))"
    _check_stages(stages)

    stages = _variant(results, "pp_fsdp_tp")
    placements = stages[0][torch.float32]["placements"]
    assert placements["w_out.weight"] == "(Shard(dim=0), Shard(dim=1))", placements
    assert placements["proj.weight"] == "(Shard(dim=0),)", placements  # planned over its stage's (dp, tp)
    _check_stages(stages)


def test_w4_pipeline_stages_on_1d_meshes_of_two_ranks():
    results = dist_harness.run(_worker, 4, (("pp_fsdp", _stages, (("dp",),)),), True, timeout=120)
    stages = _variant(results, "pp_fsdp")
    assert [r[torch.float32]["stage_ranks"] for r in stages] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    _check_stages(stages)
    for rank, res in enumerate(results):  # a 2-D sub-mesh without dim names: refused on every rank
        error = res["unnamed"] or ""
        assert "param_groups[0]['params'][0]" in error and "mesh_dim_names" in error, (rank, error)
