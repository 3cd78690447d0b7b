"""ds_muon in the Hugging Face ``transformers.Trainer``: a tiny GPT-2 on the stdlib's bytes.

    python examples/hf_trainer.py                                              # one process
    torchrun --nproc_per_node 2 examples/hf_trainer.py                         # DDP (gloo on CPU)
    torchrun --nproc_per_node 2 examples/hf_trainer.py --fsdp2                 # FSDP2 (also on CPU)
    torchrun --nproc_per_node 2 examples/hf_trainer.py --deepspeed configs/deepspeed/zero3.json

The recipe is one class: ``ds_muon.trainer.MuonTrainer(..., muon_settings=dict(lr=..., adam_lr=...))``
in place of ``Trainer``; it builds the Muon on the model the Trainer trains (sharded under FSDP2;
under DeepSpeed from the config's ``"type": "DsMuon"`` entry, bound to the engine the Trainer
builds).  The Trainer builds its LR schedule on top (per-group factors, so Muon's and AdamW's
learning rates keep their ratio).  Evaluate before training with
``TrainingArguments(eval_on_start=True)``; ``trainer.evaluate()`` before ``trainer.train()`` in a
multi-process run is refused (it prepares the model for inference only).  The GPT-2 here is
randomly initialised from a config (nothing is downloaded) and reads byte-level text from
examples/gpt.py's ``stdlib_bytes``.

GPT-2's ``Conv1D`` stores weights transposed, ``[in, out]``.  ``ds_muon.muon_param_groups`` tags
them ``ds_muon.transposed`` so the default ``scale_mode="shape_scaling"`` factor
``sqrt(max(1, out/in))`` reads ``[out, in]``: ``c_fc`` (64->256) gets 2 and ``mlp.c_proj``
(256->64) gets 1.

Rank 0 prints one JSON line: the Trainer's logged losses, eval loss before/after,
``muon_home_ranks`` and the per-matrix scale factors applied.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_muon.rules.scaling import get_muon_scale_factor  # noqa: E402
from gpt import split, stdlib_bytes  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per process per step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    ap.add_argument("--adam-lr", type=float, default=3e-3,
                    help="learning rate of the AdamW group (3e-3, not ds_muon's default 3e-4: tuned so this tiny "
                         "model's embeddings learn within a short run)")
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--fsdp2", action="store_true", help="shard with FSDP2 (fully_shard per GPT2Block, then the root)")
    ap.add_argument("--deepspeed", default=None,
                    help="DeepSpeed JSON config with a \"type\": \"DsMuon\" entry (configs/deepspeed/zero{2,3}.json; "
                         "its train_micro_batch_size_per_gpu must equal --micro-batch)")
    ap.add_argument("--output-dir", default="runs/hf_trainer")
    args = ap.parse_args(argv)
    for name in ("steps", "micro_batch", "seq_len", "eval_samples", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (args.lr >= 0 and args.adam_lr >= 0):
        ap.error("--lr and --adam-lr must be >= 0")
    return args


class ByteWindows(Dataset):
    """Causal-LM examples: ``seq`` bytes at seeded offsets; GPT-2 shifts the labels itself."""

    def __init__(self, data: torch.Tensor, seq: int, n: int, seed: int):
        self.data, self.seq = data, seq
        self.starts = torch.randint(len(data) - seq, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        ids = self.data[self.starts[i]:self.starts[i] + self.seq]
        return {"input_ids": ids, "labels": ids}


def muon_scale_factors(model, groups, shapes):
    """The factor Muon applies to each matrix of the groups (what ``Muon`` computes), from the whole
    ``(rows, cols)`` by name and the model's own tensors' tags (the groups may hold shards or
    DeepSpeed's flat partitions)."""
    from ds_muon.tensors.tag_keys import is_transposed

    params = dict(model.named_parameters())
    out = {}
    for g in groups:
        if g["use_muon"]:
            for name in g["param_names"]:
                rows, cols = shapes[name]
                out[name] = get_muon_scale_factor(*((cols, rows) if is_transposed(params[name]) else (rows, cols)))
    return out


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from ds_muon.trainer import MuonTrainer

    on_cpu = not torch.cuda.is_available()
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1  # torchrun / accelerate launch
    stack = {}
    if args.fsdp2:
        stack = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "reshard_after_forward": True})
    elif args.deepspeed:
        stack = dict(deepspeed=args.deepspeed)
    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
        per_device_eval_batch_size=args.micro_batch, logging_steps=1, save_strategy="no", report_to="none",
        seed=args.seed, data_seed=args.seed, dataloader_num_workers=0, disable_tqdm=True, eval_on_start=True,
        use_cpu=on_cpu, ddp_backend="gloo" if on_cpu and launched else None, **stack,
    )
    torch.manual_seed(args.seed)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=args.seq_len,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    shapes = {n: (p.shape[0], p[0].numel()) for n, p in model.named_parameters() if p.ndim >= 2}

    train_data, eval_data = split(stdlib_bytes())
    world = targs.world_size
    train = ByteWindows(train_data, args.seq_len, args.steps * args.micro_batch * world, args.seed + 1)
    evalset = ByteWindows(eval_data, args.seq_len, args.eval_samples, 1234)
    trainer = MuonTrainer(model=model, args=targs, train_dataset=train, eval_dataset=evalset,
                          muon_settings=dict(lr=args.lr, adam_lr=args.adam_lr))

    trainer.train()  # evaluates first (eval_on_start), once the model is wrapped
    initial_eval = next(r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r)
    final_eval = trainer.evaluate()["eval_loss"]
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    muon = trainer.muon
    scales = muon_scale_factors(trainer.model, muon.param_groups, shapes)
    homes = sorted({h for ex in muon.exchanges() for hs in ex.homes.values() for h in hs})
    wrapped = type(trainer.model_wrapped).__name__
    summary = {"script": "hf_trainer", "world": world, "wrapped_in": wrapped, "steps": trainer.state.global_step, "train_losses": losses,
               "initial_eval_loss": initial_eval, "final_eval_loss": final_eval, "muon_home_ranks": homes,
               "muon_scale_factors": scales}
    if trainer.is_world_process_zero():
        print(json.dumps(summary), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
    # like train_gpt.py: gloo can abort ("terminate called without an active exception") while the
    # interpreter tears down its threads after a finished run; everything is flushed and shut down here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
