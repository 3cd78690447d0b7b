"""Issue 40: the inputs of the traced forward found the way a person would (ds_muon.models.inputs): from the
forward's signature and the config beside it, each candidate tried on a meta copy and corrected from what
the layer that consumed it wanted, before the old guess from the first registered module."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from torch import nn

import ds_muon
from ds_muon.models.inputs import default_inputs
from ds_muon.models.trace import trace

sys.path.insert(0, os.path.dirname(__file__))
from test_trace import LR, _check_rows, _one_step, _sets, _groups  # noqa: E402


def _matrices(model):
    return {n for n, p in model.named_parameters() if p.ndim >= 2}


# -- litgpt: forward(idx), and lm_head registered before transformer.wte --------------------------------------
@pytest.mark.parametrize("groups", [4, 2, 1])  # multi-head, grouped-query, multi-query
def test_litgpt_gpt_ids_found_and_qkv_split_as_its_forward_splits(groups):
    litgpt = pytest.importorskip("litgpt")
    torch.manual_seed(0)
    cfg = litgpt.Config(n_layer=1, n_embd=32, n_head=4, n_query_groups=groups, head_size=8, vocab_size=64,
                        padded_vocab_size=64, block_size=32, intermediate_size=48, bias=False,
                        mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm")
    model = litgpt.GPT(cfg)
    assert next(iter(model.named_children()))[0] == "lm_head"  # what the first-module guess read
    t = trace(model)
    assert not t.error and "idx (ids)" in t.inputs, (t.error, t.inputs)
    q, kv = cfg.n_head * cfg.head_size, groups * cfg.head_size  # litgpt splits (q, k, v) along the output
    want = [list(range(0, q)), list(range(q, q + kv)), list(range(q + kv, q + 2 * kv))]
    assert t.uses["transformer.h.0.attn.qkv.weight"].blocks == want
    muon, adam = _sets(_groups(model))  # no example_inputs: the same reading
    assert {"lm_head.weight", "transformer.wte.weight"} <= adam
    assert "transformer.h.0.attn.qkv.weight" in muon
    before = _one_step(model)
    w = model.transformer.h[0].attn.qkv.weight
    _check_rows(w, before["transformer.h.0.attn.qkv.weight"], w.grad, want)


# -- diffusers: sample/hidden_states, timestep, encoder_hidden_states, added_cond_kwargs, class labels --------
def _traced_whole(model):
    t = trace(model)
    assert not t.error, (t.error, t.inputs)
    assert _matrices(model) <= {n for n, u in t.uses.items() if u.ops}, _matrices(model) - set(t.uses)
    return t


def test_diffusers_unet2d_condition_traced_without_example_inputs():
    diffusers = pytest.importorskip("diffusers")
    kw = dict(block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
              up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=24, layers_per_block=1,
              norm_num_groups=8, sample_size=16, attention_head_dim=8, in_channels=5)
    t = _traced_whole(diffusers.UNet2DConditionModel(**kw))
    assert "sample (1x5x16x16)" in t.inputs and "encoder_hidden_states (1x8x24)" in t.inputs, t.inputs
    assert t.uses["conv_in.weight"].input_layer
    # SDXL's conditioning: text embeds and six time ids in added_cond_kwargs, sized from the config
    sdxl = diffusers.UNet2DConditionModel(**kw, addition_embed_type="text_time", addition_time_embed_dim=8,
                                          projection_class_embeddings_input_dim=8 * 6 + 24)
    t = _traced_whole(sdxl)
    assert "add_embedding.linear_1.weight" in t.uses
    # a ControlNet's conditioning image: pixels of conditioning_channels, 8x the latent's side
    kw.pop("up_block_types"), kw.pop("sample_size")
    t = _traced_whole(diffusers.ControlNetModel(**kw, conditioning_embedding_out_channels=(8, 16, 32, 32)))
    assert "controlnet_cond (1x3x128x128)" in t.inputs, t.inputs


@pytest.mark.parametrize("name", ["DiTTransformer2DModel", "PixArtTransformer2DModel"])
def test_diffusers_diffusion_transformers_traced_without_example_inputs(name):
    diffusers = pytest.importorskip("diffusers")
    cls = getattr(diffusers, name)
    kw = dict(num_layers=1, num_attention_heads=2, attention_head_dim=8, in_channels=4, sample_size=8)
    if name == "PixArtTransformer2DModel":  # sample_size 128: PixArt's resolution/aspect-ratio conditions
        kw.update(sample_size=128, attention_head_dim=12, cross_attention_dim=24, caption_channels=24, out_channels=8)
    t = _traced_whole(cls(**kw))
    assert t.uses["pos_embed.proj.weight"].input_layer, t.inputs
    if name == "DiTTransformer2DModel":
        assert "class_labels (ids)" in t.inputs
    else:
        assert "added_cond_kwargs" in t.inputs and "encoder_hidden_states (1x8x24)" in t.inputs


# -- user models: the head registered first -------------------------------------------------------------------
class HeadFirstLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 50, bias=False)
        self.emb = nn.Embedding(50, 16)
        self.mid = nn.Linear(16, 16)

    def forward(self, x):
        return self.head(torch.relu(self.mid(self.emb(x))))


class HeadFirstConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 10)
        self.hidden = nn.Linear(12, 24)
        self.stem = nn.Conv3d(2, 12, 3)

    def forward(self, volumes):
        return self.fc(torch.relu(self.hidden(self.stem(volumes).mean((2, 3, 4)))))


@pytest.mark.parametrize("cls", [HeadFirstLM, HeadFirstConvNet])
def test_user_model_whose_first_module_is_the_head(cls):
    model = cls()
    first = next(iter(model.children()))
    t = trace(model)
    assert not t.error, t.error
    assert "2 forwards tried" in t.inputs, t.inputs  # the first-module guess ran first and was corrected
    args, kwargs, _ = default_inputs(model)
    if cls is HeadFirstLM:
        assert args[0].dtype == torch.long
    else:
        assert tuple(args[0].shape[:2]) == (1, 2) and args[0].ndim == 5  # the Conv3d stem's channels and rank
    head = f"{next(n for n, m in model.named_children() if m is first)}.weight"
    assert t.uses[head].matrix and t.uses[head].head  # read as what it is: the layer making the output
    if cls is HeadFirstLM:
        assert t.uses["emb.weight"].ops == {"embedding"} and t.uses["mid.weight"].matrix
    else:
        assert t.uses["stem.weight"].input_layer and t.uses["hidden.weight"].matrix
    muon, adam = _sets(_groups(model))
    assert ("emb.weight" if cls is HeadFirstLM else "stem.weight") in adam


def test_forward_nobody_can_feed_falls_back_with_the_warning():
    class NeedsCallable(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x, mixer):
            return self.b(mixer(self.a(x)))

    model = NeedsCallable()
    t = trace(model)
    assert t.error and "guessed from the first layer" in t.inputs and "mixer" in t.inputs, (t.error, t.inputs)
    with pytest.warns(UserWarning, match="example_inputs="):
        ds_muon.muon_param_groups(model, lr=LR)
