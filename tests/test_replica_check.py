"""No silent results across copies: ranks that hold identical copies of a DTensor shard must get
equal gradients, or ``step()`` raises on every rank, naming the tensor, before anything changes.

ds_muon orthogonalizes each matrix once over every rank holding a copy of its pieces and one home's
result overwrites every copy, so a copy whose gradient differs would be dropped without a word.
Copies at W=4: HSDP's ``replicate`` dim; parameters FSDP2 x TP leaves on the ``dp`` sub-mesh (one
copy per ``tp`` rank); dense parameters of EP x FSDP2 (one copy per ``ep`` rank).  Each case breaks
the copies once (a gradient nudged on one rank, or the tp ranks fed different batches), then checks
that an honest step still passes (the models of tests/test_mesh.py and tests/test_mesh_ep.py).
All scenarios run in one W=4 process group (spawning four ranks costs more than the steps).
"""

from __future__ import annotations

import functools

import torch

import ds_muon

import dist_harness
import test_mesh
import test_mesh_ep


def _attempt(model, opt, batch, nudge=None):
    """One backward + step; ``nudge(named parameters)`` may change gradients first.  Returns
    (error type, message, parameters unchanged) or (None, None, None) when it stepped."""
    model(batch).square().mean().backward()
    if nudge is not None:
        with torch.no_grad():
            nudge(dict(model.named_parameters()))
    before = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    try:
        opt.step()
        out = (None, None, None)
    except (ValueError, RuntimeError, FloatingPointError) as e:
        out = (type(e).__name__, str(e), all(torch.equal(before[n], p.to_local())
                                             for n, p in model.named_parameters()))
    opt.zero_grad(set_to_none=True)
    return out


def _nudge_on(rank, target, name):
    """On ``target`` only: add 1e-3 to the local gradient of ``name`` (a DTensor)."""
    return (lambda params: params[name].grad.to_local().add_(1e-3)) if rank == target else None


def _muon(net, ns_dtype=torch.float32, **kw):
    return ds_muon.Muon(ds_muon.muon_param_groups(net, **test_mesh.OPTS), momentum=0.9, ns_dtype=ns_dtype, **kw)


def _tp_model():
    model = test_mesh.GatedMLP()
    test_mesh._wrap("fsdp_tp", model)  # rank = 2·dp + tp
    return model


class _Embedded(torch.nn.Module):
    """A layer TP leaves alone (an input projection, like an embedding) before test_mesh's MLP."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.embed = torch.nn.Linear(10, 10, bias=False)
        self.mlp = test_mesh.GatedMLP()

    def forward(self, x):
        return self.mlp(self.embed(x))


def _embedded_tp_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _Embedded()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"mlp.w_in": ColwiseParallel(), "mlp.w_gate": ColwiseParallel(),
                                           "mlp.w_out": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def _hsdp_model(dtype=torch.float32):
    model = test_mesh.GatedMLP().to(dtype)
    test_mesh._wrap("hsdp", model)  # rank = 2·replicate + shard
    return model


class _Tiny(torch.nn.Module):
    """A 1-row matrix: its shard on shard coordinate 1 is empty."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.inp = torch.nn.Linear(10, 10, bias=False)  # the input layer (AdamW)
        self.w = torch.nn.Linear(10, 6, bias=False)
        self.head = torch.nn.Linear(6, 1, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.w(self.inp(x))))


def _ep_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp"))  # rank = 2·ep + dp
    model = test_mesh_ep.FusedExperts(mesh["ep"].get_group())
    model.experts = torch.nn.Parameter(distribute_tensor(model.experts.data, mesh["ep"], [Shard(0)]))
    fully_shard(model, mesh=mesh["dp"])
    ds_muon.expert_weight(model.experts)
    return model


