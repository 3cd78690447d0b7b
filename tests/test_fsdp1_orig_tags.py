"""FSDP1 ``use_orig_params=True``: the user's tags on an original tensor decide its algorithm.

Found by tests/test_fuzz.py (seed 0, FSDP1 W=2, cases 0 and 5; first blamed on the state_dict
round trip there): a 3-D stack tagged :func:`ds_muon.expert_weight` inside a module ds_muon does
not know took AdamW ("raw parameter ...") under FSDP1, because the rule for FSDP1's flattened
tensors read the original shape but not the original tensor, which carries the tag; the one-
process reference gave it Muon, one matrix per expert.
"""

import torch
from torch import nn

import ds_muon

import dist_harness


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 3, 4))
        ds_muon.expert_weight(self.weight)

    def forward(self, x):  # x [2, n, 4]
        return torch.bmm(x, self.weight.transpose(1, 2))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(_Stack())


def _run(model, kw):
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model), lr=0.1, log_summary=False, **kw)
    for t in range(2):
        x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(t))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def _worker(rank, world):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fsdp = FSDP(_model(), device_id=torch.device("cpu"), use_orig_params=True)
    opt = _run(fsdp, {"model": fsdp})
    reasons = [r for g in opt.param_groups for r in g.get("param_reasons", [])]
    with FSDP.summon_full_params(fsdp):
        weight = fsdp.module[0].weight.detach().clone()
    return [g["use_muon"] for g in opt.param_groups], reasons, weight


def test_tagged_expert_stack_takes_muon_under_fsdp1_orig_params():
    with dist_harness.one_thread():
        ref = _model()
        _run(ref, {})
    for use_muon, reasons, weight in dist_harness.run(_worker, 2, timeout=120):
        assert use_muon == [True] and reasons == ["hidden matrix, tagged expert_weight"], (use_muon, reasons)
        assert torch.equal(weight, ref[0].weight.detach()), "the FSDP1 step differs from the one-process step"
