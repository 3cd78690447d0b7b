"""The parity stress mode (issue 51): the suite's sharded-vs-one-process tests under a busy machine and at
other thread counts, opt-in:

    DS_MUON_STRESS_LOAD=N            N busy processes (default: one per core) beside the whole session, each
                                     running fp32 and bf16 matmuls on one thread without pause
    DS_MUON_STRESS_RANK_THREADS=k    every spawned rank runs k torch threads (the one-process references stay
                                     at one): what the README's "one thread per process" promise rests on

    DS_MUON_STRESS_LOAD=2 python -m pytest tests -k "single_process or one_process or bitwise or parity or equals"

A kernel whose bits followed the load (a blocking or an algorithm picked by timing) would fail under the
load; one whose bits follow the thread count fails under the second.  docs/ADVANCED.md, "Bitwise: under load
and at other thread counts", has what each held.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os

RANK_THREADS = int(os.environ.get("DS_MUON_STRESS_RANK_THREADS", "1"))


def _busy(stop) -> None:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(384, 384), torch.randn(384, 384, dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(20):
            a = torch.tanh(a @ a)
            b = torch.tanh(b @ b)


@contextlib.contextmanager
def load():
    """``DS_MUON_STRESS_LOAD`` busy processes for the block (none when it is unset)."""
    n = os.environ.get("DS_MUON_STRESS_LOAD")
    if not n:
        yield 0
        return
    count = int(n) if n.isdigit() and int(n) > 0 else (os.cpu_count() or 1)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_busy, args=(stop,), daemon=True) for _ in range(count)]
    for p in procs:
        p.start()
    try:
        yield count
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
