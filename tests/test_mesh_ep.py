"""ds_muon at W=4 on 2-D meshes beyond HSDP: FSDP2 x TP with parameters TP leaves alone, and
expert parallel x FSDP2 for a MoE's fused experts.

* FSDP2 x TP: parameters TP does not touch live on the ``dp`` sub-mesh, identical on every
  ``tp`` coordinate; they are planned over the whole ``(dp, tp)`` mesh, so every matrix is
  orthogonalized once in the world (not once per ``tp`` group).
* EP x FSDP2: a fused experts tensor ``[E, out, in]`` distributed ``Shard(0)`` on ``ep``, then
  ``fully_shard`` on ``dp`` (default: ``_StridedShard(0)``, one expert per rank; with
  ``shard_placement_fn`` -> ``Shard(1)``: each expert's rows split over ``dp``).  Each expert is
  its own Muon matrix (:func:`ds_muon.expert_weight`).

The reference is test_mesh's: every rank records the full gradients of each step and the full
parameters after it; single-process ds_muon fed those gradients must give ``torch.equal``
parameters (fp32 and bf16 Newton–Schulz).
"""

from __future__ import annotations

import torch

import dist_harness
import test_mesh


def test_fsdp2_tp_untouched_params_orthogonalized_once_in_the_world():
    results = dist_harness.run(test_mesh._worker, 4, "fsdp_tp", timeout=120)
    placements = results[0][torch.float32]["placements"]
    assert placements["proj.weight"] == "(Shard(dim=0),)", placements  # on the dp sub-mesh only
    test_mesh._check_parity(results)
    test_mesh.check_once_in_the_world(results)  # proj.weight used to be orthogonalized once per tp group


E, OUT, IN = 3, 8, 5  # uneven: experts 2/1 over ep (FSDP2 refuses an uneven Shard(1): rows 4/4 over dp)


class FusedExperts(torch.nn.Module):
    """A fused experts stack ``[E, out, in]`` (each ep rank runs its own experts) and a dense proj."""

    def __init__(self, ep_group=None):
        super().__init__()
        torch.manual_seed(0)
        self.experts = torch.nn.Parameter(torch.randn(E, OUT, IN) / IN ** 0.5)
        self.proj = torch.nn.Linear(OUT, 4)
        self.ep_group = ep_group

    def forward(self, x):
        if self.ep_group is None:
            return self.proj(torch.relu(torch.einsum("bi,eoi->bo", x, self.experts)))
        from torch.distributed.nn.functional import all_reduce

        y = torch.einsum("bi,eoi->bo", x, self.experts.to_local())  # this ep rank's experts
        return self.proj(torch.relu(all_reduce(y, group=self.ep_group)))  # every expert's sum on every rank


def _ep_batch(step):
    return torch.randn(6, IN, generator=torch.Generator().manual_seed(200 + step))


def _ep_worker(rank, world, dim1):
    import ds_muon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    out = {}
    for ns_dtype in test_mesh.DTYPES:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp"))
        model = FusedExperts(mesh["ep"].get_group())
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        model.experts = torch.nn.Parameter(distribute_tensor(model.experts.data, mesh["ep"], [Shard(0)]))
        fully_shard(model, mesh=mesh["dp"],
                    shard_placement_fn=(lambda p: Shard(1) if p.ndim == 3 else None) if dim1 else None)
        ds_muon.expert_weight(model.experts)  # E matrices [out, in]
        # planner="locality": once in the world (_check_ep); "auto" may give the replicated proj a home per group
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model, **test_mesh.OPTS), momentum=0.9, ns_dtype=ns_dtype,
                           planner="locality")
        grads, params = test_mesh.record(model, opt, _ep_batch)
        out[ns_dtype] = dict(init=init, grads=grads, params=params, ns_work=test_mesh._ns_work(opt, rank),
                             placements={n: str(p.placements) for n, p in model.named_parameters()},
                             local=tuple(model.experts.to_local().shape))
    return out


def _ep_reference(init, grads, ns_dtype):
    import ds_muon

    with dist_harness.one_thread():
        model = FusedExperts()
        ds_muon.expert_weight(model.experts)
        return test_mesh.replay(model, init, grads, ns_dtype)


def _check_ep(results):
    for ns_dtype in test_mesh.DTYPES:
        for rank, res in enumerate(results):
            r = res[ns_dtype]
            for step, (got, ref) in enumerate(zip(r["params"], _ep_reference(r["init"], r["grads"], ns_dtype))):
                for n in ref:
                    assert torch.equal(got[n], ref[n]), (
                        f"{ns_dtype} rank {rank} step {step} {n} ({r['placements'][n]}): "
                        f"max diff {(got[n] - ref[n]).abs().max().item():.3g}")
        matrices = results[0][ns_dtype]["ns_work"][1]
        assert sorted(matrices) == ["experts[0]", "experts[1]", "experts[2]", "proj.weight"], matrices
        assert all(len(homes) == 1 for homes, _ in matrices.values()), matrices  # once in the world
        per_rank = [res[ns_dtype]["ns_work"][0] for res in results]
        assert sum(per_rank) == sum(f for _, f in matrices.values()), (per_rank, matrices)


def test_ep_x_fsdp2_strided_experts_stay_where_they_are():
    """Default composition: (_StridedShard(0), Shard(0)) on (dp, ep); each rank holds whole experts
    (rank = 2·ep + dp: experts 0, 1 on ep 0, expert 2 on ep 1), so each is orthogonalized where it is."""
    results = dist_harness.run(_ep_worker, 4, False, timeout=120)
    r0 = results[0][torch.float32]
    assert "_StridedShard(dim=0" in r0["placements"]["experts"], r0["placements"]
    assert [res[torch.float32]["local"][0] for res in results] == [1, 1, 1, 0]
    _check_ep(results)
    for ns_dtype in test_mesh.DTYPES:
        homes = {k: h for k, (h, _) in results[0][ns_dtype]["ns_work"][1].items()}
        assert (homes["experts[0]"], homes["experts[1]"], homes["experts[2]"]) == ((0,), (1,), (2,)), homes


def _second_model_worker(rank, world):
    """The Shard(1) model built in ranks that built the strided one before: torch hands FSDP2 its cached
    (dp, ep) mesh from the first model, an equal mesh under another root object."""
    _ep_worker(rank, world, False)
    return _ep_worker(rank, world, True)


def test_ep_x_fsdp2_shard1_experts_matches_single_process():
    """shard_placement_fn -> Shard(1): (Shard(1), Shard(0)) on (dp, ep); each expert's rows split 4/4
    over dp (sharded past dim 0 used to raise NotImplementedError). Built second in its process, so the
    replicated proj is still planned once in the world (it was planned once per dp group, twice in all,
    while ds_muon compared the meshes' roots by identity)."""
    results = dist_harness.run(_second_model_worker, 4, timeout=180)
    r0 = results[0][torch.float32]
    assert r0["placements"]["experts"] == "(Shard(dim=1), Shard(dim=0))", r0["placements"]
    _check_ep(results)
