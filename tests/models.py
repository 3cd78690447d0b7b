"""Small models shared by tests and examples.

:class:`TinyGPT` is a GPT-like decoder with every kind of tensor a sharded Muon
has to tell apart: token and position embeddings, fused QKV and attention
output projections, an MLP, LayerNorms, biases and an lm head.  ``gate=True``
adds a 2-row matrix per block (a tiny router-like gate) so that row-sharded
stacks (FSDP2) leave some ranks with empty shards at W >= 3.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, d: int, gate: bool):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.gate = nn.Linear(d, 2, bias=False) if gate else None

    def forward(self, x):
        y = self.proj(F.gelu(self.fc(x)))
        if self.gate is not None:
            g = self.gate(x)
            y = y * (1 + g[..., :1] - g[..., 1:])
        return y


class Block(nn.Module):
    def __init__(self, d: int, heads: int, gate: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d, gate)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, heads: int = 4, seq: int = 16,
                 gate: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, gate) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make_gpt(seed: int = 0, **kw) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kw)


def lm_loss(model, idx):
    """Next-token loss on ``idx`` ([batch, seq])."""
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1))


def batches(n: int, batch: int = 4, seq: int = 16, vocab: int = 64, seed: int = 0):
    """``n`` deterministic token batches with learnable structure (a noisy repeating pattern)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        step = torch.randint(1, 4, (batch, 1), generator=g)
        idx = (start + step * torch.arange(seq)) % vocab
        noise = torch.rand(batch, seq, generator=g) < 0.1
        idx = torch.where(noise, torch.randint(0, vocab, (batch, seq), generator=g), idx)
        out.append(idx)
    return out


class HandAdapter:
    """A stack adapter from a function ``describe(param, name, context) -> ParamBinding``: a
    sharding laid out by hand in a test (``ds_muon.Muon(..., adapter=HandAdapter(...))``)."""

    applies_in_step = False
    data_parallel_group = None

    def __init__(self, describe):
        self.describe = describe

    def bind(self, param, name, context):
        return self.describe(param, name, context)

    def grad_final_at_hook(self, param, context):
        return False
