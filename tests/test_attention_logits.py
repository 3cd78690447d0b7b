"""LogitRecorder: S_max per query head recorded through transformers' attention registry.

The reference is written here from the attention's definition: q and k from the module's own projections
(rotary applied by hand with the cos/sin the module receives), scores q·kᵀ·scaling in fp32, allowed where
the key is not padding, not in the future and (sliding window) ``i - j < W``; S_max = max per head.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from ds_muon.models.attention_logits import PREFIX, LogitRecorder  # noqa: E402

VOCAB, SEQ = 64, 12


def _llama(seed=0, **over):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=4 * SEQ, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**kw, **over}))


def _qwen2(seed=0, **over):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4 * SEQ, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**{**kw, **over}))


def _mistral(seed=0, **over):
    from transformers import MistralConfig, MistralForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=4 * SEQ, sliding_window=5,
              tie_word_embeddings=False)
    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(**{**kw, **over}))


def _gemma2(seed=0, **over):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # soft-capped logits (cap 0.05, below the largest logits of this init), a query_pre_attn_scalar scaling, and layers
    # alternating sliding-window (5) and full attention
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12, sliding_window=5,
              attn_logit_softcapping=0.05, max_position_embeddings=4 * SEQ)
    torch.manual_seed(seed)
    return Gemma2ForCausalLM(Gemma2Config(**{**kw, **over}))


def _deepseek_v3(seed=0, **over):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # MLA: low-rank q (q_lora_rank) and kv, per-head q/k parts of 8 without rotary and 4 with it
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
              n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, rope_interleave=False,
              max_position_embeddings=4 * SEQ, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(DeepseekV3Config(**{**kw, **over}))


MLA = {"deepseek_v3_mla": _deepseek_v3}

FAMILIES = {
    "gemma2_softcap": _gemma2,
    "llama": _llama,
    "llama_gqa": lambda seed=0: _llama(seed, num_attention_heads=8, num_key_value_heads=2),
    "qwen2": _qwen2,
    "mistral_window": _mistral,
}


def _model(family, impl, inflate=4.0, seed=0):
    """A tiny model whose query weights are inflated, so the logits are large and the mask matters."""
    model = {**FAMILIES, **MLA}[family](seed)
    model.set_attn_implementation(impl)
    with torch.no_grad():
        for module in model.modules():
            q = getattr(module, "q_proj", None) or getattr(module, "q_b_proj", None)
            if isinstance(q, torch.nn.Linear) and hasattr(module, "o_proj"):
                q.weight.mul_(inflate)
    return model


def _batch(seed=0, batch=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    mask[1, :3] = 0   # left padding
    mask[2, -4:] = 0  # right padding
    return ids, mask


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _capture_inputs(model):
    """Each attention module's hidden_states and (cos, sin), as it receives them."""
    seen, handles = {}, []
    for name, module in model.named_modules():
        if hasattr(module, "o_proj") and hasattr(module, "config"):
            def hook(mod, args, kwargs, name=name):
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                seen.setdefault(name, []).append((hidden.detach(), kwargs["position_embeddings"]))
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


