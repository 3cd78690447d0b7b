"""``ds_muon.torchtitan`` against a model arranged the way torchtitan arranges its debug Llama.

torchtitan itself is not installed here (docs/TORCHTITAN.md says why), so the model is torchtitan's
debug Llama's layout (``tok_embeddings``, ``layers.N.attention.{wq,wk,wv,wo}``,
``layers.N.feed_forward.{w1,w2,w3}``, RMS norms, ``output``) parallelized as torchtitan's
``parallelize_llama`` does: the TP plan (``ColwiseParallel`` wq/wk/wv/w1/w3 and ``output``,
``RowwiseParallel`` wo/w2 and the embedding) on the ``tp`` mesh dimension, then ``fully_shard`` per
block and the root on ``dp``.  The optimizer comes from both hooks (``MuonOptimizers.Config.build``
and ``build_optimizers`` with a job config's ``[optimizer]`` section).

Each rank gets each step's whole gradient, drawn from a seed, as a DTensor of the parameter's
placements (``distribute_tensor``; the embedding's ``Replicate`` over ``tp``, as DTensor's backward of a
row-wise embedding gives it), so the optimizer is compared alone: every rank's weights, whole,
must be ``torch.equal`` to ``ds_muon.Muon`` in one process after 2K steps.  After K steps model and
container are saved with DCP (``dcp.save`` of the container's ``state_dict``, as torchtitan's
checkpointer does); a fresh model (other seed) and container load it and run the last K steps,
and must end on the same weights.  W=2 runs FSDP2 (dp=2) and TP (tp=2), W=4 the 2-D mesh dp=2 x tp=2
(about 20 s on 2 cores; ``DS_MUON_TORCHTITAN_W4=0`` skips it).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import dist_harness

K = 2
DIM, HEADS, FFN, VOCAB, LAYERS = 32, 4, 48, 64, 2
SETTINGS = dict(lr=0.02, adam_lr=3e-3)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(FFN, DIM, bias=False), nn.Linear(
            DIM, FFN, bias=False)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.feed_forward = Attention(), FeedForward()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)


class DebugLlama(nn.Module):
    """torchtitan's debug Llama's parameters (the optimizer sees only those)."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)


def make_model(seed: int = 0) -> DebugLlama:
    torch.manual_seed(seed)
    return DebugLlama()


