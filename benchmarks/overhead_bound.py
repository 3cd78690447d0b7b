"""Muon's extra cost over AdamW against its modelled lower bound, per stack, at W=2 (gloo).

For each model and stack, two variants live in the same two processes (same seed, each its own
model copy under its own wrapper) and take turns round by round (A, B, B, A, ...): AdamW, and
ds_muon (``muon_param_groups``, NS in bf16, eager).  Timed per round: forward + backward + step
of the slowest rank, wall and process CPU time.  Measured overhead = median over rounds of
(ds_muon - AdamW).

The bound, on the busiest rank: what Muon adds that AdamW does not do at all,

    max over ranks of  NS FLOPs at home / GEMM rate  +  exchange bytes sent / all_to_all bandwidth

with both rates measured in the same processes every round (a bf16 2048² ``mm`` on one thread,
process CPU time; an ``all_to_all_single`` of this rank's exchange bytes, wall time), and the NS
FLOPs and bytes read from the optimizer's own plan (its exchanges' homes and ``bytes_sent``).
Everything AdamW does too is excluded: the AdamW groups (embeddings, head, norms, biases) run
the same update in both, and Muon's momentum update on a matrix is lighter than AdamW's.  So
overhead / bound >= 1 up to noise, and how far above 1 it is says what is left to win: copies,
host time (Python per matrix, small kernels), and exchange latency the bytes do not count.

Stacks: ``ddp`` (DistributedDataParallel), ``fsdp1`` (FullyShardedDataParallel, one unit per
block), ``fsdp2`` (``fully_shard`` per block and root), ``zero1``/``zero2``/``zero3`` (DeepSpeed,
``ds_muon.deepspeed.initialize`` for ds_muon, DeepSpeed's own AdamW ``torch_adam`` for the
baseline).  Models: ``gpt`` (examples/gpt.GPT, the demo's sizes) and ``llama`` (a transformers
``LlamaForCausalLM`` from a config, about 51 M parameters: hidden 576, 8 layers, MLP 1536,
vocab 16384).  One thread per rank.
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

os.environ.setdefault("DS_ACCELERATOR", "cpu")

WORLD = 2
STACKS = ("ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3")
MODELS = ("gpt", "llama")
GEMM = 2048


class LlamaLM(torch.nn.Module):
    """A transformers Llama from a config (no download), ``forward(idx, targets) -> loss``."""

    def __init__(self, hidden=576, layers=8, intermediate=1536, vocab=16384, heads=9, seq=128):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                          vocab_size=vocab, num_attention_heads=heads, num_key_value_heads=heads,
                          max_position_embeddings=seq, tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        self.lm = LlamaForCausalLM(cfg)
        self.vocab = vocab

    def blocks(self):
        return list(self.lm.model.layers)

    def forward(self, idx, targets):
        logits = self.lm(input_ids=idx).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def build_model(name: str, args):
    torch.manual_seed(0)
    if name == "llama":
        return LlamaLM(seq=args.seq)
    from gpt import GPT

    return GPT(d=args.d, layers=args.layers, seq=args.seq)


def _blocks(model):
    return model.blocks() if hasattr(model, "lm") else list(model.blocks)


def _muon(groups_of, **kw):
    import ds_muon

    return ds_muon.Muon(ds_muon.muon_param_groups(groups_of, adam_lr=3e-4), ns_dtype=torch.bfloat16,
                        log_summary=False, **kw)


def wrap(stack: str, variant: str, model):
    """(train(idx, targets) running forward+backward+step, the ds_muon optimizer or None)."""
    muon = variant == "ds_muon"
    if stack.startswith("zero"):
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
               "zero_optimization": {"stage": int(stack[-1])}, "steps_per_print": 10**9,
               "wall_clock_breakdown": False}
        if muon:
            import ds_muon.deepspeed

            cfg["optimizer"] = {"type": "DsMuon", "params": {"lr": 0.02, "adam_lr": 3e-4, "ns_dtype": "bfloat16"}}
            engine = ds_muon.deepspeed.initialize(model=model, config=cfg)[0]
            opt = engine.basic_optimizer
        else:
            import deepspeed

            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}}
            engine, opt = deepspeed.initialize(model=model, config=cfg)[0], None

        def train(idx, tgt):
            engine.backward(engine(idx, tgt))
            engine.step()
        return train, opt
    if stack == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = _muon(net) if muon else torch.optim.AdamW(model.parameters(), lr=3e-4)
    elif stack == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({type(_blocks(model)[0])})
        net = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=policy, use_orig_params=True)
        opt = _muon(net, model=net) if muon else torch.optim.AdamW(net.parameters(), lr=3e-4)
    elif stack == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for blk in _blocks(model):
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
        opt = _muon(net) if muon else torch.optim.AdamW(net.parameters(), lr=3e-4)
    else:
        raise SystemExit(f"unknown stack {stack!r}; use one of {STACKS}")

    def train(idx, tgt):
        opt.zero_grad(set_to_none=True)
        net(idx, tgt).backward()
        opt.step()
    return train, (opt if muon else None)


def plan_work(opt) -> tuple:
    """(NS FLOPs this rank runs per step, bytes it sends in Muon's exchanges per step), from the plan."""
    from ds_muon.rules.newton_schulz import ns_flops

    rank = dist.get_rank()
    flops = sent = 0.0
    for ex in opt.exchanges():
        sent += getattr(ex, "bytes_sent", 0)
        homes = getattr(ex, "homes", {})
        for i in getattr(ex, "active", ()):
            info = ex.layout.matrices[i]
            if rank in homes.get(i, ()):
                flops += ns_flops(info.rows, info.cols, 5)
    return flops, sent


def _gemm_seconds(a, b) -> float:
    c0 = time.process_time()
    torch.mm(a, b)
    return time.process_time() - c0


def _a2a_seconds(buf, out) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_to_all_single(out, buf)
    return time.perf_counter() - t0


def _worker(rank, world, model_name, stack, args):
    torch.set_num_threads(1)
    variants = []
    for name in ("adamw", "ds_muon"):
        train, opt = wrap(stack, name, build_model(model_name, args))
        variants.append((name, train, opt))
    vocab = 256 if model_name == "gpt" else 16384
    g = torch.Generator().manual_seed(rank)
    a, b = (torch.randn(GEMM, GEMM).to(torch.bfloat16) for _ in range(2))
    rows = {name: [] for name, _, _ in variants}
    gemm, a2a, a2a_bytes = [], [], []
    buf = out = None
    for rnd in range(args.warmup + args.rounds):
        idx = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
        for name, train, _ in (variants if rnd % 2 == 0 else variants[::-1]):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            train(idx[:, :-1], idx[:, 1:])
            t = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rnd >= args.warmup:
                rows[name].append(t.tolist())
        if buf is None:  # the exchange bytes are known after the first Muon step
            flops, sent = plan_work(variants[1][2])
            n = max(world, int(sent) // 2 // world * world)  # bf16 elements, split evenly
            buf, out = torch.zeros(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
        gemm.append(_gemm_seconds(a, b))
        a2a.append(_a2a_seconds(buf, out))
        a2a_bytes.append(buf.numel() * buf.element_size() * (world - 1) / world)  # what leaves this rank
    flops, sent = plan_work(variants[1][2])
    return rows, flops, sent, statistics.median(gemm), statistics.median(a2a), a2a_bytes[0], os.getloadavg()


def measure(model_name: str, stack: str, args) -> dict:
    env = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1"}
    per_rank = dist_harness.run(_worker, WORLD, model_name, stack, args, timeout=args.timeout, env=env)
    rows = per_rank[0][0]
    gemm_rate = 2.0 * GEMM**3 / max(r[3] for r in per_rank)  # FLOP/s, slowest rank's GEMM
    bw = min(r[5] / r[4] for r in per_rank if r[4] > 0)  # bytes/s leaving a rank at this size, slowest
    bound = max(r[1] / gemm_rate + r[2] / bw for r in per_rank)  # (no bytes: the NS term alone)
    busiest = max(range(WORLD), key=lambda k: per_rank[k][1] / gemm_rate + per_rank[k][2] / bw)
    base, ours = rows["adamw"], rows["ds_muon"]
    over = [statistics.median(o[k] - b[k] for o, b in zip(ours, base)) for k in (0, 1)]
    return dict(adamw=[statistics.median(x[k] for x in base) for k in (0, 1)],
                muon=[statistics.median(x[k] for x in ours) for k in (0, 1)], over=over, bound=bound,
                ns=per_rank[busiest][1], bytes=per_rank[busiest][2], gemm=gemm_rate, bw=bw,
                load=per_rank[0][6])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--stacks", default=",".join(STACKS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d", type=int, default=128, help="gpt width (the demo's)")
    ap.add_argument("--layers", type=int, default=4, help="gpt layers (the demo's)")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    header(f"Muon's overhead over AdamW vs its bound (NS at the GEMM rate + exchange bytes at the all_to_all "
           f"bandwidth, busiest rank), W={WORLD} gloo, one thread per rank, {args.rounds} interleaved rounds "
           f"after {args.warmup} warm-up, batch {args.batch} x {args.seq} tokens per rank")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    out, load = [], None
    for model_name in args.models.split(","):
        for stack in args.stacks.split(","):
            r = measure(model_name, stack, args)
            load = r["load"]
            out.append([model_name, stack, r["adamw"][0] * 1e3, r["muon"][0] * 1e3, r["over"][0] * 1e3,
                        r["over"][1] * 1e3, f"{r['ns'] / 1e9:.3g}", f"{r['bytes'] / 1e6:.3g}",
                        f"{r['gemm'] / 1e12:.3g}", f"{r['bw'] / 1e9:.3g}" if r["bytes"] else "-", r["bound"] * 1e3,
                        f"{r['over'][0] / r['bound']:.2f}", f"{r['over'][1] / r['bound']:.2f}"])
            print(f"{model_name} {stack}: done", flush=True)
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in load or os.getloadavg())}\n")
    table(["model", "stack", "AdamW wall ms", "ds_muon wall ms", "overhead wall ms", "overhead CPU ms",
           "NS GFLOP (busiest)", "MB sent (busiest)", "GEMM TF/s", "a2a GB/s", "bound ms",
           "overhead/bound wall", "overhead/bound CPU"], out)
    print("bound: the busiest rank's NS FLOPs at the bf16 GEMM rate (one thread, CPU time) + its exchange bytes at the "
          "all_to_all bandwidth, both measured in the same processes; overhead: median over rounds of ds_muon - AdamW "
          "(forward+backward+step, slowest rank).")


if __name__ == "__main__":
    main()