def _reference(model, seen, pad_mask, apply_mask=True):
    """S_max per head written from the definition (fp32)."""
    config = model.config
    out = {}
    for name, calls in seen.items():
        module = model.get_submodule(name)
        hq, hkv = config.num_attention_heads, config.num_key_value_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // hq
        scaling = getattr(config, "query_pre_attn_scalar", None) or dim  # Gemma 2 scales by its own scalar
        window = module.sliding_window if hasattr(module, "sliding_window") else getattr(config, "sliding_window", None)
        best = torch.full((hq,), float("-inf"))
        for hidden, (cos, sin) in calls:
            b, length, _ = hidden.shape
            with torch.no_grad():
                q = module.q_proj(hidden).float().view(b, length, hq, dim).transpose(1, 2)
                k = module.k_proj(hidden).float().view(b, length, hkv, dim).transpose(1, 2)
            cos, sin = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            k = k.repeat_interleave(hq // hkv, dim=1)  # query head h reads key head h // groups
            scores = q @ k.transpose(-1, -2) * scaling ** -0.5  # before any soft-cap
            if apply_mask:
                i = torch.arange(length)[:, None]
                j = torch.arange(length)[None, :]
                allowed = (j <= i) & pad_mask.bool()[:, None, None, :]
                if window is not None:
                    allowed = allowed & (i - j < window)
                scores = scores.masked_fill(~allowed, float("-inf"))
            best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
        out[name] = best
    return out


def _loss_and_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("family,impl", [("llama_gqa", "eager"), ("llama_gqa", "sdpa"), ("mistral_window", "eager"),
                                         ("mistral_window", "sdpa"), ("gemma2_softcap", "eager"),
                                         ("deepseek_v3_mla", "eager"), ("deepseek_v3_mla", "sdpa")])
def test_outputs_bitwise_unchanged(family, impl):
    model = _model(family, impl)
    ids, mask = _batch()
    off = _loss_and_grads(model, ids, mask)
    recorder = LogitRecorder(model)
    assert model.config._attn_implementation == PREFIX + impl
    on = _loss_and_grads(model, ids, mask)
    assert torch.isfinite(torch.stack(list(recorder.maxima().values()))).all()
    recorder.remove()
    assert model.config._attn_implementation == impl
    again = _loss_and_grads(model, ids, mask)
    for a, b, c in ((off[0], on[0], again[0]), (off[1], on[1], again[1])):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert all(torch.equal(a, b) for a, b in zip(off[2], on[2]))


def _families_and_impls():
    for family in sorted(FAMILIES):
        for impl in ("eager", "sdpa"):
            if not (family.startswith("gemma2") and impl == "sdpa"):  # SDPA refuses soft-capping
                yield family, impl


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "no_mask"])
@pytest.mark.parametrize("family,impl", list(_families_and_impls()))
def test_maxima_equal_reference(family, impl, padded):
    """Padded batches, and batches with no mask given (SDPA then gets none and relies on is_causal)."""
    model = _model(family, impl)
    ids, mask = _batch()
    if not padded:
        mask = torch.ones_like(mask)
    recorder = LogitRecorder(model)
    seen, handles = _capture_inputs(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask if padded else None)
    for h in handles:
        h.remove()
    got = recorder.maxima()
    want = _reference(model, seen, mask)
    unmasked = _reference(model, seen, mask, apply_mask=False)
    assert list(got) == list(want) and len(got) == model.config.num_hidden_layers
    # the test can tell a recorder that ignores the mask from one that reads it
    assert any(not torch.allclose(want[n], unmasked[n]) for n in want)
    cap = getattr(model.config, "attn_logit_softcapping", None)
    if cap is not None:  # the logit before the cap is recorded
        assert max(m.max() for m in got.values()) > cap
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
        assert recorder.heads(name) == (model.config.num_attention_heads, model.config.num_key_value_heads,
                                        model.get_submodule(name).head_dim)
    recorder.remove()


