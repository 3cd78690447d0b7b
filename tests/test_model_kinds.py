"""Which tensors take Muon on families ``tests/`` did not build before, decided from what each module
does and what the config says (issue 24), and each fused block / expert updated alone.

Every family here was wrong on the old name-and-shape rule (Mamba's ``A_log`` and depthwise conv on
Muon, ResNet's classifier and stem on Muon, DBRX/JetMoE routers on Muon, DBRX experts one matrix,
Phi-3 / GPT-NeoX / GPT-2 fused q|k|v one matrix, gpt-oss and ViT refused).  Updates are checked
against a hand-written 2-D reference: ``w0 - lr·scale·NS(grad block)``, ``torch.equal`` in fp32 NS
on one thread (momentum 0: the NS input is the gradient), single process and FSDP2 at W=2.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import ds_muon  # noqa: E402

import dist_harness  # noqa: E402
from hf_models import FAMILIES, MORE_FAMILIES, hf_batches, hf_loss  # noqa: E402

LR = 0.05


def _groups(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ds_muon.muon_param_groups(model, lr=LR, adam_lr=1e-3, **kw)


def _kinds(groups) -> dict:
    return {n: (k, g["use_muon"]) for g in groups
            for n, k in zip(g["param_names"], g.get("param_kinds", [None] * len(g["param_names"])))}


def _muon(groups) -> set:
    return {n for g in groups if g["use_muon"] for n in g["param_names"]}


def _one_step(model, **kw):
    """One step from seeded random gradients, momentum 0: returns (weights before, grads, optimizer)."""
    opt = ds_muon.Muon(_groups(model, **kw), momentum=0.0, nesterov=False, ns_dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    grads = {}
    for n, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=g)
        grads[n] = p.grad.clone()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    return before, grads, opt


def _expected(w0, grad, stored_in_out=False):
    """The hand-written reference for one 2-D block: NS on its own, the scale of its [out, in]."""
    o = ds_muon.newton_schulz(grad.contiguous(), dtype=torch.float32, method="auto")  # Muon's default method
    r, c = grad.shape
    scale = ds_muon.get_muon_scale_factor(*((c, r) if stored_in_out else (r, c)))
    return w0.clone().add_(o, alpha=-LR * scale)


def _check_blocks(model, before, grads, name, selections, stored_in_out=False, contrast=True):
    """Every block ``p[sel]`` of tensor ``name`` moved exactly as its own 2-D reference."""
    p = dict(model.named_parameters())[name].detach()
    for sel in selections:
        got, want = p[sel], _expected(before[name][sel], grads[name][sel], stored_in_out)
        assert got.shape == want.shape and got.dim() == 2, (name, sel)
        assert torch.equal(got, want), (name, sel, float((got - want).abs().max()))
    if not contrast:
        return
    # and the block update is not the whole-matrix one (what the old rule did)
    whole = _expected(before[name].reshape(p.shape[0], -1) if p.dim() == 2 else before[name][0],
                      grads[name].reshape(p.shape[0], -1) if p.dim() == 2 else grads[name][0], stored_in_out)
    assert not torch.allclose(whole, p.reshape(p.shape[0], -1) if p.dim() == 2 else p[0], atol=1e-5)


def _heads_rows(nh, hd, j):
    """Rows of block j (q=0, k=1, v=2) of a weight laid [head, (q, k, v), head_dim] (GPT-NeoX)."""
    return torch.tensor([h * 3 * hd + j * hd + r for h in range(nh) for r in range(hd)])


# -- what is on Muon ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["mamba", "jamba"])
def test_state_space_a_log_and_depthwise_conv_take_adamw(family):
    model = MORE_FAMILIES[family]()
    with pytest.warns(UserWarning, match=r"raw parameter.*A_log.*include="):
        groups = ds_muon.muon_param_groups(model)
    kinds = _kinds(groups)
    a_logs = [n for n in kinds if n.endswith("A_log")]
    convs = [n for n in kinds if n.endswith("conv1d.weight")]
    assert a_logs and convs
    assert all(kinds[n] == ("raw parameter", False) for n in a_logs)
    assert all(kinds[n] == ("depthwise conv", False) for n in convs)
    assert {kinds[n][0] for n in _muon(groups)} <= {"hidden linear", "expert", "fused block"}, _muon(groups)
    in_projs = [n for n in kinds if n.endswith(("mixer.in_proj.weight", "mamba.in_proj.weight"))]
    assert in_projs and all(kinds[n] == ("fused block", True) for n in in_projs)  # issue 32: [x | z], chunk(2)
    if family == "jamba":
        assert kinds["model.layers.1.feed_forward.router.weight"] == ("router", False)
    opted = _muon(_groups(model, include=["*.A_log"]))  # the warning's way to opt one in
    assert set(a_logs) <= opted


def test_resnet_classifier_and_stem_take_adamw_convs_take_muon():
    model = MORE_FAMILIES["resnet"]()
    kinds = _kinds(_groups(model))
    assert kinds["classifier.1.weight"] == ("output head", False)  # a Linear producing config.num_labels
    assert kinds["resnet.embedder.embedder.convolution.weight"] == ("input layer", False)  # reads 3 channels
    convs = [n for n, (k, _) in kinds.items() if k == "conv"]
    assert len(convs) == 7 and all(kinds[n][1] for n in convs)
    with dist_harness.one_thread():
        before, grads, _ = _one_step(model)
    name = convs[0]
    w = dict(model.named_parameters())[name].detach()
    want = _expected(before[name].reshape(w.shape[0], -1), grads[name].reshape(w.shape[0], -1)).view_as(w)
    assert torch.equal(w, want)


def test_vit_cls_and_position_tables_take_adamw():
    model = MORE_FAMILIES["vit"]()
    with pytest.warns(UserWarning, match="cls_token"):
        groups = ds_muon.muon_param_groups(model)  # refused before: the 3-D cls_token
    kinds = _kinds(groups)
    assert kinds["vit.embeddings.cls_token"] == ("raw parameter", False)
    assert kinds["vit.embeddings.position_embeddings"] == ("raw parameter", False)
    assert kinds["vit.embeddings.patch_embeddings.projection.weight"] == ("input layer", False)
    assert kinds["classifier.weight"] == ("output head", False)
    assert len(_muon(groups)) == 6  # q, k, v, o, fc1, fc2


# -- fused projections and experts, each block its own NS --------------------------------------------
def test_phi3_qkv_and_gate_up_split_from_the_config():
    model = MORE_FAMILIES["phi3"]()
    with dist_harness.one_thread():
        before, grads, _ = _one_step(model)
    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    _check_blocks(model, before, grads, "model.layers.0.self_attn.qkv_proj.weight",
                  [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)])
    ff = c.intermediate_size
    _check_blocks(model, before, grads, "model.layers.1.mlp.gate_up_proj.weight", [slice(0, ff), slice(ff, 2 * ff)])


def test_gpt_neox_query_key_value_interleaved_per_head():
    model = MORE_FAMILIES["gpt_neox"]()
    with dist_harness.one_thread():
        before, grads, _ = _one_step(model)
    nh = model.config.num_attention_heads
    hd = model.config.hidden_size // nh
    _check_blocks(model, before, grads, "gpt_neox.layers.0.attention.query_key_value.weight",
                  [_heads_rows(nh, hd, j) for j in range(3)])


def test_gpt2_c_attn_column_blocks():
    """An intended change: GPT-2's c_attn (Conv1D, stored [in, out]) was one [32, 96] matrix; its q, k
    and v are now column blocks, each scaled as the [32, 32] map it is."""
    model = FAMILIES["gpt2"]()
    with dist_harness.one_thread():
        before, grads, _ = _one_step(model)
    d = model.config.n_embd
    _check_blocks(model, before, grads, "transformer.h.0.attn.c_attn.weight",
                  [(slice(None), slice(j * d, (j + 1) * d)) for j in range(3)], stored_in_out=True)


def test_gpt_oss_interleaved_gate_up_per_expert():
    model = MORE_FAMILIES["gpt_oss"]()  # refused before (interleaved, stored [E, in, 2·ff])
    kinds = _kinds(_groups(model))
    assert kinds["model.layers.0.mlp.router.weight"] == ("router", False)
    assert kinds["model.layers.0.mlp.experts.gate_up_proj_bias"] == ("norm/bias/1-D", False)
    with dist_harness.one_thread():
        before, grads, _ = _one_step(model)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    E = model.config.num_local_experts
    _check_blocks(model, before, grads, name, [(e, slice(None), slice(j, None, 2)) for e in range(E) for j in (0, 1)],
                  stored_in_out=True)
    _check_blocks(model, before, grads, "model.layers.1.mlp.experts.down_proj", [(e,) for e in range(E)],
                  stored_in_out=True, contrast=False)


def test_dbrx_router_adamw_and_each_2d_stored_expert_alone():
    model = MORE_FAMILIES["dbrx"]()
    kinds = _kinds(_groups(model))
    assert kinds["transformer.blocks.0.ffn.router.layer.weight"] == ("router", False)
    assert kinds["transformer.blocks.0.ffn.experts.mlp.w1"] == ("expert", True)
    with dist_harness.one_thread():
        before, grads, _ = _one_step(model)
    ff, E = 16, 4
    experts = [slice(e * ff, (e + 1) * ff) for e in range(E)]
    pre = "transformer.blocks.0.ffn.experts.mlp."
    _check_blocks(model, before, grads, pre + "w1", experts)
    _check_blocks(model, before, grads, pre + "v1", experts)
    _check_blocks(model, before, grads, pre + "w2", experts, stored_in_out=True)  # applied as x @ w2[e]
    _check_blocks(model, before, grads, "transformer.blocks.1.norm_attn_norm.attn.Wqkv.weight",
                  [slice(0, 32), slice(32, 48), slice(48, 64)])


def test_jetmoe_routers_adamw_experts_and_kv_apart():
    model = MORE_FAMILIES["jetmoe"]()
    kinds = _kinds(_groups(model))
    for n in ("model.layers.0.mlp.router.layer.weight", "model.layers.0.self_attention.experts.router.layer.weight"):
        assert kinds[n] == ("router", False)
    assert kinds["model.layers.0.mlp.output_linear.weight"] == ("expert", True)
    with dist_harness.one_thread():
        before, grads, _ = _one_step(model)
    E, ff = 4, 16
    _check_blocks(model, before, grads, "model.layers.0.mlp.input_linear.weight",
                  [(e, rows) for e in range(E) for rows in (slice(0, ff), slice(ff, 2 * ff))])
    _check_blocks(model, before, grads, "model.layers.0.mlp.output_linear.weight", [(e,) for e in range(E)],
                  contrast=False)
    _check_blocks(model, before, grads, "model.layers.1.self_attention.kv_proj.weight", [slice(0, 16), slice(16, 32)])


# -- switches and overrides --------------------------------------------------------------------------
def test_split_fused_false_keeps_fused_weights_whole():
    model = MORE_FAMILIES["phi3"]()
    ds_muon.muon_param_groups(model, split_fused=False)
    assert ds_muon.engine.exchange.slots.logical_blocks(model.model.layers[0].self_attn.qkv_proj.weight, "w") == [("w", (64, 32), 0)]
    with pytest.raises(ValueError, match="split_fused"):
        ds_muon.muon_param_groups(MORE_FAMILIES["phi3"](), split_fused="no")


def test_split_attention_heads_on_hf_attention():
    model = FAMILIES["llama"]()
    opt = ds_muon.Muon(_groups(model, split_attention="heads"))
    keys = {s.key for b in opt.runtime.bindings.values() for s in b.matrices} if opt.runtime.bindings else set()
    blocks = ds_muon.engine.exchange.slots.logical_blocks(model.model.layers[0].self_attn.k_proj.weight, "k")
    assert [k for k, _, _ in blocks] == ["k[0]", "k[1]"] and blocks[0][1] == (8, 32), (blocks, keys)
    gpt2 = FAMILIES["gpt2"]()
    _groups(gpt2, split_attention="heads")
    assert len(ds_muon.engine.exchange.slots.logical_blocks(gpt2.transformer.h[0].attn.c_attn.weight, "c")) == 12


def test_exclude_include_globs_shown_in_summary():
    model = FAMILIES["llama"]()
    groups = _groups(model, exclude=["model.layers.0.mlp.*"], include=["model.norm.weight"])
    kinds = _kinds(groups)
    assert kinds["model.layers.0.mlp.down_proj.weight"] == ("hidden linear", False)
    with pytest.raises(ValueError, match="match no trainable parameter"):
        _groups(model, exclude=["nothing.*"])
    groups = _groups(FAMILIES["llama"](), exclude=["model.layers.0.mlp.*"])
    text = str(ds_muon.Muon(groups).summary())
    assert "exclude='model.layers.0.mlp.*'" in text


def test_frozen_hidden_matrices_train_embeddings_with_adamw_and_warn():
    model = FAMILIES["llama"]()
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith("model.layers"))
    with pytest.warns(UserWarning, match="every hidden matrix is frozen"):
        groups = ds_muon.muon_param_groups(model)
    assert [g["use_muon"] for g in groups] == [False]
    opt = ds_muon.Muon(groups)
    hf_loss(model, hf_batches(1)[0]).backward()
    before = model.model.embed_tokens.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.model.embed_tokens.weight)


# -- FSDP2 at W=2: the same blocks, bitwise ----------------------------------------------------------
FSDP_FAMILIES = ("gpt2", "gpt_neox", "gpt_oss", "phi3")


def _build(family):
    return (FAMILIES.get(family) or MORE_FAMILIES[family])()


def _layers(model):
    return model.transformer.h if hasattr(model, "transformer") else (
        model.gpt_neox.layers if hasattr(model, "gpt_neox") else model.model.layers)


def _train(model, opt):
    for idx in hf_batches(2):
        hf_loss(model, idx).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


# fused blocks a flat shard (FSDP1, ZeRO) cuts inside their runs: the rank holds each block's part in
# several strided views; W=2 against the replicated tensor
FLAT_CASES = {  # name: (shape, tag)
    "c_attn": ((8, 24), lambda p: ds_muon.fused_blocks(ds_muon.transposed(p), {w: (None, (8 * j, 8))
                                                                               for j, w in enumerate("qkv")})),
    "query_key_value": ((24, 8), lambda p: ds_muon.fused_blocks(p, {w: ((4 * j, 4, 2, 12), None)
                                                                    for j, w in enumerate("qkv")})),
}


def _flat_cut(rank, world):
    from ds_muon.engine.exchange.layout import ParamBinding
    from ds_muon.engine.exchange.slots import block_slots
    from models import HandAdapter

    out = {}
    g = torch.Generator().manual_seed(3)
    for name, (shape, tag) in FLAT_CASES.items():
        w0 = torch.randn(shape, generator=g)
        grads = [torch.randn(shape, generator=g) for _ in range(2)]
        numel = w0.numel()
        lo, hi = [(0, 77), (77, numel)][rank]  # 77: inside a run of every block
        rep = tag(nn.Parameter(w0.clone()))
        flat = nn.Parameter(w0.reshape(-1)[lo:hi].clone())
        flat._ds_muon_flat = True
        shaped = tag(torch.empty(shape, device="meta"))
        kw = dict(lr=LR, momentum=0.9, ns_dtype=torch.float32)
        o_rep = ds_muon.Muon([{"params": [rep], "param_names": [name]}], planner="locality", **kw)
        o_flat = ds_muon.Muon([{"params": [flat], "param_names": [name]}], adapter=HandAdapter(
            lambda p, n, context, shaped=shaped, lo=lo, hi=hi: ParamBinding(
                p, lambda t: t.reshape(-1), block_slots(shaped, n, lo, hi))), **kw)
        for grad in grads:
            rep.grad, flat.grad = grad.clone(), grad.reshape(-1)[lo:hi].clone()
            o_rep.step()
            o_flat.step()
        views = max(len(s.local_view or ()) for s in o_flat.runtime.bindings[id(flat)].matrices)
        out[name] = (rep.detach().clone(), (lo, hi), flat.detach().clone(), views)
    return out


def _fsdp2_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {"flat": _flat_cut(rank, world)}
    with dist_harness.one_thread():
        for family in FSDP_FAMILIES:
            model = _build(family)
            mesh = init_device_mesh("cpu", (world,))
            for layer in _layers(model):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = ds_muon.Muon(_groups(model), ns_dtype=torch.float32)
            _train(model, opt)
            blocks = sorted(s.key for b in opt.runtime.bindings.values() for s in b.matrices if "[" in s.key)
            out[family] = ({n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}, blocks)
    return out


def test_fsdp2_w2_equals_one_process_on_fused_blocks():
    """FSDP2 (Shard(0), whole head groups per rank) on GPT-2, GPT-NeoX, gpt-oss, Phi-3, and flat shards
    cutting fused blocks inside their runs, W=2, equal to one process bitwise."""
    results = dist_harness.run(_fsdp2_worker, 2, timeout=300)
    for name, (shape, _) in FLAT_CASES.items():
        full = torch.empty(shape).reshape(-1)
        for out in results:
            rep, (lo, hi), flat, views = out["flat"][name]
            full[lo:hi] = flat
            assert views > 1, (name, views)  # the cut block is held in several strided views
            assert torch.equal(rep, results[0]["flat"][name][0]), name
        assert torch.equal(full.view(shape), results[0]["flat"][name][0]), name
    for family in FSDP_FAMILIES:
        with dist_harness.one_thread():
            model = _build(family)
            opt = ds_muon.Muon(_groups(model), ns_dtype=torch.float32)
            _train(model, opt)
        want = dict(model.named_parameters())
        for out in results:
            got, blocks = out[family]
            assert blocks, family  # the fused weights were split under FSDP2 too
            for n, t in got.items():
                assert torch.equal(t, want[n].detach()), (family, n)
