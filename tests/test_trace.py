"""Issue 32: the decision read from what the forward does (ds_muon.models.trace), for models ds_muon had no
rule for and models without a config; per-block / per-expert updates against a hand Newton-Schulz reference
(blocks computed here from the model's own sizes, not from the trace); the wrapper cannot change the
decision; and the Muon sets of the families the rules already knew are what the rules alone give."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

import dist_harness
import ds_muon
from ds_muon.models.reading import classify
from ds_muon.models.trace import trace

sys.path.insert(0, os.path.dirname(__file__))
import trace_models as TM  # noqa: E402

LR = 0.02


def _groups(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ds_muon.muon_param_groups(model, lr=LR, **kw)


def _sets(groups):
    muon = {n for g in groups if g["use_muon"] for n in g["param_names"]}
    adam = {n for g in groups if not g["use_muon"] for n in g["param_names"]}
    return muon, adam


def _one_step(model, **kw):
    """One step, momentum 0 (the NS input is the gradient), from seeded random gradients."""
    opt = ds_muon.Muon(_groups(model, **kw), momentum=0.0, nesterov=False, ns_dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with dist_harness.one_thread():
        opt.step()
    return before


def _check_rows(w, w0, grad, blocks, close=False):
    """Each block (row indices of an [out, in] matrix) updated by ``-lr·scale·NS(grad rows)`` on its own."""
    for rows in blocks:
        idx = torch.tensor(rows)
        o = ds_muon.newton_schulz(grad[idx], dtype=torch.float32, method="auto")
        want = w0[idx].clone().add_(o, alpha=-LR * ds_muon.get_muon_scale_factor(len(rows), grad.shape[1]))
        got = w.detach()[idx]
        assert torch.allclose(got, want, atol=1e-6, rtol=0) if close else torch.equal(got, want), rows[:4]
    whole = w0 - LR * ds_muon.get_muon_scale_factor(*grad.shape) * ds_muon.newton_schulz(
        grad, dtype=torch.float32, method="auto")
    assert not torch.allclose(w.detach(), whole, atol=1e-4)  # one matrix would be another update


def _check_cols(w, w0, grad, blocks, close=False):
    """The same for column blocks of an [in, out] matrix (scale from [out, in]), each block's NS run in the
    orientation it is stored in, as the optimizer runs it: NS(Gᵀ) = NS(G)ᵀ in exact arithmetic, but an
    fp32 GEMM reading a transposed operand sums in another order on some CPUs (the Intel AMX box)."""
    for cols in blocks:
        idx = torch.tensor(cols)
        o = ds_muon.newton_schulz(grad[:, idx], dtype=torch.float32, method="auto")
        want = w0[:, idx].clone().add_(o, alpha=-LR * ds_muon.get_muon_scale_factor(len(cols), grad.shape[0]))
        got = w.detach()[:, idx]
        assert torch.allclose(got, want, atol=1e-6, rtol=0) if close else torch.equal(got, want), cols[:4]
    whole = w0 - LR * ds_muon.get_muon_scale_factor(grad.shape[1], grad.shape[0]) * ds_muon.newton_schulz(
        grad, dtype=torch.float32, method="auto")
    assert not torch.allclose(w.detach(), whole, atol=1e-4)  # one matrix would be another update


def _runs(start, length, count, period):
    return [start + i * period + j for i in range(count) for j in range(length)]


# -- families the rules had no layout for -------------------------------------------------------------------
def tiny_qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    c = Qwen3NextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16, shared_expert_intermediate_size=16,
                        layer_types=["linear_attention", "full_attention"])
    c._attn_implementation = "eager"
    return Qwen3NextForCausalLM(c)


def tiny_mamba():
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    return MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4))


def tiny_llama4():
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    c = Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=24, intermediate_size_mlp=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_local_experts=4)
    c._attn_implementation = "eager"
    return Llama4ForCausalLM(c)


def tiny_gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    c = GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2)
    c._attn_implementation = "eager"
    return GptOssForCausalLM(c)


def test_qwen3_next_in_proj_qkvz_and_ba_per_key_group_blocks():
    pytest.importorskip("transformers")
    model = tiny_qwen3_next()
    la = model.model.layers[0].linear_attn
    nk, nv, hk, hv = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim
    per = 2 * hk + 2 * hv * nv // nk  # one key-head group: [q | k | v | z]
    vz = hv * nv // nk
    qkvz = [_runs(0, hk, nk, per), _runs(hk, hk, nk, per), _runs(2 * hk, vz, nk, per), _runs(2 * hk + vz, vz, nk, per)]
    ba = [_runs(0, nv // nk, nk, 2 * nv // nk), _runs(nv // nk, nv // nk, nk, 2 * nv // nk)]
    before = _one_step(model)
    name = "model.layers.0.linear_attn."
    _check_rows(la.in_proj_qkvz.weight, before[name + "in_proj_qkvz.weight"], la.in_proj_qkvz.weight.grad, qkvz)
    _check_rows(la.in_proj_ba.weight, before[name + "in_proj_ba.weight"], la.in_proj_ba.weight.grad, ba)


def test_mamba_in_proj_x_and_z_and_x_proj_dt_b_c():
    pytest.importorskip("transformers")
    model = tiny_mamba()
    mixer = model.backbone.layers[0].mixer
    inner, rank, n = mixer.intermediate_size, mixer.time_step_rank, mixer.ssm_state_size
    before = _one_step(model)
    name = "backbone.layers.0.mixer."
    _check_rows(mixer.in_proj.weight, before[name + "in_proj.weight"], mixer.in_proj.weight.grad,
                [list(range(inner)), list(range(inner, 2 * inner))])  # chunk(2, dim=1): [x | z]
    _check_rows(mixer.x_proj.weight, before[name + "x_proj.weight"], mixer.x_proj.weight.grad,
                [list(range(rank)), list(range(rank, rank + n)), list(range(rank + n, rank + 2 * n))])


def _expert_cols(w, w0, grad, blocks_per_expert):
    for e in range(w.shape[0]):
        _check_cols(w[e], w0[e], grad[e], blocks_per_expert)


def test_llama4_text_expert_stacks_per_expert_with_gate_and_up_apart():
    pytest.importorskip("transformers")
    model = tiny_llama4()
    experts = model.model.layers[0].feed_forward.experts
    muon, _ = _sets(_groups(tiny_llama4()))
    assert {"model.layers.0.feed_forward.experts.gate_up_proj", "model.layers.0.feed_forward.experts.down_proj"} <= muon
    ff = experts.gate_up_proj.shape[-1] // 2  # [E, hidden, 2·ff], bmm(x, W).chunk(2, dim=-1)
    before = _one_step(model)
    name = "model.layers.0.feed_forward.experts."
    gu, down = experts.gate_up_proj, experts.down_proj
    for e in range(gu.shape[0]):
        _check_cols(gu[e], before[name + "gate_up_proj"][e], gu.grad[e], [list(range(ff)), list(range(ff, 2 * ff))])
        o = ds_muon.newton_schulz(down.grad[e], dtype=torch.float32, method="auto")  # [ff, hidden] stored [in, out]
        want = before[name + "down_proj"][e].clone().add_(
            o, alpha=-LR * ds_muon.get_muon_scale_factor(down.shape[2], down.shape[1]))
        assert torch.equal(down.detach()[e], want)


def test_gpt_oss_expert_stacks_even_and_odd_columns():
    pytest.importorskip("transformers")
    model = tiny_gpt_oss()
    experts = model.model.layers[0].mlp.experts
    ff = experts.gate_up_proj.shape[-1] // 2
    tr = trace(model)
    assert tr.uses["model.layers.0.mlp.experts.gate_up_proj"].blocks == [list(range(0, 2 * ff, 2)),
                                                                         list(range(1, 2 * ff, 2))]
    before = _one_step(model)
    gu = experts.gate_up_proj
    for e in range(gu.shape[0]):
        _check_cols(gu[e], before["model.layers.0.mlp.experts.gate_up_proj"][e], gu.grad[e],
                    [list(range(0, 2 * ff, 2)), list(range(1, 2 * ff, 2))])


# -- models without a config ---------------------------------------------------------------------------------
def test_resnet_stem_and_fc_on_adamw_convs_on_muon():
    model = TM.resnet18()
    muon, adam = _sets(_groups(model))
    assert {"conv1.weight", "fc.weight", "fc.bias"} <= adam
    assert {n for n, p in model.named_parameters() if p.ndim == 4 and n != "conv1.weight"} == muon
    backbone = TM.resnet_fpn_backbone()
    muon, adam = _sets(_groups(backbone))
    assert "body.conv1.weight" in adam and "fpn.inner_blocks.0.weight" in muon
    # the convs making the feature maps it returns (a dict) are its output layers (issue 40)
    assert {f"fpn.layer_blocks.{i}.weight" for i in range(4)} <= adam
    model = TM.resnet18()
    before = _one_step(model)  # a conv is one [out, in·kh·kw] matrix
    w = model.layer1[0].conv1.weight
    g2 = w.grad.reshape(w.shape[0], -1)
    want = before["layer1.0.conv1.weight"].reshape(w.shape[0], -1).clone().add_(
        ds_muon.newton_schulz(g2, dtype=torch.float32, method="auto"), alpha=-LR * ds_muon.get_muon_scale_factor(*g2.shape))
    assert torch.equal(w.detach().reshape(w.shape[0], -1), want)


def test_vit_patch_embed_and_head_on_adamw_qkv_in_thirds():
    model = TM.vit_tiny()
    muon, adam = _sets(_groups(model))
    assert {"patch_embed.proj.weight", "head.weight", "cls_token", "pos_embed"} <= adam
    assert "blocks.0.attn.qkv.weight" in muon and "blocks.0.mlp.fc1.weight" in muon
    before = _one_step(model)
    qkv = model.blocks[0].attn.qkv.weight
    d = qkv.shape[1]
    _check_rows(qkv, before["blocks.0.attn.qkv.weight"], qkv.grad,
                [list(range(0, d)), list(range(d, 2 * d)), list(range(2 * d, 3 * d))])


def test_demo_gpt_qkv_unbind_read_as_three_blocks():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
    import gpt

    model = gpt.GPT(vocab=64, d=32, layers=1, heads=4, seq=16)
    decided = {n: d for n, d in classify(model).values()}
    assert decided["lm_head.weight"].kind == "output head" and decided["lm_head.weight"].decided_by == "trace"
    assert decided["blocks.0.qkv.weight"].plan is not None and len(decided["blocks.0.qkv.weight"].plan.blocks) == 3


# -- the fallback, and reading never touching the model ------------------------------------------------------
class _NeedsTwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Linear(8, 8)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x, y):  # no guess can call this
        return self.b((self.a(self.stem(x)) + y).mean(1))


def test_untraceable_model_falls_back_with_one_warning_naming_the_tensors():
    model = _NeedsTwoInputs()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        groups = ds_muon.muon_param_groups(model)
    ours = [x for x in w if "not by the traced forward" in str(x.message)]
    assert len(ours) == 1 and "a.weight" in str(ours[0].message) and "b.weight" in str(ours[0].message)
    reasons = {n: r for g in groups for n, r in zip(g["param_names"], g["param_reasons"])}
    assert "not traced" in reasons["a.weight"]
    with warnings.catch_warnings(record=True) as w:  # the inputs given: read, no warning
        warnings.simplefilter("always")
        groups = ds_muon.muon_param_groups(model, example_inputs=(torch.zeros(2, 3, 8), torch.zeros(2, 3, 8)))
    assert not [x for x in w if "not by the traced forward" in str(x.message)]
    muon, adam = _sets(groups)
    # stem reads the input (an input layer, issue 49's one rule); b classifies pooled features: a head
    assert "a.weight" in muon and {"stem.weight", "b.weight"} <= adam


def test_last_layer_of_a_plain_stack_is_its_output_layer_without_a_config():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 8))
    muon, adam = _sets(_groups(model))
    assert muon == {"2.weight"} and {"0.weight", "4.weight"} <= adam  # issue 40 / 49: the output and input layers


def test_reading_leaves_the_model_untouched():
    model = TM.vit_tiny()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    devices = {p.device for p in model.parameters()}
    tr = trace(model)
    assert not tr.error and tr.uses
    assert {p.device for p in model.parameters()} == devices
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


# -- the families the rules knew: the same Muon sets and blocks as the rules alone -----------------------------
def _pinned():
    import hf_models as H

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
    import gpt

    return {"llama": H.tiny_llama, "gpt2": H.tiny_gpt2, "qwen2_moe": H.tiny_qwen2_moe, "mixtral": H.tiny_mixtral,
            "phi3": H.tiny_phi3, "gpt_neox": H.tiny_gpt_neox, "gpt": lambda: gpt.GPT(vocab=64, d=32, layers=2, heads=4,
                                                                                      seq=16)}


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2_moe", "mixtral", "phi3", "gpt_neox", "gpt"])
def test_known_families_muon_sets_equal_the_rules_alone(family):
    pytest.importorskip("transformers")
    build = _pinned()[family]
    traced, rules = _groups(build()), _groups(build(), trace=False)
    assert _sets(traced) == _sets(rules)
    kinds = {n: k for g in traced for n, k in zip(g["param_names"], g["param_kinds"])}
    old = {n: k for g in rules for n, k in zip(g["param_names"], g["param_kinds"])}
    changed = {n: (old[n], kinds[n]) for n in kinds if kinds[n] != old[n]}
    if family == "gpt":  # no config: the rules kept qkv whole; the forward's unbind(2) splits q|k|v
        assert set(changed) == {f"blocks.{i}.qkv.weight" for i in range(2)}, changed
    else:
        assert not changed
        reasons = {n: r for g in traced for n, r in zip(g["param_names"], g["param_reasons"])}
        assert not [n for n, r in reasons.items() if "not traced" in r]  # every matrix read from the forward
    if family != "gpt":  # the rules' fused blocks are the forward's splits
        rules_obj = ds_muon.models.evidence.Rules(build())
        classify(build(), rules_obj)
        assert not rules_obj.trace.error and not rules_obj.disagreements, rules_obj.disagreements


class _Irregular(torch.nn.Module):
    """Two splits of one output whose pieces cross into a block that is no evenly spaced run ({3, 5, 6, 7})."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(4, 8)

    def forward(self, idx):
        h = self.proj(self.emb(idx))
        a, b = h.split([3, 5], dim=-1)
        c, d = h.view(*h.shape[:-1], 2, 4).split([1, 3], dim=-1)
        parts = [t.flatten(2).sum(-1, keepdim=True) for t in (a, b, c, d)]
        return self.out(torch.cat(parts, dim=-1))


