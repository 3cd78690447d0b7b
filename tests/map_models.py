"""Small models of issue 40's classes, written as people write them (no config, no head names): a conv
classifier whose pooling comes before a hidden Linear, an LM whose logits are transposed after the matmul,
a UNet-like model returning a dataclass, a diffusion transformer whose final projection is unpatchified by
an einsum, and a research LM applying raw parameters through ``einsum``.

``MODELS[name]() -> model``; :func:`batch` (seeded inputs and targets) and :func:`loss` for one step.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 32, 8


class ConvClassifier(nn.Module):
    """stem → bn → pool → hidden Linear → fc: the pooling is before ``hidden``, so ``fc`` does not classify
    pooled features directly."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 12, 3, padding=1)
        self.hidden = nn.Linear(12, 24)
        self.fc = nn.Linear(24, 10)

    def forward(self, x):
        x = F.relu(self.conv(F.relu(self.bn(self.stem(x)))))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(F.relu(self.hidden(x)))


class TransposedLM(nn.Module):
    """An LM whose ``output_layer`` logits come out ``[batch, vocab, seq]`` (what ``cross_entropy`` takes)."""

    def __init__(self, d=16, ff=24):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, d)
        self.up = nn.Linear(d, ff)
        self.down = nn.Linear(ff, d)
        self.norm = nn.LayerNorm(d)
        self.output_layer = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embedding(idx)
        x = x + self.down(F.gelu(self.up(x)))
        return self.output_layer(self.norm(x)).transpose(1, 2).float()


