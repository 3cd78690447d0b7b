"""Shared by the benchmark scripts: timing, the machine line, and table printing."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import Callable, List, Sequence

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # dist_harness: spawn gloo ranks with timeouts
sys.path.insert(0, os.path.join(ROOT, "examples"))  # gpt: the demo model


def median_seconds(fn: Callable[[], object], repeats: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


GEMM_SIZE = 2048  # the reference GEMM: large enough to run at the machine's matmul rate


def gemm_timer(dtype: torch.dtype, size: int = GEMM_SIZE, device="cpu"):
    """(timer, FLOPs): ``timer()`` runs one size² × size² GEMM in ``dtype`` and returns its process CPU seconds.
    FLOPs over those seconds is the machine's matmul rate at that moment. Time it in the same rounds as what
    it prices, because the rate swings 2-3× between minutes on a shared box. NS FLOPs at this rate are about
    the floor under any exact form of the iteration: the bank's stacks' bare products ran at 0.99-1.03 of it
    in bf16 on the AMD EPYC (``ns_roofline.py``, "bare bmm/GEMM")."""
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    torch.mm(a, b)  # warm-up

    def timer() -> float:
        c0 = time.process_time()
        torch.mm(a, b)
        return time.process_time() - c0

    return timer, 2.0 * size ** 3


def header(title: str) -> None:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"# {title}")
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads in this process")
    print()


def table(headers: Sequence[str], rows: List[Sequence[object]]) -> None:
    """A Markdown table, so output pastes straight into docs/PERFORMANCE.md."""
    cells = [[str(c) for c in headers]] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    fmt = lambda row: "| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    print(fmt(cells[0]))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        print(fmt(row))
    print()


def fsdp2_gpt(world: int, d: int, layers: int, seq: int = 128):
    """The demo's GPT (examples/gpt.py), each block and the root under ``fully_shard`` on a CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gpt import GPT

    torch.manual_seed(0)
    model = GPT(d=d, layers=layers, seq=seq)
    mesh = init_device_mesh("cpu", (world,))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def timed_iterations(model, opt, rank: int, iters: int, warmup: int, counter: List[float] = None,
                     batch_size: int = 16, seq: int = 128) -> List[float]:
    """Train on the stdlib bytes; per iteration the slowest rank's forward + backward + step
    seconds, step() seconds, and what ``counter[0]`` gathered (reset each iteration).
    Returns the medians after ``warmup`` iterations."""
    import torch.distributed as dist

    from gpt import batch, split, stdlib_bytes

    counter = counter if counter is not None else [0.0]
    data, _ = split(stdlib_bytes(1_000_000))
    g = torch.Generator().manual_seed(rank)
    rows = []
    for i in range(warmup + iters):
        x, y = batch(data, batch_size, seq, g)
        dist.barrier()
        counter[0] = 0.0
        t0 = time.perf_counter()
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        t = torch.tensor([t2 - t0, t2 - t1, counter[0]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= warmup:
            rows.append(t.tolist())
    return [statistics.median(c) for c in zip(*rows)]


def timed_steps(opt, set_grads: Callable[[int], None], steps: int, warmup: int):
    """Median ``opt.step()`` time of the slowest rank, ``(wall s, process CPU s)``; ``set_grads(s)``
    fills step ``s``'s gradients before it (outside the timing)."""
    import torch.distributed as dist

    wall, cpu = [], []
    for s in range(warmup + steps):
        set_grads(s)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        opt.step()
        t = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if s >= warmup:
            wall.append(t[0].item())
            cpu.append(t[1].item())
    return statistics.median(wall), statistics.median(cpu)
