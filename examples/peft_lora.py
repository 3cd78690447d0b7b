"""LoRA fine-tuning with ds_muon: a frozen tiny Llama classifier, LoRA on q/v/gate, the head trained whole.

    python examples/peft_lora.py                                              # one process
    torchrun --nproc_per_node 2 examples/peft_lora.py --stack ddp
    torchrun --nproc_per_node 2 examples/peft_lora.py --stack fsdp2 --bf16-base   # QLoRA-style bf16 base

The one line that differs from the same script with AdamW (docs/PEFT.md)::

    optimizer = ds_muon.Muon(ds_muon.peft.lora_param_groups(model, lr=0.02, adam_lr=3e-3))

``lora_A``/``lora_B`` take Muon, the trainable copy of the classifier head (``modules_to_save``)
AdamW; the frozen base is in no group.  The task: a sequence's label is its first token modulo 3.
Rank 0 prints one JSON line: losses, accuracy before/after, how many tensors took Muon / AdamW /
were frozen, and ``muon_home_ranks``.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch
import torch.distributed as dist

import ds_muon
import ds_muon.peft


def build(bf16_base: bool, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_labels=3,
                         pad_token_id=0)
    config._attn_implementation = "eager"
    base = LlamaForSequenceClassification(config)
    if bf16_base:
        base = base.to(torch.bfloat16)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"], modules_to_save=["score"],
                      task_type="SEQ_CLS")
    return get_peft_model(base, lora)


def batch(step: int, size: int):
    ids = torch.randint(1, 64, (size, 12), generator=torch.Generator().manual_seed(step))
    return ids, ids[:, 0] % 3


def accuracy(model, n: int = 256) -> float:
    ids, labels = batch(10_000, n)
    with torch.no_grad():
        return float((model(input_ids=ids).logits.argmax(-1) == labels).float().mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stack", default="single", choices=["single", "ddp", "fsdp2"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--bf16-base", action="store_true", help="the frozen base in bf16 (QLoRA-style)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    if args.stack != "single":
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0

    model = build(args.bf16_base, seed=0)
    before = accuracy(model)
    if args.stack == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif args.stack == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.get_base_model().model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    groups = ds_muon.peft.lora_param_groups(model, lr=0.02, adam_lr=3e-3)
    optimizer = ds_muon.Muon(groups, log_summary=False)

    losses = []
    for step in range(args.steps):
        ids, labels = batch(step * 100 + rank, args.batch)  # each rank its own batch
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    after = accuracy(model)
    homes = sorted({h for ex in optimizer.exchanges() for hs in ex.homes.values() for h in hs})
    counts = {"muon": sum(len(g["params"]) for g in groups if g["use_muon"]),
              "adamw": sum(len(g["params"]) for g in groups if not g["use_muon"]),
              "frozen": sum(not p.requires_grad for p in model.parameters())}
    if rank == 0:
        print(json.dumps({"script": "peft_lora", "stack": args.stack, "bf16_base": args.bf16_base,
                          "world": dist.get_world_size() if dist.is_initialized() else 1, "steps": len(losses),
                          "train_losses": losses, "accuracy_before": before, "accuracy_after": after,
                          "tensors": counts, "muon_home_ranks": homes}))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
