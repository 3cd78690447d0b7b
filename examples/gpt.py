"""A small GPT and byte-level text from the Python standard library (no downloads).

Shared by the demo, the examples and the benchmarks: embedding, blocks with a
fused QKV projection, attention output, MLP, LayerNorms and an output head — the
shapes Muon meets in real models.
"""

from __future__ import annotations

import math
import os
import sysconfig

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 4, heads: int = 4, seq: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.ndim == 2:
                embedding = name.startswith(("embed", "pos"))
                nn.init.normal_(p, std=0.02 if embedding else 1 / math.sqrt(p.shape[1]))

    def forward(self, idx, targets=None):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def stdlib_bytes(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The stdlib's own .py files, sorted by path, concatenated as bytes (deterministic)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
        for f in sorted(filenames):
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), "rb") as fh:
                    data = fh.read()
                chunks.append(data)
                total += len(data)
                if total >= max_bytes:
                    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def split(data: torch.Tensor, eval_fraction: float = 0.05):
    """Train on the first part, evaluate on the tail (a different set of files)."""
    cut = int(len(data) * (1 - eval_fraction))
    return data[:cut], data[cut:]


def batch(data: torch.Tensor, batch_size: int, seq: int, generator: torch.Generator):
    ix = torch.randint(len(data) - seq - 1, (batch_size,), generator=generator)
    x = torch.stack([data[i:i + seq] for i in ix.tolist()])
    y = torch.stack([data[i + 1:i + 1 + seq] for i in ix.tolist()])
    return x, y


@torch.no_grad()
def evaluate(model, data, batches: int = 8, batch_size: int = 16, seq: int = 128, seed: int = 1234) -> float:
    g = torch.Generator().manual_seed(seed)
    was = model.training
    model.eval()
    losses = [model(*batch(data, batch_size, seq, g)).item() for _ in range(batches)]
    model.train(was)
    return sum(losses) / len(losses)
