"""Train the stdlib GPT (examples/gpt.py) with ds_muon under ``lightning.Trainer``.

    torchrun --nproc_per_node 2 examples/lightning_train.py --strategy ddp
    torchrun --nproc_per_node 2 examples/lightning_train.py --strategy fsdp2       # ModelParallelStrategy
    torchrun --nproc_per_node 2 examples/lightning_train.py --strategy deepspeed   # ZeRO-2, ds_muon's strategy
    python examples/lightning_train.py --strategy auto                            # one process

The lines that differ from the same script with AdamW (docs/LIGHTNING.md)::

    def configure_optimizers(self):
        return ds_muon.Muon(ds_muon.muon_param_groups(self, lr=0.02, adam_lr=3e-3))

    strategy = ds_muon.lightning.DeepSpeedStrategy(stage=2)      # in place of "deepspeed_stage_2"

On CPU every rank runs one gloo process (torchrun's environment; Lightning does not spawn).  Rank 0
prints one JSON line at the end: losses, ``muon_home_ranks`` (the ranks that ran Newton-Schulz) and
how the stack held the Muon's tensors (``sharding``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_muon  # noqa: E402
from gpt import GPT, evaluate, split, stdlib_bytes  # noqa: E402


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


def make_module(args):
    import lightning as L

    class LitGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(args.seed)
            self.gpt = GPT(d=args.width, layers=args.layers, heads=args.heads, seq=args.seq_len)
            self.losses = []

        def configure_model(self):  # FSDP2 (ModelParallelStrategy): each block, then the root
            if args.strategy == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                for block in self.gpt.blocks:
                    fully_shard(block, mesh=self.device_mesh["data_parallel"])
                fully_shard(self.gpt, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            loss = self.gpt(*batch)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return ds_muon.Muon(ds_muon.muon_param_groups(self, lr=args.lr, adam_lr=args.adam_lr), log_summary=False)

    return LitGPT()


def strategy_of(name: str):
    if name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=int(os.environ.get("WORLD_SIZE", "1")), tensor_parallel_size=1)
    if name == "deepspeed":
        import ds_muon.lightning

        return ds_muon.lightning.DeepSpeedStrategy(stage=2)
    return name


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", default="ddp", choices=["auto", "ddp", "fsdp2", "deepspeed"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--adam-lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    import lightning as L

    world = int(os.environ.get("WORLD_SIZE", "1"))
    train_data, eval_data = split(stdlib_bytes())
    loader = DataLoader(Windows(train_data, args.seq_len, args.steps * args.micro_batch * world, args.seed + 1),
                        batch_size=args.micro_batch, shuffle=False)
    module = make_module(args)
    initial_eval = evaluate(module.gpt, eval_data, batches=2, batch_size=args.micro_batch, seq=args.seq_len)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy_of(args.strategy), max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, loader)
    muon = ds_muon.find_muon(trainer.optimizers[0])
    model = trainer.strategy.model
    if args.strategy == "deepspeed":
        from deepspeed.utils import safe_get_full_fp32_param

        full = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
        eval_gpt = make_module(args).gpt
        eval_gpt.load_state_dict({n.split("gpt.", 1)[1]: t for n, t in full.items()})
    else:
        eval_gpt = module.gpt
    final_eval = evaluate(eval_gpt, eval_data, batches=2, batch_size=args.micro_batch, seq=args.seq_len)
    homes = sorted({h for ex in muon.exchanges() for hs in ex.homes.values() for h in hs})
    params = [p for g in muon.param_groups for p in g["params"]]
    sharding = getattr(muon.adapter, "kind", None) or (
        "dtensor" if all(type(p).__name__ == "DTensor" for p in params) else "plain")
    if trainer.global_rank == 0:
        print(json.dumps({"script": "lightning_train", "strategy": args.strategy, "world": world,
                          "steps": trainer.global_step, "train_losses": module.losses,
                          "initial_eval_loss": initial_eval, "final_eval_loss": final_eval,
                          "muon_home_ranks": homes, "sharding": sharding}))


if __name__ == "__main__":
    main()