def _worker(rank, world):
    out = {}
    batch = test_mesh._batch(0)
    # FSDP2 x TP: proj is on the dp sub-mesh, copied on both tp ranks of each dp group
    model = _tp_model()
    opt = _muon(model, overlap=True, model=model)  # from the second step gathers leave during backward
    out["tp_honest"] = [_attempt(model, opt, batch)]
    out["tp_nudged"] = _attempt(model, opt, batch, _nudge_on(rank, 1, "proj.weight"))
    out["tp_honest"].append(_attempt(model, opt, batch))
    out["tp_dispatched"] = opt.runtime.dispatch.dispatched
    # a data loader that gives the tp ranks of a dp group different batches: the layers after TP's
    # all-reduce see the same activations again, those before it (embed) do not
    model = _embedded_tp_model()
    opt = _muon(model)
    out["tp_batches"] = _attempt(model, opt, test_mesh._batch(rank % 2))
    # HSDP: shard s of every matrix is copied on ranks s and 2 + s
    model = _hsdp_model()
    opt = _muon(model)
    out["hsdp_nudged"] = _attempt(model, opt, batch, _nudge_on(rank, 2, "w_gate.weight"))
    out["hsdp_then_honest"] = _attempt(model, opt, batch)
    def nan(params):
        params["w_gate.weight"].grad.to_local().view(-1)[0].fill_(float("nan"))

    nan = nan if rank == 2 else None
    out["hsdp_nan"] = _attempt(model, opt, batch, nan)  # a non-finite copy is reported as such
    for dtype in (torch.float32, torch.bfloat16):  # honest, with an empty shard: no false alarm
        tiny = _Tiny().to(dtype)
        test_mesh._wrap("hsdp", tiny)
        opt = _muon(tiny, ns_dtype=dtype)
        out[f"hsdp_empty_{dtype}"] = [_attempt(tiny, opt, batch.to(dtype)) for _ in range(2)]
        out[f"hsdp_empty_local_{dtype}"] = tuple(tiny.head.weight.to_local().shape)
    # EP x FSDP2: proj is on the dp sub-mesh, copied on both ep ranks
    model = _ep_model()
    opt = _muon(model)
    ep_batch = test_mesh_ep._ep_batch(0)
    out["ep_nudged"] = _attempt(model, opt, ep_batch, _nudge_on(rank, 3, "proj.weight"))
    out["ep_then_honest"] = _attempt(model, opt, ep_batch)
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return dist_harness.run(_worker, 4, timeout=120)


def _raised_everywhere(case, *named):
    outs = [r[case] for r in _results()]
    for kind, msg, unchanged in outs:
        assert kind == "ValueError" and unchanged, (case, kind, msg)
        assert "got different gradients" in msg and "Nothing was changed" in msg, msg
        for text in named:
            assert text in msg, (text, msg)
    assert len({msg for _, msg, _ in outs}) == 1, outs  # the same error on every rank


def test_fsdp2_tp_copies_with_different_gradients_raise_on_every_rank():
    _raised_everywhere("tp_nudged", "proj.weight (copies on ranks [0, 1], mesh dim 'tp')")
    assert all(r["tp_honest"] == [(None, None, None)] * 2 for r in _results())
    assert all(r["tp_dispatched"] > 0 for r in _results())  # overlap engaged: gathers leave in backward


def test_fsdp2_tp_ranks_fed_different_batches_raise_on_every_rank():
    _raised_everywhere("tp_batches", "(copies on ranks [0, 1], mesh dim 'tp')",
                       "give the ranks of a tp group the same batch")


def test_hsdp_replica_with_a_different_gradient_raises_on_every_rank():
    _raised_everywhere("hsdp_nudged", "w_gate.weight (copies on ranks [0, 2], mesh dim 'replicate')")
    assert all(r["hsdp_then_honest"] == (None, None, None) for r in _results())
    for kind, msg, unchanged in (r["hsdp_nan"] for r in _results()):
        assert kind == "FloatingPointError" and unchanged and "non-finite gradient in w_gate.weight" in msg, msg


def test_hsdp_honest_copies_pass_in_fp32_and_bf16_with_empty_shards():
    for dtype in (torch.float32, torch.bfloat16):
        assert [r[f"hsdp_empty_local_{dtype}"][0] for r in _results()] == [1, 0, 1, 0]
        for r in _results():
            assert r[f"hsdp_empty_{dtype}"] == [(None, None, None)] * 2, r[f"hsdp_empty_{dtype}"]


def test_ep_dense_copies_with_different_gradients_raise_on_every_rank():
    _raised_everywhere("ep_nudged", "proj.weight (copies on ranks [1, 3], mesh dim 'ep')")
    assert all(r["ep_then_honest"] == (None, None, None) for r in _results())
