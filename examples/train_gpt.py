"""Train a small byte-level GPT on the Python standard library's source with ds_muon.

One script, every stack:

    python examples/train_gpt.py --stack single
    torchrun --nproc_per_node 2 examples/train_gpt.py --stack ddp|fsdp1|fsdp2
    deepspeed --num_gpus 2 examples/train_gpt.py --stack deepspeed      # or torchrun
    ... --optimizer ds_muon|adamw|deepspeed_muon --steps 200 --save ckpt/ --resume ckpt/
    ... --overlap      # ds_muon's exchange hidden behind backward (waves pipelined in step())

Every step draws one *global* batch (seeded by step) and each rank takes its
slice, so runs at different world sizes see the same data; the single-process
run takes the whole batch.  Rank 0 shows a tqdm bar, writes metrics as JSON
lines into ``--out`` and redraws ``--out/loss_curves.png`` with every run there.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_muon  # noqa: E402
from gpt import GPT, Block, batch, evaluate, split, stdlib_bytes  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STACKS = ("single", "ddp", "fsdp1", "fsdp2", "deepspeed")
OPTIMIZERS = ("ds_muon", "adamw", "deepspeed_muon")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stack", choices=STACKS, default="single")
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="ds_muon")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences per step, split over ranks)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--width", type=int, default=128, help="model width d (--d would clash with torchrun's options)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    ap.add_argument("--adam-lr", type=float, default=3e-3,
                    help="AdamW learning rate (all of AdamW, or Muon's AdamW group); 3e-3, not ds_muon's default "
                         "3e-4: tuned for this small model's short runs")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--ns-dtype", default="auto",
                    help="NS dtype: auto (the machine's fast dtype: ds_muon.rules.ns_auto), bfloat16, float16, float32")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation")
    ap.add_argument("--data-seed", type=int, default=0, help="batch order")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--eval-batch-size", type=int, default=16,
                    help="sequences per eval batch, the same on every rank at every world size")
    ap.add_argument("--fsdp1-orig-params", action="store_true", help="FSDP1 with use_orig_params=True")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute (FSDP2 MixedPrecisionPolicy / DeepSpeed bf16)")
    ap.add_argument("--overlap", action="store_true",
                    help="ds_muon overlap=True: waves pipelined in step(), gathers sent from backward (FSDP2)")
    ap.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    ap.add_argument("--ds-config", default=None, help="DeepSpeed JSON (default: configs/deepspeed/zero<stage>.json)")
    ap.add_argument("--out", default="runs/train_gpt")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--save", default=None, help="checkpoint directory written at the end")
    ap.add_argument("--resume", default=None, help="checkpoint directory to start from")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = ap.parse_args(argv)
    if args.optimizer == "deepspeed_muon" and args.stack != "deepspeed":
        ap.error("--optimizer deepspeed_muon is DeepSpeed's built-in Muon: use it with --stack deepspeed")
    if args.overlap and (args.optimizer != "ds_muon" or args.stack == "deepspeed"):
        ap.error("--overlap is ds_muon's overlap=True for --stack single|ddp|fsdp1|fsdp2; under DeepSpeed set "
                 '"overlap": true in the DsMuon "params" of the JSON config')
    args.run_name = args.run_name or f"{args.stack}-{args.optimizer}"
    return args


# -- distributed set-up --------------------------------------------------------------------------
def init_distributed(stack):
    if stack == "single":
        return 0, 1
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if stack == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
    else:
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# -- model, wrapping and optimizer -----------------------------------------------------------------
def build(args, world):
    torch.manual_seed(args.seed)
    model = GPT(d=args.width, layers=args.layers, heads=args.heads, seq=args.seq_len).to(device())
    if args.stack == "deepspeed":
        return build_deepspeed(args, model)
    if args.stack == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
    elif args.stack == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device().type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
        kw = {"mesh": mesh} | ({"mp_policy": mp} if mp else {})
        for blk in model.blocks:
            fully_shard(blk, **kw)
        fully_shard(model, **kw)
        wrapped = model
    elif args.stack == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device(),
                       use_orig_params=args.fsdp1_orig_params)
    else:
        wrapped = model
    opt = build_optimizer(args, wrapped)
    return wrapped, opt, None


def build_optimizer(args, wrapped):
    if args.optimizer == "adamw":
        return torch.optim.AdamW(wrapped.parameters(), lr=args.adam_lr, betas=(0.9, 0.95),
                                 weight_decay=args.weight_decay)
    groups = ds_muon.muon_param_groups(wrapped, lr=args.lr, adam_lr=args.adam_lr, weight_decay=args.weight_decay)
    return ds_muon.Muon(groups, ns_dtype=args.ns_dtype, overlap=args.overlap,
                        model=wrapped if args.stack == "fsdp1" or args.overlap else None)


def build_deepspeed(args, model):
    path = args.ds_config or os.path.join(REPO, "configs", "deepspeed", f"zero{max(args.zero_stage, 1)}.json")
    with open(path) as f:
        cfg = json.load(f)
    if args.ds_config is None:
        cfg["zero_optimization"]["stage"] = args.zero_stage
    world = dist.get_world_size()
    cfg["train_micro_batch_size_per_gpu"] = args.batch // world
    cfg["gradient_accumulation_steps"] = 1
    cfg["steps_per_print"] = 10**9
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
    if args.optimizer == "ds_muon":
        cfg["optimizer"] = {"type": "DsMuon", "params": {"lr": args.lr, "adam_lr": args.adam_lr,
                                                         "weight_decay": args.weight_decay, "ns_dtype": args.ns_dtype}}
    elif args.optimizer == "deepspeed_muon":
        # DeepSpeed's own Muon reads a use_muon tag on each parameter; same split as ds_muon's groups
        muon, _ = ds_muon.param_groups.split_params(model)
        muon_ids = {id(p) for _, p in muon}
        for p in model.parameters():
            p.use_muon = id(p) in muon_ids
        cfg["optimizer"] = {"type": "Muon", "params": {"lr": args.lr, "momentum": 0.95,
                                                       "weight_decay": args.weight_decay}}
    else:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": args.adam_lr, "betas": [0.9, 0.95],
                                                        "weight_decay": args.weight_decay}}
    engine, opt, _, _ = ds_muon.deepspeed.initialize(model=model, model_parameters=None if args.optimizer == "ds_muon"
                                                     else model.parameters(), config=cfg)
    return engine, opt, engine


# -- checkpoints -------------------------------------------------------------------------------------
def save(args, wrapped, opt, engine, step, path):
    if engine is not None:
        engine.save_checkpoint(path, client_state={"step": step})
        return
    if args.stack in ("fsdp1", "fsdp2"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(wrapped, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    elif dist.is_initialized() and dist.get_rank() != 0:
        pass
    else:
        os.makedirs(path, exist_ok=True)
        model = wrapped.module if hasattr(wrapped, "module") else wrapped
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, os.path.join(path, "state.pt"))
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(os.path.join(path, "step.json"), "w") as f:
            json.dump({"step": step}, f)
    if dist.is_initialized():
        dist.barrier()


def load(args, wrapped, opt, engine, path) -> int:
    if engine is not None:
        _, client = engine.load_checkpoint(path)
        return int(client["step"])
    if args.stack in ("fsdp1", "fsdp2"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(wrapped, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(wrapped, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        ck = torch.load(os.path.join(path, "state.pt"), map_location=device(), weights_only=False)
        model = wrapped.module if hasattr(wrapped, "module") else wrapped
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
    with open(os.path.join(path, "step.json")) as f:
        return int(json.load(f)["step"])


# -- plotting ------------------------------------------------------------------------------------
def plot(out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
    for path in sorted(glob.glob(os.path.join(out_dir, "*.jsonl"))):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        name = os.path.basename(path)[: -len(".jsonl")]
        train = [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
        if train:
            ax_t.plot(*zip(*train), label=name, linewidth=0.8)
        if evals:
            ax_e.plot(*zip(*evals), label=name, marker="o", markersize=3)
    for ax, title in ((ax_t, "train loss"), (ax_e, "eval loss")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    png = os.path.join(out_dir, "loss_curves.png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


# -- training -------------------------------------------------------------------------------------
def train(args):
    torch.set_num_threads(args.threads)
    rank, world = init_distributed(args.stack)
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the world size {world}")
    train_data, eval_data = split(stdlib_bytes())
    wrapped, opt, engine = build(args, world)
    start = load(args, wrapped, opt, engine, args.resume) if args.resume else 0
    os.makedirs(args.out, exist_ok=True)
    metrics_path = os.path.join(args.out, f"{args.run_name}.jsonl")
    log = open(metrics_path, "a" if args.resume else "w") if rank == 0 else None
    per_rank = args.batch // world
    forward = engine if engine is not None else wrapped
    bar = tqdm(range(start, args.steps), desc=args.run_name, disable=rank != 0, ncols=100)
    t0 = time.perf_counter()
    eval_loss = None
    for step in bar:
        g = torch.Generator().manual_seed(args.data_seed * 1_000_003 + step)
        x, y = batch(train_data, args.batch, args.seq_len, g)
        x, y = x[rank * per_rank:(rank + 1) * per_rank].to(device()), y[rank * per_rank:(rank + 1) * per_rank].to(device())
        loss = forward(x, y)
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        record = {"step": step + 1, "train_loss": loss.item(), "time": time.perf_counter() - t0}
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            eval_loss = evaluate(forward, eval_data, args.eval_batches, args.eval_batch_size, args.seq_len)
            if args.stack == "fsdp2":
                wrapped.reshard()  # the root stays unsharded after a forward with no backward
            record["eval_loss"] = eval_loss
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{record['train_loss']:.3f}", eval=f"{eval_loss:.3f}" if eval_loss else "-")
    if args.save:
        save(args, wrapped, opt, engine, args.steps, args.save)
    summary = {"run": args.run_name, "stack": args.stack, "optimizer": args.optimizer, "world": world,
               "steps": args.steps, "final_eval_loss": eval_loss, "seconds": time.perf_counter() - t0}
    muon = opt
    while muon is not None and not isinstance(muon, ds_muon.Muon):
        muon = getattr(muon, "optimizer", None)  # DeepSpeed's ZeRO optimizer wraps the client optimizer
    if args.stack == "fsdp2":  # the stack's promise: every parameter is a DTensor shard
        from torch.distributed.tensor import DTensor

        summary["dtensor_params"] = all(isinstance(p, DTensor) for p in wrapped.parameters())
    if muon is not None:
        homes = sorted({h for ex in muon.exchanges() for hs in ex.homes.values() for h in hs})
        summary["muon_home_ranks"] = homes
        summary["muon_exchanges"] = len(muon.exchanges())  # one per wave with --overlap
    if rank == 0:
        log.close()
        png = plot(args.out)
        summary["plot"] = png
        print(json.dumps(summary))
    return summary


def main(argv=None):
    args = parse_args(argv)
    train(args)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)  # gloo may abort during interpreter teardown


if __name__ == "__main__":
    main()
