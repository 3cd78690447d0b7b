"""Train the stdlib GPT (examples/gpt.py) with ds_muon through ``accelerate.Accelerator``.

    accelerate launch --config_file configs/accelerate/fsdp2.yaml examples/accelerate_train.py
    accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml examples/accelerate_train.py
    accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml examples/accelerate_train.py

Run from the repository root (the DeepSpeed configs name their JSON files relative to it).
The same files run on GPUs (NCCL) and on CPUs (gloo); see docs/ACCELERATE.md.

* FSDP2: the optimizer is built on the plain model and ``accelerator.prepare`` swaps its
  parameters for the sharded DTensors.  On CPU accelerate silently turns FSDP into DDP,
  so there (only there) the script applies ``fully_shard`` itself, with the wrap policy
  and ``reshard_after_forward`` of the launch config, and prepares only the optimizer and
  the data loader.
* DeepSpeed: the JSON config carries the ``"type": "DsMuon"`` optimizer entry.
  ``ds_muon.deepspeed.optimizer_from_config`` turns it into a ``ds_muon.Muon`` and
  removes it from the config accelerate hands to DeepSpeed (accelerate refuses an
  optimizer in both places); after ``prepare``, ``ds_muon.integrations.deepspeed.bind(engine)`` tells the
  Muon where ZeRO put each matrix.

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


def make_accelerator():
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    if torch.cuda.is_available():
        return Accelerator()
    # CPU only (the launch configs say use_cpu: false so that they work unchanged on GPUs):
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        # accelerate's DeepSpeed path exists only with cpu=False, where it would pick NCCL: ask for gloo
        return Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    # everything else: accelerate's multi-process CPU mode (gloo, data loader sharded over ranks)
    return Accelerator(cpu=True)


def fsdp_requested_but_not_applied(accelerator) -> bool:
    """accelerate only honours an FSDP launch config on accelerators; on CPU it falls back to DDP."""
    from accelerate.utils import DistributedType

    return (os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
            and accelerator.distributed_type != DistributedType.FSDP)


def fully_shard_on_cpu(accelerator, model):
    """CPU-only workaround: FSDP2 the way accelerate's ``fsdp2_prepare_model`` would do it.

    Reads the launch config's FSDP settings (wrap policy, ``reshard_after_forward``) from the
    same environment accelerate reads, shards the matching modules bottom-up and then the root.
    """
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    plugin = FullyShardedDataParallelPlugin()  # from ACCELERATE_USE_FSDP / FSDP_* set by accelerate launch
    if plugin.fsdp_version != 2:
        raise SystemExit(f"accelerate_train.py: the launch config asks for FSDP{plugin.fsdp_version}; on CPU this "
                         "example can only stand in for FSDP2 (fsdp_version: 2, configs/accelerate/fsdp2.yaml)")
    if accelerator.mixed_precision != "no":
        raise SystemExit(f"accelerate_train.py: mixed_precision={accelerator.mixed_precision!r} with FSDP2 on CPU is "
                         "not supported by this example's workaround; use mixed_precision: 'no' on CPU")
    if os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
        raise SystemExit("accelerate_train.py: fsdp_offload_params has nothing to offload to on CPU; set it to false")
    mesh = init_device_mesh("cpu", (accelerator.num_processes,))
    plugin.set_auto_wrap_policy(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    kw = {"mesh": mesh, "reshard_after_forward": plugin.reshard_after_forward}
    for module in reversed(list(model.modules())[1:]):  # children before parents, the root last
        if policy is not None and policy(module):
            fully_shard(module, **kw)
    fully_shard(model, **kw)
    return model


def deepspeed_muon(accelerator, model, args):
    """The Muon for accelerate's DeepSpeed path, from the config's ``"type": "DsMuon"`` entry.

    accelerate refuses an optimizer both in the config and in ``prepare``; the entry is
    turned into a ``ds_muon.Muon`` and removed from the config accelerate hands to
    DeepSpeed (in place: accelerate keeps that dict).  Without an entry, ds_muon's
    default groups are used.
    """
    plugin = accelerator.state.deepspeed_plugin
    cfg = plugin.deepspeed_config
    opt_entry = cfg.get("optimizer")
    if opt_entry is not None and not ds_muon.deepspeed.is_dsmuon_entry(cfg):
        raise SystemExit(f"accelerate_train.py trains with ds_muon but the DeepSpeed config names the optimizer "
                         f"{opt_entry.get('type')!r}; use \"type\": \"DsMuon\" or remove the entry")
    if opt_entry is not None:  # command-line learning rates override the entry's
        params = dict(opt_entry.get("params") or {})
        params.update({k: v for k, v in (("lr", args.lr), ("adam_lr", args.adam_lr)) if v is not None})
        cfg["optimizer"] = {**opt_entry, "params": params}
    new_cfg, muon = ds_muon.deepspeed.optimizer_from_config(model, cfg)
    if muon is None:
        muon = plain_muon(model, args)
    # the data loader fixes the micro-batch; keep the config consistent with it
    new_cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
    new_cfg.pop("train_batch_size", None)
    cfg.clear()
    cfg.update(new_cfg)
    return muon


def plain_muon(model, args):
    """ds_muon's default groups; ``--lr``/``--adam-lr`` override the library defaults (0.02, 3e-4)."""
    given = {k: v for k, v in (("lr", args.lr), ("adam_lr", args.adam_lr)) if v is not None}
    return ds_muon.Muon(ds_muon.muon_param_groups(model, **given))


def find_muon(opt):
    while opt is not None and not isinstance(opt, ds_muon.Muon):
        opt = getattr(opt, "optimizer", None)
    return opt


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from accelerate.utils import DistributedType

    accelerator = make_accelerator()
    world, rank = accelerator.num_processes, accelerator.process_index
    dist_type = accelerator.distributed_type
    train_data, eval_data = split(stdlib_bytes())

    torch.manual_seed(args.seed)
    model = GPT(d=args.width, layers=args.layers, heads=args.heads, seq=args.seq_len)
    loader = DataLoader(Windows(train_data, args.seq_len, args.steps * args.micro_batch * world, args.seed + 1),
                        batch_size=args.micro_batch, shuffle=False)

    cpu_fsdp2 = fsdp_requested_but_not_applied(accelerator)
    engine = None
    if dist_type == DistributedType.DEEPSPEED:
        muon = deepspeed_muon(accelerator, model, args)
        model, opt, loader = accelerator.prepare(model, muon, loader)
        engine = model  # the DeepSpeedEngine
        ds_muon.integrations.deepspeed.bind(engine)
    elif cpu_fsdp2:
        model = fully_shard_on_cpu(accelerator, model)
        muon = plain_muon(model, args)
        # the model is not handed to prepare: on CPU accelerate would wrap it in DDP on top of FSDP2
        opt, loader = accelerator.prepare(muon, loader)
    else:  # FSDP2 on accelerators (prepare swaps the Muon's parameters for DTensors), DDP, one process
        muon = plain_muon(model, args)
        model, opt, loader = accelerator.prepare(model, muon, loader)
    if find_muon(opt) is not muon:
        raise RuntimeError(f"accelerate wrapped the optimizer as {type(opt).__name__} without the ds_muon.Muon inside")

    fsdp2 = cpu_fsdp2 or accelerator.is_fsdp2
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
        "fsdp2": fsdp2, "fsdp2_cpu_workaround": cpu_fsdp2, "world": world, "steps": len(losses),
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
