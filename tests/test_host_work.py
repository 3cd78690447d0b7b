"""The step keeps views and buffers across steps to save host time per matrix (ds_muon.engine.exchange.pieces,
ds_muon.engine.agreement.extremes); these tests check that what it keeps never goes stale: a parameter or momentum
buffer whose storage is replaced between steps gets new views, and the bulk (min, max) equals
``torch.aminmax`` tensor by tensor, NaN and ±inf included."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import ds_muon
from ds_muon.engine.agreement import extremes


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 12, bias=False), nn.Linear(12, 12, bias=False), nn.Linear(12, 8, bias=False))


def _train(swap, nesterov: bool, steps: int = 4):
    """Params after each step of a Muon run; ``swap(model, opt)`` runs before step 3."""
    model = _model(0)
    opt = ds_muon.Muon(model.parameters(), lr=0.02, nesterov=nesterov, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    out = []
    for t in range(steps):
        if t == 2:
            swap(model, opt)
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append([p.detach().clone() for p in model.parameters()])
    return out, model, opt


def _swap_storage(model, opt):
    """New storage under the same objects: a parameter's ``.data`` and a momentum buffer."""
    model[0].weight.data = model[0].weight.data.clone()
    st = opt.state[model[1].weight]
    st["momentum_buffer"] = st["momentum_buffer"].clone()


@pytest.mark.parametrize("nesterov", [True, False])
def test_replaced_storage_gets_new_views(nesterov):
    ref, _, _ = _train(lambda m, o: None, nesterov)
    got, model, opt = _train(_swap_storage, nesterov)
    for t, (a, b) in enumerate(zip(ref, got)):
        for k, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {t}: parameter {k} differs after its storage was replaced"
    # the kept state is what the optimizer reads: momentum lives in the state dict's tensor
    buf = opt.state[model[1].weight]["momentum_buffer"]
    assert buf.abs().sum() > 0


def test_momentum_stays_in_the_state_tensor():
    """The momentum update is written through the kept views into ``state['momentum_buffer']``:
    a copy of the optimizer loaded from the state dict continues bitwise."""
    _, model, opt = _train(lambda m, o: None, True, steps=2)
    sd = copy.deepcopy(opt.state_dict())  # torch's load would otherwise share the tensors
    clone = _model(0)
    clone.load_state_dict(model.state_dict())
    opt2 = ds_muon.Muon(clone.parameters(), lr=0.02, nesterov=True, weight_decay=0.1)
    opt2.load_state_dict(sd)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        x = torch.randn(4, 8, generator=g)
        for m, o in ((model, opt), (clone, opt2)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad(set_to_none=True)
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], opt2.state[q]["momentum_buffer"])


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 6, 3, bias=False).to(memory_format=torch.channels_last)  # a permuted flat view
        self.fc = nn.Linear(6 * 4 * 4, 8, bias=False)
        self.out = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.out(self.fc(self.conv(x).flatten(1))).square().mean()


def _conv_run(whole: bool, monkeypatch):
    """Params after 3 steps; ``whole=False`` cuts every piece from the binding's flat view
    (the generic path), as a reference for tensors that stand for their own piece."""
    from ds_muon.engine.exchange import pieces

    with monkeypatch.context() as m:
        if not whole:
            m.setattr(pieces, "_whole", lambda *a: False)
        model = _ConvNet()
        opt = ds_muon.Muon([p for p in model.parameters()], lr=0.02, weight_decay=0.1, weight_decay_mode="l2")
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            model(torch.randn(2, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()]


def test_whole_tensors_and_cut_pieces_update_alike(monkeypatch):
    """A wave mixing a channels_last weight (cut from its memory-order flat view) with weights
    that are their own piece gives what cutting every piece gives, bitwise."""
    for a, b in zip(_conv_run(True, monkeypatch), _conv_run(False, monkeypatch)):
        assert torch.equal(a, b)


def _reference(ts):
    return torch.stack([torch.stack(torch.aminmax(t)).to(torch.promote_types(torch.float32, t.dtype)) for t in ts])


@pytest.mark.parametrize("chunk", [extremes.CHUNK_NUMEL, 40])
def test_bulk_extremes_equal_aminmax(monkeypatch, chunk):
    monkeypatch.setattr(extremes, "CHUNK_NUMEL", chunk)
    monkeypatch.setattr(extremes, "BULK_NUMEL", 30)  # the 6x6 and 1-D 50 go alone
    monkeypatch.setattr(extremes, "CPU_BULK_NUMEL", 30)  # (the CPU's own bound)
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(3, 4, generator=g), torch.randn(6, 6, generator=g), torch.randn(5, generator=g),
          torch.randn(2, 3, generator=g).to(torch.bfloat16), torch.randn(50, generator=g),
          torch.randn(4, 4, generator=g).t(), torch.randn(7, generator=g)]
    ts[0][1, 2] = float("nan")
    ts[2][3] = float("inf")
    ts[6][0] = -float("inf")
    ex = extremes.Extremes()
    for _ in range(2):  # planned, then reused
        got = ex(ts)
        want = _reference(ts)
        assert got.dtype == torch.float32
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    ts[1] = ts[1] * -1  # new values in the same shapes: the kept plan copies them afresh
    assert torch.equal(ex(ts).nan_to_num(0.0), _reference(ts).nan_to_num(0.0))


@pytest.mark.parametrize("seed", range(40))
def test_extremes_equal_aminmax_across_the_cpu_bound(seed):
    """Seeded lists of 1-12 tensors whose sizes straddle ``CPU_BULK_NUMEL`` (some packed, some
    alone), in float32 / bfloat16 / float16, some with NaN or ±inf: the same (min, max) as one
    ``aminmax`` per tensor, planned and then reused."""
    g = torch.Generator().manual_seed(seed)
    bound = extremes.CPU_BULK_NUMEL
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    ts = []
    for _ in range(int(torch.randint(1, 13, (1,), generator=g))):
        n = int(torch.randint(1, 4 * bound, (1,), generator=g))
        t = torch.randn(n, generator=g).to(dtypes[int(torch.randint(0, 3, (1,), generator=g))])
        special = int(torch.randint(0, 4, (1,), generator=g))
        if special:
            t[int(torch.randint(0, n, (1,), generator=g))] = (float("nan"), float("inf"), -float("inf"))[special - 1]
        ts.append(t)
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in ts])
    want = torch.stack([torch.stack(torch.aminmax(t)).to(dtype) for t in ts])
    ex = extremes.Extremes()
    for _ in range(2):
        got = ex(ts)
        assert got.dtype == want.dtype
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
