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


# -- families whose tensors are not all Linear weights (issue 24: decided from what a module does) --------
def tiny_phi3(seed: int = 0, **over):
    from transformers import Phi3Config, Phi3ForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2 * SEQ, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return _build(Phi3Config, Phi3ForCausalLM, seed, **{**kw, **over})


def tiny_gpt_neox(seed: int = 0, **over):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=2 * SEQ, bos_token_id=0, eos_token_id=0)
    return _build(GPTNeoXConfig, GPTNeoXForCausalLM, seed, **{**kw, **over})


def tiny_gpt_oss(seed: int = 0, **over):
    from transformers import GptOssConfig, GptOssForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
              max_position_embeddings=2 * SEQ, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return _build(GptOssConfig, GptOssForCausalLM, seed, **{**kw, **over})


def tiny_dbrx(seed: int = 0, **over):
    from transformers import DbrxConfig, DbrxForCausalLM

    kw = dict(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=2 * SEQ, pad_token_id=0,
              attn_config=dict(kv_n_heads=2, rope_theta=10000.0), bos_token_id=0, eos_token_id=0,
              ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2))
    return _build(DbrxConfig, DbrxForCausalLM, seed, **{**kw, **over})


def tiny_jetmoe(seed: int = 0, **over):
    from transformers import JetMoeConfig, JetMoeForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
              intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=2 * SEQ,
              bos_token_id=0, eos_token_id=0)
    return _build(JetMoeConfig, JetMoeForCausalLM, seed, **{**kw, **over})


def tiny_mamba(seed: int = 0, **over):
    from transformers import MambaConfig, MambaForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
              bos_token_id=0, eos_token_id=0, pad_token_id=0, use_mambapy=False)
    return _build(MambaConfig, MambaForCausalLM, seed, **{**kw, **over})


def tiny_jamba(seed: int = 0, **over):
    from transformers import JambaConfig, JambaForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
              expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
              mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False, max_position_embeddings=2 * SEQ,
              pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return _build(JambaConfig, JambaForCausalLM, seed, **{**kw, **over})


def tiny_resnet(seed: int = 0, **over):
    from transformers import ResNetConfig, ResNetForImageClassification

    kw = dict(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    return _build(ResNetConfig, ResNetForImageClassification, seed, **{**kw, **over})


def tiny_vit(seed: int = 0, **over):
    from transformers import ViTConfig, ViTForImageClassification

    kw = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48, image_size=16,
              patch_size=4, num_labels=3)
    return _build(ViTConfig, ViTForImageClassification, seed, **{**kw, **over})


MORE_FAMILIES = {"phi3": tiny_phi3, "gpt_neox": tiny_gpt_neox, "gpt_oss": tiny_gpt_oss, "dbrx": tiny_dbrx,
                 "jetmoe": tiny_jetmoe, "mamba": tiny_mamba, "jamba": tiny_jamba, "resnet": tiny_resnet,
                 "vit": tiny_vit}