def test_a_split_no_stack_can_shard_raises_naming_the_tensor():
    with pytest.raises(NotImplementedError, match=r"proj\.weight .*not evenly spaced runs.*split_fused=False"):
        _groups(_Irregular())
    muon, _ = _sets(_groups(_Irregular(), split_fused=False))  # the way out the message names
    assert "proj.weight" in muon


# -- a model that returns its loss: the head is what the loss reads ---------------------------------------
LOSSES = {  # (prediction from logits, target) -> loss: F's own losses, each as a training script calls it
    "cross_entropy": lambda y, t: torch.nn.functional.cross_entropy(y.reshape(-1, y.size(-1)), t.reshape(-1)),
    "nll_loss": lambda y, t: torch.nn.functional.nll_loss(y.log_softmax(-1).flatten(0, 1), t.flatten()),
    "mse_loss": lambda y, t: torch.nn.functional.mse_loss(y, torch.nn.functional.one_hot(t, y.size(-1)).float()),
    "bce_with_logits": lambda y, t: torch.nn.functional.binary_cross_entropy_with_logits(
        y, torch.nn.functional.one_hot(t, y.size(-1)).float()),
    "kl_div": lambda y, t: torch.nn.functional.kl_div(
        y.log_softmax(-1), torch.nn.functional.one_hot(t, y.size(-1)).float(), reduction="batchmean"),
    "smooth_l1": lambda y, t: torch.nn.functional.smooth_l1_loss(y[..., 0], t.float()),
}
RETURNS = {  # how the forward hands its loss back
    "loss": lambda loss, aux: loss,
    "loss + aux": lambda loss, aux: loss + 1e-3 * aux,  # a load-balancing / regularising term beside it
    "(loss, aux)": lambda loss, aux: (loss, aux),
    "{'loss': loss + aux}": lambda loss, aux: {"loss": loss + 0.01 * aux},
}


