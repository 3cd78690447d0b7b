"""The fused exchange: what crosses the wire is exactly what the homes lack."""

import torch
from torch import nn

import ds_muon
from ds_muon.layout import ParamBinding, slots_in_range

import dist_harness
from models import HandAdapter
from test_sharded_engine import _initial, boundaries, end_to_end


def test_exchange_moves_each_element_at_most_once():
    """Flat partition, W=3: gathered bytes equal what homes lack, nothing more."""
    results = dist_harness.run(_traffic_worker, 3)
    sent_total = sum(r[0] for r in results)
    lacking_total = sum(r[1] for r in results)
    assert sent_total == lacking_total > 0


def _traffic_worker(rank, world):
    mats, _ = _initial()
    offsets, pos = end_to_end(mats)
    lo, hi = boundaries(pos, world)[rank]
    local = nn.Parameter(torch.zeros(hi - lo))
    local._ds_muon_flat = True
    opt = ds_muon.Muon([local], lr=0.05, ns_dtype=torch.float32, adapter=HandAdapter(
        lambda p, n, context: ParamBinding(p, lambda t: t.reshape(-1), slots_in_range(offsets, lo, hi))))
    local.grad = torch.randn(hi - lo)
    opt.step()
    (ex,) = opt.exchanges()
    layout = ex.layout
    lacking = sum(info.numel - info.held_numel(rank) for i, info in enumerate(layout.matrices)
                  if rank in ex.homes[i])
    return sum(ex.split_send_g), lacking
