"""FSDP1 flat parameters: every rank keeps the same state keys, whatever its shard holds.

Found by tests/test_fuzz.py (seed 1, FSDP1 ``use_orig_params=False`` at W=2): a FlatParameter
holding an AdamW tensor (here a 1-element head) and a Muon matrix is cut so that rank 0's shard
holds the head and rank 1's only matrix elements.  Rank 1 then kept only ``momentum_buffer``
while rank 0 kept the AdamW moments too, and ``FSDP.optim_state_dict`` hung: rank 0 all-gathers
``exp_avg`` that rank 1 never sends.
"""

import torch
import torch.distributed as dist
from torch import nn

import ds_muon

import dist_harness


def _worker(rank, world):
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("lm_head", nn.Linear(1, 1, bias=False))  # AdamW, first in the flat parameter: rank 0's
    model.add_module("hidden", nn.Linear(7, 7, bias=False))  # Muon, 49 elements across both shards
    fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=False)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(fsdp), model=fsdp)
    for _ in range(2):
        for p in fsdp.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    (st,) = opt.state.values()
    mine = (sorted(st), float(st["step"]) if "step" in st else None)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if any(e != everyone[0] for e in everyone):
        return everyone, None  # the old code: FSDP.optim_state_dict would hang here
    with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                              FullOptimStateDictConfig(offload_to_cpu=False)):
        full = FSDP.optim_state_dict(fsdp, opt)
    return everyone, {k: sorted(v) for k, v in full["state"].items()}


def test_flat_shard_without_adamw_slices_keeps_every_key():
    for everyone, full in dist_harness.run(_worker, 2, timeout=120):
        assert everyone[0] == everyone[1], f"state keys and step count per rank differ: {everyone}"
        assert everyone[0] == (["exp_avg", "exp_avg_sq", "momentum_buffer", "step"], 2.0)
        assert full is not None and full["lm_head.weight"] == ["exp_avg", "exp_avg_sq", "momentum_buffer", "step"]
