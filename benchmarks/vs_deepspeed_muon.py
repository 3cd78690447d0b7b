"""ds_muon vs DeepSpeed's built-in Muon vs DeepSpeed's AdamW: same model, W=2, ZeRO-2.

Timed: ``engine.backward(loss)`` + ``engine.step()`` together, per iteration the
slowest rank (DeepSpeed's built-in Muon runs its Newton–Schulz inside the
gradient reduction of backward, so timing step() alone would flatter it), in
process CPU time (what the rank itself spent, gloo's threads included) beside
wall time: on a shared machine wall time swings with the neighbours' load, CPU
time much less.  Forward is not timed.  All variants in one run; medians and ratios.

Models: ``--model bank`` (default) is a stack of linears whose Muon matrices are
the bank of ``benchmarks/ns_roofline.py`` (8×512², 4×1536×512, 4×512×1536,
4×384×1024), so NS dominates the step; ``--model gpt`` is examples/gpt.GPT.

Variants:
* ``adamw``: DeepSpeed ``"type": "AdamW"`` (``torch_adam``), the baseline;
* ``ds_muon NS fp32`` / ``ds_muon NS bf16``: ``"type": "DsMuon"`` with ``ns_dtype``
  (eager, the default, and bf16 with ``"compile": true``);
* ``deepspeed muon <method>``: ``"type": "muon"`` with ``ns_method`` ``standard``
  (NS in bf16) or ``gram`` (its default; NS in fp16), each with torch.compile as
  DeepSpeed ships it and eager (``torch.compiler.set_stance("force_eager")``, what
  ``TORCHDYNAMO_DISABLE=1`` does, but per variant inside one process).

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

from common import GEMM_SIZE, gemm_timer, header, table

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


class BankNet(torch.nn.Module):
    """A model whose Muon matrices are exactly the NS bank (no biases, no norms): an
    embedding, four up/down MLP blocks with two square mixers each, four side
    projections of ``[x, x]`` to 384 features, and a head."""

    def __init__(self, vocab=256, d=512):
        super().__init__()
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.embed = torch.nn.Embedding(vocab, d)
        self.up = torch.nn.ModuleList(lin(d, 3 * d) for _ in range(4))  # weights 1536x512
        self.down = torch.nn.ModuleList(lin(3 * d, d) for _ in range(4))  # 512x1536
        self.mix = torch.nn.ModuleList(lin(d, d) for _ in range(8))  # 512x512
        self.side = torch.nn.ModuleList(lin(2 * d, 384) for _ in range(4))  # 384x1024
        self.lm_head = lin(d, vocab)

    def forward(self, idx, targets):
        x = self.embed(idx)
        aux = 0.0
        for k in range(4):
            x = x + self.down[k](torch.nn.functional.gelu(self.up[k](x)))
            x = x + self.mix[2 * k + 1](torch.tanh(self.mix[2 * k](x)))
            aux = aux + self.side[k](torch.cat([x, x], -1)).square().mean()
        logits = self.lm_head(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)) + 1e-3 * aux


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
        compiled = variant.endswith("compile")
        dtype = variant.split()[1]
        cfg["optimizer"] = {"type": "DsMuon", "params": dict(common, ns_dtype=dtype, compile=compiled)}
    else:
        cfg["optimizer"] = {"type": "muon", "params": dict(common, ns_method=variant.split()[-1])}
    return cfg


def _ns_and_bytes(engine, variant):
    """(NS FLOPs this rank runs per step, bytes this rank sends for Muon per step)."""
    from ds_muon.rules.newton_schulz import ns_flops

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


def _engine(variant, args):
    torch.manual_seed(0)
    if args.model == "bank":
        model = BankNet()
    else:
        model = BenchGPT(vocab=256, d=args.dim, layers=args.layers, heads=4, seq=args.seq)
    cfg = _config(variant, args)
    if variant.startswith("ds_muon"):
        import ds_muon.deepspeed

        return ds_muon.deepspeed.initialize(model=model, config=cfg)[0]
    import deepspeed

    return deepspeed.initialize(model=model, config=cfg)[0]


def _worker(rank, world, runs, args):
    """Every variant's engine in these two processes, taking turns round by round (the
    order reversed every other round).  ``eager`` variants of DeepSpeed's Muon run under
    ``torch.compiler.set_stance("force_eager")``: its ``@torch.compile`` functions run as
    plain Python, as under ``TORCHDYNAMO_DISABLE=1``, while the compiled variants of the
    same process keep their graphs."""
    engines = [(label, _engine(variant, args), dynamo) for variant, label, dynamo in runs]
    g = torch.Generator().manual_seed(rank)
    rows = {label: [] for label, _, _ in engines}  # per round: (wall, CPU) of the slowest rank
    gemm, gemm_flops = gemm_timer(torch.bfloat16)
    gemm_share = []  # per round, this rank's seconds per FLOP at its GEMM rate (the floor is priced at it)
    for it in range(args.warmup + args.steps):
        idx = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
        for label, engine, dynamo in (engines if it % 2 == 0 else engines[::-1]):
            with torch.compiler.set_stance("default" if dynamo else "force_eager"):
                loss = engine(idx[:, :-1], idx[:, 1:])
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                engine.backward(loss)
                engine.step()
                t = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if it >= args.warmup:
                rows[label].append(t.tolist())
        if it >= args.warmup:
            gemm_share.append(gemm() / gemm_flops)
    plans = {label: _ns_and_bytes(engine, variant) for (label, engine, _), (variant, _, _) in zip(engines, runs)}
    return rows, plans, os.getloadavg(), gemm_share


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("bank", "gpt"), default="bank")
    ap.add_argument("--dim", type=int, default=256, help="gpt only")
    ap.add_argument("--layers", type=int, default=3, help="gpt only")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--skip-compiled", action="store_true", help="skip the torch.compile variants")
    ap.add_argument("--skip-fp32", action="store_true", help="skip ds_muon with NS in fp32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    header(f"backward()+step() at W={WORLD}, ZeRO-2, fp32 training: ds_muon vs DeepSpeed Muon vs AdamW")
    if args.model == "bank":
        print("model: BankNet (Muon matrices 8x512², 4x1536x512, 4x512x1536, 4x384x1024), "
              f"seq={args.seq}, micro-batch {args.batch} per rank;", end=" ")
    else:
        print(f"model: examples/gpt.GPT d={args.dim} layers={args.layers} seq={args.seq}, micro-batch {args.batch} "
              "per rank;", end=" ")
    print(f"{args.steps} interleaved rounds after {args.warmup} warm-up; one thread per rank; per round the "
          "slowest rank\n")

    runs = [("adamw", "AdamW (DeepSpeed, torch_adam)", False)]
    if not args.skip_fp32:
        runs.append(("ds_muon float32", "ds_muon, NS fp32", False))
    runs.append(("ds_muon bfloat16", "ds_muon, NS bf16", False))
    if not args.skip_compiled:
        runs.append(("ds_muon bfloat16 compile", "ds_muon, NS bf16, compile=True", True))
    for method, dtype in (("standard", "bf16"), ("gram", "fp16")):
        runs.append((f"ds muon {method}", f"DeepSpeed muon {method} (NS {dtype}), eager", False))
        if not args.skip_compiled:
            runs.append((f"ds muon {method}", f"DeepSpeed muon {method} (NS {dtype}), torch.compile", True))
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    per_rank = dist_harness.run(_worker, WORLD, runs, args, timeout=args.timeout)
    rows = per_rank[0][0]
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in per_rank[0][2])}\n")
    base = rows["AdamW (DeepSpeed, torch_adam)"]
    out = []
    for label, r in rows.items():
        flops = [pr[1][label][0] for pr in per_rank]
        sent = [pr[1][label][1] for pr in per_rank]
        mean = sum(flops) / len(flops)
        out.append([label, statistics.median(x[0] for x in r) * 1e3, statistics.median(x[1] for x in r) * 1e3,
                    statistics.median(x[0] - b[0] for x, b in zip(r, base)) * 1e3,
                    statistics.median(x[1] - b[1] for x, b in zip(r, base)) * 1e3,
                    f"{max(flops) / 1e9:.3g} / {mean / 1e9:.3g}" if mean else "-", f"{max(sent) / 1e6:.3g}"])
    table(["optimizer", "wall ms", "CPU ms", "overhead wall ms", "overhead CPU ms", "NS GFLOP max / mean",
           "MB sent max"], out)

    def ratio(ours, theirs, k):
        per_round = [(o[k] - b[k]) / (t[k] - b[k]) for o, t, b in zip(rows[ours], rows[theirs], base)]
        return statistics.median(per_round), min(per_round), max(per_round)

    print("Muon overhead over AdamW, ds_muon / DeepSpeed, median of per-round ratios (rounds' range; below 1: "
          "ds_muon adds less):")
    for ours in [lb for lb in rows if lb.startswith("ds_muon, NS bf16")]:
        for theirs in [lb for lb in rows if lb.startswith("DeepSpeed muon")]:
            c, w = ratio(ours, theirs, 1), ratio(ours, theirs, 0)
            print(f"  {ours} vs {theirs}: CPU {c[0]:.2f}x ({c[1]:.2f}-{c[2]:.2f}), "
                  f"wall {w[0]:.2f}x ({w[1]:.2f}-{w[2]:.2f})")
    ours = next((lb for lb in rows if lb.startswith("ds_muon, NS bf16")), None)
    if ours is not None:  # the slowest rank's NS FLOPs at its GEMM rate, per round
        floor = [max(pr[1][ours][0] * pr[3][k] for pr in per_rank) for k in range(len(base))]
        print(f"floor: ds_muon's NS FLOPs on its busiest rank at a {GEMM_SIZE}² bf16 GEMM's rate timed in each round, "
              f"{statistics.median(floor) * 1e3:.1f} ms; over each DeepSpeed overhead (CPU, median of per-round "
              "ratios), about the least ds_muon / DeepSpeed any optimizer running ds_muon's products could reach, with "
              "the rest of its step and the exchange free:")
        for theirs in [lb for lb in rows if lb.startswith("DeepSpeed muon")]:
            rf = [f / (t[1] - b[1]) for f, t, b in zip(floor, rows[theirs], base)]
            print(f"  vs {theirs}: {statistics.median(rf):.2f}x")


if __name__ == "__main__":
    main()