def grads(step: int, model) -> dict:
    g = torch.Generator().manual_seed(7000 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def parallelize(model, dp: int, tp: int):
    """torchtitan's parallelize_llama, reduced to the placements: TP plan, then FSDP2 per block and root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "output": ColwiseParallel(output_layouts=Replicate())})
        for block in model.layers.values():
            parallelize_module(block, mesh["tp"], {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
                "feed_forward.w3": ColwiseParallel()})
    if dp > 1:
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def set_grads(model, step: int) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    full = grads(step, model)
    for n, p in model.named_parameters():
        if not isinstance(p, DTensor):
            p.grad = full[n].clone()
            continue
        placements = p.placements
        if n == "tok_embeddings.weight":  # DTensor's backward of a row-wise embedding: a Replicate gradient
            placements = [Replicate() if isinstance(pl, Shard) and pl.dim == 0 and dim == "tp" else pl
                          for pl, dim in zip(p.placements, p.device_mesh.mesh_dim_names)]
        p.grad = distribute_tensor(full[n], p.device_mesh, placements)


def whole(model) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def reference() -> dict:
    import ds_muon

    with dist_harness.one_thread():
        model = make_model()
        opt = ds_muon.torchtitan.MuonOptimizers.Config(**SETTINGS, muon=dict(ns_dtype="float32", log_summary=False)
                                                       ).build(model_parts=[model])
        for s in range(2 * K):
            set_grads(model, s)
            opt.step()
            opt.zero_grad()
    return whole(model)


def _container(model, hook: str):
    import ds_muon.torchtitan as tt

    if hook == "config":
        return tt.MuonOptimizers.Config(**SETTINGS, muon=dict(ns_dtype="float32", log_summary=False)).build(
            model_parts=[model])
    job = SimpleNamespace(optimizer=SimpleNamespace(name="AdamW", lr=SETTINGS["adam_lr"], eps=1e-8, beta1=0.9,
                                                    beta2=0.95, weight_decay=0.0))
    return tt.build_optimizers([model], job, None, lr=SETTINGS["lr"], ns_dtype=torch.float32, log_summary=False)


def _run(dp: int, tp: int, hook: str, ckpt: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = parallelize(make_model(), dp, tp)
    opt = _container(model, hook)
    for s in range(K):
        set_grads(model, s)
        opt.step()
        opt.zero_grad()
    dcp.save({"model": get_model_state_dict(model), "optimizer": opt.state_dict()}, checkpoint_id=ckpt)
    for s in range(K, 2 * K):
        set_grads(model, s)
        opt.step()
        opt.zero_grad()
    straight = whole(model)
    fresh = parallelize(make_model(seed=1), dp, tp)
    fresh_opt = _container(fresh, hook)
    state = {"model": get_model_state_dict(fresh), "optimizer": fresh_opt.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(fresh, state["model"])
    fresh_opt.load_state_dict(state["optimizer"])
    for s in range(K, 2 * K):
        set_grads(fresh, s)
        fresh_opt.step()
        fresh_opt.zero_grad()
    muon = opt.optimizers[0]
    placements = sorted({str(getattr(p, "placements", "plain")) for g in muon.param_groups for p in g["params"]})
    homes = sorted({h for ex in muon.exchanges() for hs in ex.homes.values() for h in hs})
    return dict(straight=straight, resumed=whole(fresh), placements=placements, homes=homes,
                muon=sorted(n for g in muon.param_groups if g["use_muon"] for n in g["param_names"]))


def _worker(rank, world, meshes, tmp):
    return {f"{dp}x{tp}-{hook}": _run(dp, tp, hook, os.path.join(tmp, f"{dp}x{tp}-{hook}"))
            for dp, tp, hook in meshes}


def _check(results, ref):
    hidden = sorted(n for n in ref if n.startswith("layers."))
    hidden = [n for n in hidden if "norm" not in n]
    for r in results:
        for key, run in r.items():
            assert run["muon"] == hidden, (key, run["muon"])  # embeddings, output and norms take AdamW
            for n, want in ref.items():
                assert torch.equal(run["straight"][n], want), (key, "straight", n)
                assert torch.equal(run["resumed"][n], want), (key, "resumed", n)


def test_torchtitan_fsdp2_and_tp_bitwise_one_process(tmp_path):
    ref = reference()
    meshes = [(2, 1, "config"), (1, 2, "build_optimizers")]
    results = dist_harness.run(_worker, 2, meshes, str(tmp_path), timeout=300, env={"OMP_NUM_THREADS": "1"})
    _check(results, ref)
    assert any("Shard(dim=0)" in p for p in results[0]["2x1-config"]["placements"])
    assert any("Shard(dim=1)" in p for p in results[0]["1x2-build_optimizers"]["placements"])  # rowwise wo/w2
    assert all(r[k]["homes"] == [0, 1] for r in results for k in r)  # NS split over both ranks


@pytest.mark.skipif(os.environ.get("DS_MUON_TORCHTITAN_W4") == "0", reason="DS_MUON_TORCHTITAN_W4=0")
def test_torchtitan_2d_mesh_w4(tmp_path):
    ref = reference()
    results = dist_harness.run(_worker, 4, [(2, 2, "config")], str(tmp_path), timeout=400,
                               env={"OMP_NUM_THREADS": "1"})
    _check(results, ref)


def test_refusals():
    import ds_muon.torchtitan as tt

    with pytest.raises(NotImplementedError, match="model parts"):
        tt.MuonOptimizers.Config().build(model_parts=[make_model(), make_model()])
    with pytest.raises(NotImplementedError, match="torchft"):
        tt.build_optimizers([make_model()], None, None, ft_manager=SimpleNamespace(enabled=True))
    with pytest.raises(ValueError, match="closure"):
        tt.MuonOptimizers.Config().build(model_parts=[make_model()]).step(lambda: 0.0)


def test_example_torchtitan_train_tp(tmp_path):
    """examples/torchtitan_train.py under torchrun at W=2 with tensor parallelism (real backward: the
    embedding's gradient comes back Replicate), DCP save at the end: it learns."""
    from test_examples import _run, _torchrun

    s = _run(_torchrun("torchtitan_train.py", "--dp", "1", "--tp", "2", "--save", str(tmp_path / "ckpt")))
    assert (s["tp"], s["world"], s["steps"]) == (2, 2, 20), s
    losses = s["train_losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:3]) / 3 - 1.0, losses
    assert s["muon_home_ranks"] == [0, 1] and "(Shard(dim=1),)" in s["placements"]
    assert os.path.exists(tmp_path / "ckpt" / ".metadata")
