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
