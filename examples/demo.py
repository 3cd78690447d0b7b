"""The main job: a small GPT trained data-parallel on 2 CPU processes, ds_muon next to AdamW.

Run with ``torchrun --nproc_per_node 2 examples/demo.py`` (``make demo`` does).
Each rank reads different batches of byte-level Python source; DDP averages
gradients; ds_muon plans a home rank per matrix, moves what it must with one
all_to_all each way and runs Newton–Schulz once per matrix.  Both optimizers
get the same steps, data and seed; the final eval losses are printed side by side.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))
import ds_muon  # noqa: E402
from gpt import GPT, batch, evaluate, split, stdlib_bytes  # noqa: E402


def train(name, make_opt, args, train_data, eval_data, rank, world):
    torch.manual_seed(0)
    model = GPT(d=args.d, layers=args.layers, seq=args.seq)
    ddp = DDP(model)
    opt = make_opt(model)
    g = torch.Generator().manual_seed(100 + rank)
    bar = tqdm(range(args.steps), desc=f"{name:>7}", disable=rank != 0, ncols=90)
    t0 = time.perf_counter()
    for step in bar:
        x, y = batch(train_data, args.batch, args.seq, g)
        loss = ddp(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    elapsed = time.perf_counter() - t0
    return evaluate(model, eval_data, seq=args.seq), elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--adam-lr", type=float, default=3e-3)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_data, eval_data = split(stdlib_bytes())
    if rank == 0:
        n = sum(p.numel() for p in GPT(d=args.d, layers=args.layers, seq=args.seq).parameters())
        print(f"ds_muon demo: GPT with {n / 1e6:.2f} M parameters, {world} gloo ranks (DDP), "
              f"{len(train_data) / 1e6:.1f} MB of stdlib source, {args.steps} steps x "
              f"{args.batch * world} sequences of {args.seq} bytes")

    runs = {
        "ds_muon": lambda m: ds_muon.Muon(ds_muon.muon_param_groups(m, lr=args.muon_lr, adam_lr=args.adam_lr)),
        "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=args.adam_lr, betas=(0.9, 0.95)),
    }
    results = {name: train(name, make, args, train_data, eval_data, rank, world) for name, make in runs.items()}
    if rank == 0:
        print(f"\n{'optimizer':<10}{'eval loss':>10}{'train time':>12}")
        for name, (loss, secs) in results.items():
            print(f"{name:<10}{loss:>10.4f}{secs:>11.1f}s")
        print(f"ds_muon eval loss / AdamW eval loss = {results['ds_muon'][0] / results['AdamW'][0]:.3f}")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort during interpreter teardown


if __name__ == "__main__":
    main()
