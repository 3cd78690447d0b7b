"""ds_muon vs DeepSpeed's built-in Muon vs DeepSpeed's AdamW: same model, W=2, ZeRO-2.

Timed: ``engine.backward(loss)`` + ``engine.step()`` together, per iteration the
slowest rank (DeepSpeed's built-in Muon runs its Newton–Schulz inside the
gradient reduction of backward, so timing step() alone would flatter it).
Forward is not timed.  All variants in one run; medians and ratios.

Variants:
* ``adamw``: DeepSpeed ``"type": "AdamW"`` (``torch_adam``), the baseline;
* ``ds_muon NS fp32`` / ``ds_muon NS bf16``: ``"type": "DsMuon"`` with ``ns_dtype``;
* ``deepspeed muon <method>``: ``"type": "muon"`` with ``ns_method`` ``standard``
  (NS in bf16) or ``gram`` (its default; NS in fp16), each with torch.compile as
  DeepSpeed ships it and with ``TORCHDYNAMO_DISABLE=1``.

Both Muons take the same tensors (hidden matrices; embeddings, head, norms and
biases on Adam).  Per-rank NS work comes from the plans: ds_muon's exchange homes,
DeepSpeed's partition boundaries (every rank holding a piece of a matrix runs NS
on all of it).  Bytes are what Muon adds per rank per step on top of ZeRO-2's
own gradient reduce and parameter all-gather: ds_muon's two all_to_alls;
DeepSpeed's all-reduce (instead of reduce) of every matrix split across ranks,
``(W-1)/W · numel · 4 B`` extra per rank with a ring.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from common import header, table

import dist_harness
from gpt import GPT

os.environ.setdefault("DS_ACCELERATOR", "cpu")

WORLD = 2


class BenchGPT(GPT):
    """examples/gpt.GPT with the positional table named ``pos_embed``: DeepSpeed's own Muon
    tags by name (anything 2-D without "embed"/"lm_head" takes Muon), ds_muon by module type;
    with this name both put exactly the same tensors on Muon."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.pos_embed = self.pos
        del self.pos

    def forward(self, idx, targets):
        x = self.embed(idx) + self.pos_embed(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def _config(variant, args):
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    common = {"lr": 0.02, "momentum": 0.95, "adam_lr": 3e-4, "weight_decay": 0.0}
    if variant == "adamw":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.0, "torch_adam": True}}
    elif variant.startswith("ds_muon"):
        cfg["optimizer"] = {"type": "DsMuon", "params": dict(common, ns_dtype=variant.split()[-1])}
    else:
        cfg["optimizer"] = {"type": "muon", "params": dict(common, ns_method=variant.split()[-1])}
    return cfg


def _ns_and_bytes(engine, variant):
    """(NS FLOPs this rank runs per step, bytes this rank sends for Muon per step)."""
    from ds_muon.newton_schulz import ns_flops

    world, rank = dist.get_world_size(), dist.get_rank()
    if variant.startswith("ds_muon"):
        muon = engine.basic_optimizer
        flops = sent = 0.0
        for ex in muon.exchanges():
            for i in ex.active:
                info = ex.layout.matrices[i]
                if rank in ex.homes[i]:
                    flops += ns_flops(info.rows, info.cols, 5)
            sent += ex.bytes_sent
        return flops, sent
    if variant == "adamw":
        return 0.0, 0.0
    zero = engine.optimizer
    flops = extra = 0.0
    for lps in zero.bit16_groups:
        held = torch.tensor([int(getattr(p, "_hp_mapping", None) is not None) for p in lps])
        everyone = [torch.zeros_like(held) for _ in range(world)]
        dist.all_gather(everyone, held)
        holders = torch.stack(everyone).sum(0)
        for p, mine, k in zip(lps, held.tolist(), holders.tolist()):
            if not getattr(p, "use_muon", False):
                continue
            if mine:  # DeepSpeed orthogonalizes the whole matrix on every rank holding a piece
                flops += ns_flops(p.shape[0], p[0].numel(), 5)
            if k > 1:
                extra += (world - 1) / world * p.numel() * 4
    return flops, extra