class EmbeddingStack(nn.Module):
    """``Embedding → Linear → Linear(8, 16)``: the last Linear is the output layer."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 16)

    def forward(self, idx):
        return self.b(F.relu(self.a(self.embedding(idx))))


@dataclasses.dataclass
class UNetOutput:
    sample: torch.Tensor


class TinyUNet(nn.Module):
    """A UNet's shape: conv_in, a timestep embedding, one down and one up level with a skip, GroupNorm, and
    ``conv_out`` whose output is ``.sample`` of a dataclass (diffusers' ``BaseOutput`` is one)."""

    def __init__(self, ch=4, c=8):
        super().__init__()
        self.conv_in = nn.Conv2d(ch, c, 3, padding=1)
        self.time_proj = nn.Linear(c, c)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.fuse = nn.Conv2d(2 * c, c, 3, padding=1)
        self.norm_out = nn.GroupNorm(2, c)
        self.conv_out = nn.Conv2d(c, ch, 3, padding=1)

    def forward(self, sample, timestep):
        half = self.time_proj.in_features // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=sample.device) / half)
        t = timestep.float()[:, None] * freqs[None]
        emb = self.time_proj(torch.cat([t.sin(), t.cos()], dim=-1))
        h0 = self.conv_in(sample) + emb[:, :, None, None]
        h = F.silu(self.mid(F.silu(self.down(h0))))
        h = self.fuse(torch.cat([self.up(h), h0], dim=1))
        return UNetOutput(sample=self.conv_out(F.silu(self.norm_out(h))))


class TinyDiT(nn.Module):
    """A diffusion transformer: patch embedding, one adaLN-modulated block, the final projection to
    ``p·p·c`` per patch, unpatchified with ``einsum("nhwpqc->nchpwq")``."""

    def __init__(self, ch=4, p=2, d=16, size=8):
        super().__init__()
        self.p, self.ch, self.size = p, ch, size
        self.patch = nn.Conv2d(ch, d, p, stride=p)
        self.pos = nn.Parameter(torch.zeros(1, (size // p) ** 2, d))
        self.ada = nn.Linear(d, 2 * d)
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.proj_out = nn.Linear(d, p * p * ch)

    def forward(self, x):
        n = x.shape[0]
        h = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        shift, scale = self.ada(h.mean(1)).chunk(2, dim=-1)
        y = self.norm(h) * (1 + scale[:, None]) + shift[:, None]
        q, k, v = self.qkv(y).chunk(3, dim=-1)
        h = h + self.attn_out(F.scaled_dot_product_attention(q, k, v))
        h = self.proj_out(self.norm(h))
        g = self.size // self.p
        h = h.reshape(n, g, g, self.p, self.p, self.ch)
        h = torch.einsum("nhwpqc->nchpwq", h)
        return h.reshape(n, self.ch, g * self.p, g * self.p)


class EinsumLM(nn.Module):
    """A research LM keeping raw parameters: ``wq, wk, wv: [D, H, hd]`` applied by ``"bsd,dhk->bhsk"`` (one
    ``[H·hd, D]`` map each, stored ``[in, out…]``), ``wo: [D, H, hd]`` by ``"bhsk,dhk->bsd"`` (one ``[D, H·hd]``
    map), ``w_in: [D, F]`` by ``"bsd,df->bsf"``, ``w_out: [F, D]`` by ``"bsf,fd->bsd"``."""

    def __init__(self, d=16, heads=2, hd=16, ff=24):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, d)
        self.wq = nn.Parameter(torch.randn(d, heads, hd) / d ** 0.5)
        self.wk = nn.Parameter(torch.randn(d, heads, hd) / d ** 0.5)
        self.wv = nn.Parameter(torch.randn(d, heads, hd) / d ** 0.5)
        self.wo = nn.Parameter(torch.randn(d, heads, hd) / (heads * hd) ** 0.5)
        self.w_in = nn.Parameter(torch.randn(d, ff) / d ** 0.5)
        self.w_out = nn.Parameter(torch.randn(ff, d) / ff ** 0.5)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embedding(idx)
        q, k, v = (torch.einsum("bsd,dhk->bhsk", x, w) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + torch.einsum("bhsk,dhk->bsd", a, self.wo)
        h = torch.einsum("bsd,df->bsf", self.norm(x), self.w_in)
        x = x + torch.einsum("bsf,fd->bsd", F.gelu(h), self.w_out)
        return self.head(self.norm(x))


MODELS = {"conv_classifier": ConvClassifier, "transposed_lm": TransposedLM, "embedding_stack": EmbeddingStack,
          "unet": TinyUNet, "dit": TinyDiT, "einsum_lm": EinsumLM}
OUTPUT_LAYERS = {"conv_classifier": "fc.weight", "transposed_lm": "output_layer.weight", "embedding_stack": "b.weight",
                 "unet": "conv_out.weight", "dit": "proj_out.weight", "einsum_lm": "head.weight"}


def litgpt_gpt() -> nn.Module:
    """litgpt's ``GPT`` (``lm_head`` registered before ``transformer.wte``; ``attn.qkv`` of GQA sizes
    ``(n_head·hs, ng·hs, ng·hs)``), small; litgpt must be installed."""
    from litgpt import GPT
    from litgpt.config import Config

    return GPT(Config(n_layer=1, n_embd=32, n_head=4, n_query_groups=2, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                      block_size=16, intermediate_size=48, bias=False))


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return litgpt_gpt() if name == "litgpt" else MODELS[name]()


def batch(name: str, seed: int = 0, n: int = 4):
    """``(args, target)`` for one step of ``name``."""
    g = torch.Generator().manual_seed(seed)
    if name == "conv_classifier":
        return (torch.randn(n, 3, 8, 8, generator=g),), torch.randint(0, 10, (n,), generator=g)
    if name in ("transposed_lm", "einsum_lm", "embedding_stack", "litgpt"):
        idx = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
        return (idx[:, :-1],), idx[:, 1:] % (16 if name == "embedding_stack" else VOCAB)
    x = torch.randn(n, 4, 8, 8, generator=g)
    if name == "unet":
        return (x, torch.randint(0, 1000, (n,), generator=g)), torch.randn(n, 4, 8, 8, generator=g)
    return (x,), torch.randn(n, 4, 8, 8, generator=g)


def example_inputs(name: str):
    """What a user passes as ``example_inputs=`` (one sample); none for litgpt (its inputs are found)."""
    return None if name == "litgpt" else batch(name, n=1)[0]


def loss(name: str, model, args, target):
    out = model(*args)
    out = getattr(out, "sample", out)
    if name == "conv_classifier":
        return F.cross_entropy(out, target)
    if name == "transposed_lm":
        return F.cross_entropy(out, target)  # logits [batch, vocab, seq]
    if name in ("einsum_lm", "embedding_stack", "litgpt"):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return F.mse_loss(out, target)
