"""Hugging Face ``transformers`` models from tiny configs built in code (no downloads).

Each builder seeds torch and returns a fresh model, so a sharded run and its
single-process reference start from the same weights.  ``FAMILIES`` maps a short
name to its builder; :func:`hf_batches` makes token batches and :func:`hf_loss`
the causal-LM loss the models compute themselves.
"""

from __future__ import annotations

import torch

VOCAB = 64
SEQ = 16


def _build(config_cls, model_cls, seed: int, **kw):
    torch.manual_seed(seed)
    config = config_cls(**kw)
    config._attn_implementation = "eager"  # the same kernels in every process
    return model_cls(config)


def tiny_llama(seed: int = 0, **over):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2 * SEQ, tie_word_embeddings=False)
    return _build(LlamaConfig, LlamaForCausalLM, seed, **{**kw, **over})


def tiny_gpt2(seed: int = 0, **over):
    from transformers import GPT2Config, GPT2LMHeadModel

    kw = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=2 * SEQ, bos_token_id=0, eos_token_id=0)
    return _build(GPT2Config, GPT2LMHeadModel, seed, **{**kw, **over})


def tiny_qwen2_moe(seed: int = 0, **over):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts=4, num_experts_per_tok=2, max_position_embeddings=2 * SEQ)
    return _build(Qwen2MoeConfig, Qwen2MoeForCausalLM, seed, **{**kw, **over})


def tiny_mixtral(seed: int = 0, **over):
    from transformers import MixtralConfig, MixtralForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=2 * SEQ)
    return _build(MixtralConfig, MixtralForCausalLM, seed, **{**kw, **over})


FAMILIES = {"llama": tiny_llama, "gpt2": tiny_gpt2, "qwen2_moe": tiny_qwen2_moe, "mixtral": tiny_mixtral}


def hf_batches(n: int, batch: int = 4, seq: int = SEQ, seed: int = 0):
    """``n`` deterministic ``[batch, seq]`` token batches with a learnable pattern."""
    from models import batches

    return batches(n, batch=batch, seq=seq, vocab=VOCAB, seed=seed)


def hf_loss(model, idx):
    """The model's own causal-LM loss (labels = inputs, shifted inside the model)."""
    return model(input_ids=idx, labels=idx).loss
