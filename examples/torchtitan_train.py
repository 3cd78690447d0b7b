"""ds_muon as torchtitan's optimizer, on a model laid out and parallelized like torchtitan's debug Llama.

    torchrun --nproc_per_node 2 examples/torchtitan_train.py --dp 2 --tp 1     # FSDP2
    torchrun --nproc_per_node 2 examples/torchtitan_train.py --dp 1 --tp 2     # tensor parallel
    torchrun --nproc_per_node 4 examples/torchtitan_train.py --dp 2 --tp 2     # FSDP2 x TP

torchtitan itself is not needed (docs/TORCHTITAN.md): the model has its debug Llama's module names and
``parallelize_llama``'s placements (TP plan on ``tp``, ``fully_shard`` per block on ``dp``), and the
optimizer is built the way torchtitan's trainer builds it, after parallelizing::

    optimizers = ds_muon.torchtitan.MuonOptimizers.Config(lr=0.02, adam_lr=3e-3).build(model_parts=[model])

(in a torchtitan job: ``optimizer=ds_muon.torchtitan.MuonOptimizers.Config(...)`` in the trainer
config).  It trains on the Python standard library's bytes, saves model and optimizer with DCP at the
end (``--save DIR``), and rank 0 prints one JSON line: losses, ``muon_home_ranks``, placements.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_muon  # noqa: E402
import ds_muon.torchtitan  # noqa: E402
from gpt import batch, split, stdlib_bytes  # noqa: E402


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # -1: the heads this TP rank holds
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), nn.Linear(
            dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, 4 * dim)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class DebugLlama(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, targets):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def parallelize(model: DebugLlama, dp: int, tp: int):
    """torchtitan's parallelize_llama, reduced: TP plan on "tp", then fully_shard per block and root on "dp"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
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
    return model, mesh


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--save", default=None, help="a directory: model and optimizer saved there with DCP")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if args.dp * args.tp != dist.get_world_size():
        raise SystemExit(f"--dp {args.dp} x --tp {args.tp} must equal the world size {dist.get_world_size()}")
    torch.manual_seed(0)
    model, mesh = parallelize(DebugLlama(), args.dp, args.tp)
    optimizers = ds_muon.torchtitan.MuonOptimizers.Config(lr=0.02, adam_lr=3e-3,
                                                          muon={"log_summary": False}).build(model_parts=[model])
    data, _ = split(stdlib_bytes())
    g = torch.Generator().manual_seed(1 + mesh["dp"].get_local_rank())  # TP ranks of one dp rank: the same batch
    losses = []
    for _ in range(args.steps):
        x, y = batch(data, args.batch, args.seq_len, g)
        loss = model(x, y)
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        losses.append(float(loss.detach()))
    if args.save:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        dcp.save({"model": get_model_state_dict(model), "optimizer": optimizers.state_dict()}, checkpoint_id=args.save)
    muon = optimizers.optimizers[0]
    homes = sorted({h for ex in muon.exchanges() for hs in ex.homes.values() for h in hs})
    placements = sorted({str(getattr(p, "placements", "plain")) for p in model.parameters()})
    if dist.get_rank() == 0:
        print(json.dumps({"script": "torchtitan_train", "dp": args.dp, "tp": args.tp, "world": dist.get_world_size(),
                          "steps": len(losses), "train_losses": losses, "muon_home_ranks": homes,
                          "placements": placements}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