def _mla_reference(model, seen, pad_mask):
    """DeepSeek-V3 MLA, from its projections: q·k = q_nope·k_nope + q_rope·k_rope, the rotary key shared by heads."""
    config = model.config
    heads, nope, rope = config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim
    out = {}
    for name, calls in seen.items():
        module = model.get_submodule(name)
        best = torch.full((heads,), float("-inf"))
        for hidden, (cos, sin) in calls:
            b, length, _ = hidden.shape
            with torch.no_grad():
                q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden))).float()
                q = q.view(b, length, heads, nope + rope).transpose(1, 2)
                latent, k_rope = module.kv_a_proj_with_mqa(hidden).split([config.kv_lora_rank, rope], dim=-1)
                kv = module.kv_b_proj(module.kv_a_layernorm(latent)).float()
                k_nope = kv.view(b, length, heads, nope + config.v_head_dim).transpose(1, 2)[..., :nope]
            q_nope, q_rope = q[..., :nope], q[..., nope:]
            k_rope = k_rope.float().view(b, 1, length, rope)
            cos, sin = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
            q_rope = q_rope * cos + _rotate_half(q_rope) * sin
            k_rope = k_rope * cos + _rotate_half(k_rope) * sin
            scores = (q_nope @ k_nope.transpose(-1, -2) + q_rope @ k_rope.transpose(-1, -2)) * (nope + rope) ** -0.5
            i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
            allowed = (j <= i) & pad_mask.bool()[:, None, None, :]
            best = torch.maximum(best, scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3)))
        out[name] = best
    return out


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_mla_maxima_equal_reference(impl):
    model = _model("deepseek_v3_mla", impl)
    ids, mask = _batch()
    recorder = LogitRecorder(model)
    seen, handles = _capture_inputs(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in handles:
        h.remove()
    got, want = recorder.maxima(), _mla_reference(model, seen, mask)
    assert list(got) == list(want) and len(got) == 2
    for name in want:
        assert model.get_submodule(name).scaling == 12 ** -0.5  # no YaRN mscale in this config
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
        assert recorder.heads(name) == (4, 4, 12)
    recorder.remove()


def test_max_over_batches_reset_and_chunks():
    model = _model("llama_gqa", "sdpa")
    (ids_a, mask_a), (ids_b, mask_b) = _batch(1), _batch(2)
    recorder = LogitRecorder(model, chunk_elements=1)  # one query row per chunk
    assert all(torch.equal(m, torch.full((8,), float("-inf"))) for m in recorder.maxima().values())
    seen, handles = _capture_inputs(model)
    with torch.no_grad():
        model(input_ids=ids_a, attention_mask=mask_a)
        first = _reference(model, seen, mask_a)
        seen.clear()
        model(input_ids=ids_b, attention_mask=mask_b)
        second = _reference(model, seen, mask_b)
    for h in handles:
        h.remove()
    for name, got in recorder.maxima().items():
        torch.testing.assert_close(got, torch.maximum(first[name], second[name]), rtol=1e-5, atol=1e-5)
    recorder.reset()
    assert all(torch.isneginf(m).all() for m in recorder.maxima().values())
    recorder.remove()


# a row costs B·H·L = 3·8·12 logits
@pytest.mark.parametrize("chunk_elements", [1, 4 * (3 * 8 * 12), 1 << 24], ids=["row", "4_rows", "whole"])
def test_maskless_causal_blocks(chunk_elements):
    """SDPA with no mask: rows in blocks, each scored only against the keys up to its last row."""
    model = _model("llama_gqa", "sdpa")
    ids, mask = _batch()
    recorder = LogitRecorder(model, chunk_elements=chunk_elements)
    seen, handles = _capture_inputs(model)
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    want = _reference(model, seen, torch.ones_like(mask))
    for name, got in recorder.maxima().items():
        torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-5)
    recorder.remove()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gradient_checkpointing_records_the_same(impl):
    ids, mask = _batch()
    results = []
    for checkpointing in (False, True):
        model = _model("llama_gqa", impl)
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable()
        recorder = LogitRecorder(model)
        calls, record = [], recorder._record
        recorder._record = lambda name, *a: (calls.append(name), record(name, *a))
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        after_forward = recorder.maxima()
        loss.backward()  # checkpointing runs every attention forward a second time here
        assert len(calls) == model.config.num_hidden_layers * (2 if checkpointing else 1)
        results.append((after_forward, recorder.maxima(), loss.detach()))
        recorder.remove()
    (fwd_plain, plain, loss_plain), (fwd_ckpt, ckpt, loss_ckpt) = results
    assert torch.equal(loss_plain, loss_ckpt)
    for name in plain:
        assert torch.equal(plain[name], ckpt[name])
        assert torch.equal(fwd_ckpt[name], ckpt[name])


def test_install_is_idempotent_and_remove_restores():
    model = _model("llama", "eager")
    recorder = LogitRecorder(model)
    assert LogitRecorder(model) is recorder
    ids, mask = _batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    recorded = recorder.maxima()
    recorder.remove()
    recorder.remove()  # twice is harmless
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask * 0 + 1)
    assert all(torch.equal(recorded[n], m) for n, m in recorder.maxima().items())
    fresh = LogitRecorder(model)
    assert fresh is not recorder and all(torch.isneginf(m).all() for m in fresh.maxima().values())
    fresh.remove()


@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention", "paged|eager"])
def test_other_implementations_refused_before_any_change(impl):
    model = _model("llama", "eager")
    model.config._attn_implementation_internal = impl
    with pytest.raises(ValueError, match="model.layers.0.self_attn.*set_attn_implementation"):
        LogitRecorder(model)
    assert model.config._attn_implementation == impl


