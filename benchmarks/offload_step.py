"""Optimizer-state offload: step time with and without it, and where the optimizer's memory lives.

One spawned run (W ranks, gloo on CPU; on a GPU machine set DS_MUON_TEST_BACKEND=nccl and
DS_ACCELERATOR=cuda) builds a DeepSpeed ZeRO-2 engine through the DsMuon entry with and
without ``offload_optimizer: {device: cpu, pin_memory: true}`` and prints, side by side:
median wall and process CPU time of ``engine.step()`` (the optimizer step), the optimizer
state bytes on the device and on the host, and on CUDA the peak device memory the step
allocates above what it started with.  Then the NS pipeline of ds_muon.engine.memory.offload on one stack
of same-shape matrices: whole vs chunked (on CPU: the chunk loop's overhead only).

    DS_ACCELERATOR=cpu python benchmarks/offload_step.py [--dim 512] [--layers 4] [--world 2]
    python benchmarks/offload_step.py --device cuda --world 1     # one GPU
"""

import argparse
import os
import statistics
import time

import torch
from torch import nn

from common import header, table


class Net(nn.Module):
    def __init__(self, dim, layers, vocab=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                    for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for b in self.blocks:
            h = h + b(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1).float(), tokens.roll(-1, 1).flatten())


def _worker(rank, world, dim, layers, steps):
    from ds_muon import deepspeed as dsm

    rows = []
    for offload in (False, True):
        torch.manual_seed(0)
        zero = {"stage": 2}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": zero,
               "optimizer": {"type": "DsMuon", "params": {"lr": 0.02, "adam_lr": 3e-4, "ns_dtype": "bfloat16"}},
               "bf16": {"enabled": True}, "steps_per_print": 10**9}
        engine, _, _, _ = dsm.initialize(model=Net(dim, layers), config=cfg)
        cuda = engine.device.type == "cuda"
        walls, cpus, peaks = [], [], []
        for t in range(steps):
            g = torch.Generator().manual_seed(t)
            tokens = torch.randint(0, 256, (4, 128), generator=g).to(engine.device)
            engine.backward(engine(tokens))
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            w, c = time.perf_counter(), time.process_time()
            engine.step()
            if cuda:
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated() - base)
            walls.append(time.perf_counter() - w)
            cpus.append(time.process_time() - c)
        muon = engine.basic_optimizer
        state = [v for s in muon.state.values() for v in s.values() if torch.is_tensor(v)]
        on_dev = sum(v.numel() * v.element_size() for v in state if v.device.type != "cpu")
        on_host = sum(v.numel() * v.element_size() for v in state if v.device.type == "cpu")
        skip = min(2, steps - 1)  # first steps plan and allocate
        rows.append(("offload" if offload else "no offload", statistics.median(walls[skip:]) * 1e3,
                     statistics.median(cpus[skip:]) * 1e3, on_dev / 2**20, on_host / 2**20,
                     max(peaks[skip:]) / 2**20 if peaks else "n/a (CPU)"))
        del engine
    return rows


def ns_pipeline(count, rows_, cols, device="cpu"):
    from ds_muon.engine.plan.compile import NSSettings
    from ds_muon.engine.memory.offload import run_ns, scratch_bytes

    ns = NSSettings(5, "keller", torch.bfloat16, 1e-7, "standard")
    stack = torch.randn(count, rows_, cols)
    per = scratch_bytes(rows_ * cols, 1, 4, 2)
    out = []
    for label, budget in (("one chunk", 10**12), ("chunks of 4", 4 * per), ("chunks of 1", per)):
        times = []
        for _ in range(3):
            w, c = time.perf_counter(), time.process_time()
            run_ns(ns.run, stack, torch.bfloat16, device=torch.device(device), budget=budget)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - w, time.process_time() - c))
        wall, cpu = min(times)
        out.append((label, wall * 1e3, cpu * 1e3, min(count, budget // per) * per / 2**20))
    return out


def main():
    import dist_harness

    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="cuda: DeepSpeed on the GPU over NCCL (one GPU per rank: --world 1 on one GPU); "
                         "default: DS_ACCELERATOR, else cpu")
    args = ap.parse_args()
    device = args.device or ("cuda" if os.environ.get("DS_ACCELERATOR") == "cuda" else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("offload_step.py --device cuda: no CUDA device here")
    if device == "cuda" and args.world > torch.cuda.device_count():
        raise SystemExit(f"offload_step.py: --world {args.world} needs {args.world} GPUs, "
                         f"{torch.cuda.device_count()} here (NCCL runs one rank per GPU)")
    header(f"optimizer-state offload (DeepSpeed ZeRO-2, bf16, DsMuon, {device})")
    env = {"DS_ACCELERATOR": device, "TORCHDYNAMO_DISABLE": "1"}
    if device == "cuda":
        env["DS_MUON_TEST_BACKEND"] = "nccl"  # dist_harness: NCCL, one GPU per rank
    rows = dist_harness.run(_worker, args.world, args.dim, args.layers, args.steps, timeout=900, env=env)[0]
    print(f"model: {args.layers} blocks of Linear({args.dim}, {4 * args.dim}) + Linear({4 * args.dim}, {args.dim}), "
          f"W={args.world}, rank 0's numbers")
    table(["run", "step wall ms", "step CPU ms", "state on device MiB", "state on host MiB",
           "step peak device MiB"], rows)
    print("NS of 16 matrices 1024x4096 (bf16), stack in host memory (ds_muon.engine.memory.offload.run_ns):")
    table(["chunking", "wall ms", "CPU ms", "device scratch bound MiB"], ns_pipeline(16, 1024, 4096, device))


if __name__ == "__main__":
    main()
