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
    for ns_dtype in test_mesh.DTYPES:
        per_rank = [res[ns_dtype]["ns_work"][0] for res in results]
        matrices = results[0][ns_dtype]["ns_work"][1]
        assert sorted(matrices) == ["proj.weight", "w_gate.weight", "w_in.weight", "w_out.weight"], matrices
        # one home per matrix in the world: proj.weight used to be orthogonalized once per tp group
        assert all(len(homes) == 1 for homes, _ in matrices.values()), matrices
        once = sum(f for _, f in matrices.values())
        assert once > 0 and sum(per_rank) == once, (per_rank, once)