def test_model_without_attention_refused():
    with pytest.raises(ValueError, match="no attention module"):
        LogitRecorder(torch.nn.Sequential(torch.nn.Linear(4, 4)))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_bf16_model_outputs_unchanged_and_maxima_in_fp32(impl):
    ids, mask = _batch()
    fp32 = _model("llama_gqa", impl)
    reference = LogitRecorder(fp32)
    with torch.no_grad():
        fp32(input_ids=ids, attention_mask=mask)
    model = _model("llama_gqa", impl).to(torch.bfloat16)
    with torch.no_grad():
        off = model(input_ids=ids, attention_mask=mask).logits
        recorder = LogitRecorder(model)
        on = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(off, on)
    for name, got in recorder.maxima().items():
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, reference.maxima()[name], rtol=3e-2, atol=1e-2)  # bf16 q/k vs fp32 q/k
    recorder.remove()
    reference.remove()


def test_two_models_record_apart():
    one, two = _model("llama", "sdpa", seed=0), _model("llama", "sdpa", seed=1)
    rec_one, rec_two = LogitRecorder(one), LogitRecorder(two)
    ids, mask = _batch()
    with torch.no_grad():
        one(input_ids=ids, attention_mask=mask)
    assert all(torch.isfinite(m).all() for m in rec_one.maxima().values())
    assert all(torch.isneginf(m).all() for m in rec_two.maxima().values())
    rec_one.remove()
    with torch.no_grad():
        two(input_ids=ids, attention_mask=mask)
    assert all(torch.isfinite(m).all() for m in rec_two.maxima().values())
    rec_two.remove()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_copies_of_a_recorded_model_run_unrecorded(impl):
    """A deepcopy (a reference model, an EMA copy) keeps the wrapper's name in its config: it runs its own
    attention, bitwise, and leaves the recorder's maxima alone."""
    import copy

    model = _model("llama_gqa", impl)
    recorder = LogitRecorder(model)
    clone = copy.deepcopy(model)
    ids, mask = _batch()
    with torch.no_grad():
        mine = model(input_ids=ids, attention_mask=mask).logits
        recorded = recorder.maxima()
        theirs = clone(input_ids=ids * 0 + 1, attention_mask=mask).logits  # other tokens: other logits
        again = clone(input_ids=ids, attention_mask=mask).logits
    assert clone.config._attn_implementation == PREFIX + impl
    assert torch.equal(mine, again) and not torch.equal(mine, theirs)
    assert all(torch.equal(recorded[n], m) for n, m in recorder.maxima().items())
    recorder.remove()
    with torch.no_grad():
        assert torch.equal(clone(input_ids=ids, attention_mask=mask).logits, mine)


