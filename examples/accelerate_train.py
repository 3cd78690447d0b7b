"""Train the stdlib GPT (examples/gpt.py) with ds_muon through ``accelerate.Accelerator``.

    accelerate launch --config_file configs/accelerate/fsdp2.yaml examples/accelerate_train.py
    accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml examples/accelerate_train.py
    accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml examples/accelerate_train.py

Run from the repository root (the DeepSpeed configs name their JSON files relative to it).
The same files run on GPUs (NCCL) and on CPUs (gloo); see docs/ACCELERATE.md.

The whole integration is two lines::

    accelerator = ds_muon.accelerate.Accelerator()
    model, opt, loader = ds_muon.accelerate.prepare(accelerator, model, loader, lr=..., adam_lr=...)

``prepare`` builds the Muon (DeepSpeed: from the config's ``"type": "DsMuon"`` entry, which
``--lr``/``--adam-lr`` override), shards the model (FSDP2, also on CPU) and binds the Muon to
the DeepSpeed engine.  The GPT declares ``_no_split_modules = ["Block"]`` the way Hugging Face
models declare their decoder layers, which is what fsdp2.yaml's wrap policy reads.

Rank 0 prints one JSON line at the end: losses, ``muon_home_ranks`` (the ranks that ran
Newton-Schulz), ``dtensor_params`` (FSDP2) and ``deepspeed_binding`` (DeepSpeed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_muon  # noqa: E402
import ds_muon.accelerate  # noqa: E402
from gpt import GPT, evaluate, split, stdlib_bytes  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per process per step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--width", type=int, default=128, help="model width d")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=None,
                    help="Muon learning rate (default 0.02; DeepSpeed: the DsMuon entry's, overridden when given)")
    ap.add_argument("--adam-lr", type=float, default=None,
                    help="AdamW-group learning rate (default: ds_muon's 3e-4, the same as the shipped DsMuon "
                         "entries; DeepSpeed: the entry's adam_lr, overridden when given)")
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = ap.parse_args(argv)
    for name in ("steps", "micro_batch", "seq_len", "width", "layers", "heads", "eval_batches", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("lr", "adam_lr"):
        if getattr(args, name) is not None and not getattr(args, name) >= 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.width % args.heads:
        ap.error(f"--width {args.width} must be divisible by --heads {args.heads}")
    return args


class Windows(Dataset):
    """``n`` (input, target) windows of the byte stream at seeded random offsets."""

    def __init__(self, data: torch.Tensor, seq: int, n: int, seed: int):
        self.data, self.seq = data, seq
        self.starts = torch.randint(len(data) - seq - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        return self.data[s:s + self.seq], self.data[s + 1:s + 1 + self.seq]


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from accelerate.utils import DistributedType

    accelerator = ds_muon.accelerate.Accelerator()
    world, rank = accelerator.num_processes, accelerator.process_index
    train_data, eval_data = split(stdlib_bytes())

    torch.manual_seed(args.seed)
    model = GPT(d=args.width, layers=args.layers, heads=args.heads, seq=args.seq_len)
    model._no_split_modules = ["Block"]  # what accelerate's TRANSFORMER_BASED_WRAP shards (as in HF models)
    loader = DataLoader(Windows(train_data, args.seq_len, args.steps * args.micro_batch * world, args.seed + 1),
                        batch_size=args.micro_batch, shuffle=False)

    settings = {k: v for k, v in (("lr", args.lr), ("adam_lr", args.adam_lr)) if v is not None}
    model, opt, loader = ds_muon.accelerate.prepare(accelerator, model, loader, **settings)
    muon = ds_muon.accelerate.find_muon(opt)
    dist_type = accelerator.distributed_type
    engine = model if dist_type == DistributedType.DEEPSPEED else None

    fsdp2 = accelerator.is_fsdp2
    dtensor_params = None
    if fsdp2:
        from torch.distributed.tensor import DTensor

        plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
        if plain:
            raise RuntimeError(f"FSDP2 left {len(plain)} parameters unsharded, e.g. {plain[:3]}")
        muon_tensors = [p for g in muon.param_groups for p in g["params"]]
        if not all(isinstance(p, DTensor) for p in muon_tensors):
            raise RuntimeError("the optimizer does not step the FSDP2 DTensors (its param_groups were not swapped)")
        dtensor_params = True

    device = accelerator.device
    eval_data = eval_data.to(device)
    eval_kw = dict(batches=args.eval_batches, batch_size=args.micro_batch, seq=args.seq_len)
    initial_eval = evaluate(model, eval_data, **eval_kw)
    losses = []
    t0 = time.perf_counter()
    model.train()
    for x, y in loader:
        loss = model(x.to(device), y.to(device))
        accelerator.backward(loss)  # DeepSpeed: engine.backward + engine.step
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    seconds = time.perf_counter() - t0
    final_eval = evaluate(model, eval_data, **eval_kw)

    homes = sorted({h for ex in muon.exchanges() for hs in ex.homes.values() for h in hs})
    summary = {
        "script": "accelerate_train", "distributed_type": str(dist_type).split(".")[-1],
        "fsdp2": fsdp2, "world": world, "steps": len(losses),
        "train_losses": losses, "initial_eval_loss": initial_eval, "final_eval_loss": final_eval,
        "muon_home_ranks": homes, "seconds": seconds,
    }
    if dtensor_params is not None:
        summary["dtensor_params"] = dtensor_params
    if engine is not None:
        summary["zero_stage"] = engine.zero_optimization_stage()
        summary["deepspeed_binding"] = muon.adapter.kind
    if rank == 0:
        print(json.dumps(summary), flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
    # like train_gpt.py: gloo can abort ("terminate called without an active exception") while the
    # interpreter tears down its threads after a finished run; everything is flushed and shut down here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