class _LossNet(torch.nn.Module):
    """embed -> hidden blocks -> head -> a loss of the head's output; a side projection of the hidden
    stream makes an auxiliary term (its own output layer only where it is returned on its own)."""

    def __init__(self, loss, ret, vocab=16, d=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.up, self.down = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        self.side = torch.nn.Linear(d, d)
        self.out = torch.nn.Linear(d, vocab, bias=False)  # not a head name: only the forward says it is one
        self.loss, self.ret = loss, ret

    def forward(self, idx, targets):
        x = self.embed(idx)
        x = x + self.down(torch.relu(self.up(x)))
        aux = self.side(x).square().mean()
        return self.ret(self.loss(self.out(x), targets), aux)


@pytest.mark.parametrize("ret", list(RETURNS))
@pytest.mark.parametrize("loss", list(LOSSES))
def test_the_layer_a_returned_loss_reads_is_the_output_head(loss, ret):
    """A forward that returns its loss (loss alone, plus an auxiliary term, beside it, in a dict): the layer whose
    output the loss function reads is the output head (AdamW), whatever is added to the loss after it. Summed
    with an auxiliary term, the loss is no single weight's output (a residual sum's rule); before, the head went
    to Muon as a hidden matrix whenever an auxiliary term was added."""
    model = _LossNet(LOSSES[loss], RETURNS[ret])
    idx = torch.randint(0, 16, (2, 5))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        groups = ds_muon.muon_param_groups(model, example_inputs=(idx, idx))
    assert not [x for x in w if "not by the traced forward" in str(x.message)]
    muon, adam = _sets(groups)
    assert {"up.weight", "down.weight"} <= muon and {"out.weight", "embed.weight"} <= adam, (muon, adam)
    # the side projection is a head only where its output is returned on its own (the tuple)
    assert ("side.weight" in adam) == (ret == "(loss, aux)"), (muon, adam)


class _Training(torch.nn.Module):
    """A model under a training forward: its loss (``map_models.loss``, as the model's own tests train it) plus
    a term from a weight of the wrapper's own, a sum no single weight produced."""

    def __init__(self, name):
        super().__init__()
        import map_models

        self.name, self.model, self.probe = name, map_models.build(name), torch.nn.Linear(4, 4)
        self._loss = map_models.loss

    def forward(self, *args):
        *inputs, target = args
        aux = self.probe(torch.ones(1, 4, device=target.device)).square().mean()
        return self._loss(self.name, self.model, inputs, target) + 1e-3 * aux


@pytest.mark.parametrize("name", ["conv_classifier", "transposed_lm", "embedding_stack", "unet", "dit", "einsum_lm"])
def test_a_training_forward_decides_the_model_as_its_inference_forward(name):
    """Every config-less model of the map zoo read through a forward that returns its loss plus an auxiliary term:
    each of its tensors gets the decision its inference forward gives, and its output layer (named by the zoo,
    not by the trace) is on AdamW."""
    import map_models

    bare = _sets(_groups(map_models.build(name), example_inputs=map_models.example_inputs(name)))
    args, target = map_models.batch(name, n=1)
    wrapped = _sets(_groups(_Training(name), example_inputs=(*args, target)))
    inner = tuple({n[len("model."):] for n in s if n.startswith("model.")} for s in wrapped)
    assert inner == bare, (inner, bare)
    assert map_models.OUTPUT_LAYERS[name] in inner[1]