def test_installed_on_meta_then_materialized():
    """Meta-device init (as before FSDP2's to_empty): the buffers follow the first recorded call's device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    recorder = LogitRecorder(model)
    assert all(m.is_meta for m in recorder.maxima().values())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
        rotary, theta = model.model.rotary_emb, config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / theta ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)  # head_dim 8
        for buffer in ("inv_freq", "original_inv_freq"):
            if isinstance(getattr(rotary, buffer, None), torch.Tensor):
                getattr(rotary, buffer).copy_(inv_freq)
    ids, mask = _batch()
    seen, handles = _capture_inputs(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in handles:
        h.remove()
    want = _reference(model, seen, mask)
    for name, got in recorder.maxima().items():
        assert got.device.type == "cpu"
        torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-5)
    recorder.remove()


def test_heads_unlike_the_config_raise():
    """A module seeing other head counts than its config (tensor-parallel heads) is refused, not misread."""
    model = _model("llama_gqa", "sdpa")
    recorder = LogitRecorder(model)
    with pytest.raises(KeyError, match="not a recorded attention module"):
        recorder.heads("model.layers.0")
    recorder._heads["model.layers.0.self_attn"] = (4, 2, 4)  # as if the config said 4 heads of 4
    ids, mask = _batch()
    with pytest.raises(RuntimeError, match="model.layers.0.self_attn.*tensor-parallel"):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    recorder.remove()


def test_generated_configs_masks_and_chunks():
    """A seeded generator over the class of inputs: head layouts (MHA, GQA 2 and 4, MQA), head dims, batch and
    sequence lengths (one token included), padding anywhere, sliding windows, both implementations, chunk
    sizes; every recorded max equals the reference."""
    gen = torch.Generator().manual_seed(28)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]  # noqa: E731
    for case in range(12):
        kv_heads, groups, head_dim = pick([1, 2]), pick([1, 2, 4]), pick([4, 8])
        heads = kv_heads * groups
        window = pick([None, None, 3])
        builder = _mistral if window else _llama
        model = builder(case, hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        head_dim=head_dim, **({"sliding_window": window} if window else {}))
        impl = pick(["eager", "sdpa"])
        model.set_attn_implementation(impl)
        batch, length = pick([1, 2, 3]), pick([1, 2, 5, 9])
        ids = torch.randint(0, VOCAB, (batch, length), generator=gen)
        mask = (torch.rand(batch, length, generator=gen) > 0.3).long()
        mask[:, -1] = 1
        padded = pick([True, False])
        if not padded:
            mask = torch.ones_like(mask)
        recorder = LogitRecorder(model, chunk_elements=pick([1, 37, 1 << 24]))
        seen, handles = _capture_inputs(model)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask if padded else None)
        for h in handles:
            h.remove()
        want = _reference(model, seen, mask)
        for name, got in recorder.maxima().items():
            torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"case {case} ({impl}, {heads}/{kv_heads} heads, window "
                                                     f"{window}, {batch}x{length}, padded {padded}): {m}")
        recorder.remove()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_generate_unchanged_and_decoding_recorded(impl):
    """Greedy generation with a KV cache (one-token queries against every cached key) gives the same tokens;
    decoding steps add to the prefill's maxima."""
    model = _model("llama_gqa", impl).eval()
    ids = _batch()[0][:1]
    ones = torch.ones_like(ids)  # (else generate takes the tokens equal to pad_token_id for padding)
    plain = model.generate(input_ids=ids, attention_mask=ones, max_new_tokens=4, do_sample=False, pad_token_id=0)
    recorder = LogitRecorder(model)
    with torch.no_grad():
        model(input_ids=ids)
    prefill = recorder.maxima()
    recorder.reset()
    recorded = model.generate(input_ids=ids, attention_mask=ones, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(plain, recorded)
    for name, got in recorder.maxima().items():
        assert torch.all(got >= prefill[name])
    recorder.remove()


def _fsdp2_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ids, mask = _batch(seed=rank)  # each rank its own batch: its own maxima (QK-clip reduces them)
    single = _model("llama_gqa", "sdpa")
    single_recorder = LogitRecorder(single)
    with torch.no_grad():
        single(input_ids=ids, attention_mask=mask)
    model = _model("llama_gqa", "sdpa")
    recorder = LogitRecorder(model)  # installed before sharding, as QKClip does
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer.self_attn, mesh=mesh)  # the attention module's class becomes FSDPLlamaAttention
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    got, want = recorder.maxima(), single_recorder.maxima()
    return (type(model.model.layers[0].self_attn).__name__, list(got) == list(want),
            all(torch.equal(got[n], want[n]) for n in want))


def test_fsdp2_sharded_attention_records_each_ranks_batch():
    """FSDP2 at W=2 (attention modules sharded themselves): each rank's maxima equal a single process on its batch."""
    import dist_harness

    for cls, same_names, same in dist_harness.run(_fsdp2_worker, 2, timeout=240):
        assert cls.startswith("FSDP") and same_names and same


def test_meta_forward_and_autocast():
    """A forward on the meta device (shape tracing) runs through the recorder; under CPU autocast (bf16) the
    recorded maxima are still fp32 products of the q and k the implementation got (autocast would round the
    product to bf16, ~1e-3 relative)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    recorder = LogitRecorder(model)
    out = model(input_ids=torch.zeros(2, 5, dtype=torch.long, device="meta"))
    assert out.logits.is_meta
    recorder.remove()

    model = _model("llama_gqa", "sdpa")
    recorder = LogitRecorder(model)
    seen_qk, record = [], recorder._record
    recorder._record = lambda name, impl, module, q, k, *a: (seen_qk.append((q.clone(), k.clone())),
                                                             record(name, impl, module, q, k, *a))
    ids, mask = _batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, attention_mask=mask)
    q, k = seen_qk[0]  # from bf16 projections
    k = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q.float() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    i, j = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    allowed = (j <= i) & mask.bool()[:, None, None, :]
    want = scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))
    got = recorder.maxima()["model.layers.0.self_attn"]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # fp32 maths on bf16 inputs: no bf16 rounding
    recorder.remove()