def _worker(rank, world, variant, args):
    torch.manual_seed(0)
    model = BenchGPT(vocab=256, d=args.dim, layers=args.layers, heads=4, seq=args.seq)
    cfg = _config(variant, args)
    if variant.startswith("ds_muon"):
        import ds_muon.deepspeed

        engine, _, _, _ = ds_muon.deepspeed.initialize(model=model, config=cfg)
    else:
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(rank)
    times = []
    for it in range(args.warmup + args.steps):
        idx = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
        loss = engine(idx[:, :-1], idx[:, 1:])
        dist.barrier()
        t0 = time.perf_counter()
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times[args.warmup:], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    flops, sent = _ns_and_bytes(engine, variant)
    return statistics.median(slowest.tolist()), flops, sent


def run_variant(variant, dynamo, args):
    old = os.environ.get("TORCHDYNAMO_DISABLE")
    if dynamo:
        os.environ.pop("TORCHDYNAMO_DISABLE", None)
    else:
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:  # the spawned ranks inherit the environment before they import torch
        return dist_harness.run(_worker, WORLD, variant, args, timeout=args.timeout)
    finally:
        if old is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = old


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--skip-compiled", action="store_true", help="skip DeepSpeed Muon under torch.compile")
    args = ap.parse_args()
    torch.set_num_threads(1)
    header(f"backward()+step() at W={WORLD}, ZeRO-2, fp32 training: ds_muon vs DeepSpeed Muon vs AdamW")
    print(f"model: examples/gpt.GPT d={args.dim} layers={args.layers} seq={args.seq}, micro-batch {args.batch} "
          f"per rank; {args.steps} timed iterations after {args.warmup} warm-up; one thread per rank\n")

    runs = [("adamw", "AdamW (DeepSpeed, torch_adam)", False),
            ("ds_muon float32", "ds_muon, NS fp32", False),
            ("ds_muon bfloat16", "ds_muon, NS bf16", False)]
    for method, dtype in (("standard", "bf16"), ("gram", "fp16")):
        runs.append((f"ds muon {method}", f"DeepSpeed muon {method} (NS {dtype}), TORCHDYNAMO_DISABLE=1", False))
        if not args.skip_compiled:
            runs.append((f"ds muon {method}", f"DeepSpeed muon {method} (NS {dtype}), torch.compile", True))
    results = {}
    for variant, label, dynamo in runs:
        per_rank = run_variant(variant, dynamo, args)
        results[label] = per_rank
        print(f"  {label}: {per_rank[0][0] * 1e3:.1f} ms", flush=True)
    print()
    base = results["AdamW (DeepSpeed, torch_adam)"][0][0]
    rows = []
    for label, per_rank in results.items():
        t = per_rank[0][0]
        flops = [r[1] for r in per_rank]
        sent = [r[2] for r in per_rank]
        mean = sum(flops) / len(flops)
        rows.append([label, t * 1e3, t / base, (t - base) * 1e3,
                     f"{max(flops) / 1e9:.3g} / {mean / 1e9:.3g}" if mean else "-",
                     f"{max(flops) / mean:.2f}" if mean else "-",
                     f"{max(sent) / 1e6:.3g}"])
    table(["optimizer", "median ms", "× AdamW", "overhead ms", "NS GFLOP max / mean", "imbalance", "MB sent max"],
          rows)
    ours = results["ds_muon, NS bf16"][0][0] - base
    theirs = results["DeepSpeed muon standard (NS bf16), TORCHDYNAMO_DISABLE=1"][0][0] - base
    print(f"Muon overhead over AdamW, NS bf16: ds_muon {ours * 1e3:.1f} ms, DeepSpeed {theirs * 1e3:.1f} ms "
          f"(ratio {theirs / ours if ours > 0 else float('inf'):.2f})")


if __name__ == "__main__":
    main()
