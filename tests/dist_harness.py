"""Spawn gloo (or, with DS_MUON_TEST_BACKEND=nccl, NCCL) worker processes for a test, with a hard timeout.

``run(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in each
process and returns the list of per-rank return values; an exception on any rank
fails the test with that rank's traceback, and a hang fails after ``timeout``.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@contextlib.contextmanager
def one_thread():
    """Run the block on one CPU thread, like every spawned rank: matmul blocking, and so the
    last bits of a result, follow the thread count (single-process references use this)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend() -> str:
    """gloo on CPU tensors unless a test opts into CUDA with DS_MUON_TEST_BACKEND=nccl."""
    return os.environ.get("DS_MUON_TEST_BACKEND", "gloo")


def _entry(rank, world, port, fn, args, out, env):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        be = backend()
        if be == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(be, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(result, buf)  # plain bytes: shared-memory tensors die with the process
        out.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        out.put((rank, False, traceback.format_exc()))
    out.close()
    out.join_thread()  # flush the result before the hard exit
    os._exit(0)  # gloo may abort at interpreter exit; results are already sent


def run(fn, world_size: int, *args, timeout: float = 180.0, env=None):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, out, dict(env or {})), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"distributed test timed out after {timeout}s "
                                   f"(ranks done: {sorted(results)}; errors: {len(errors)})")
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in results]
                if dead and out.empty():
                    time.sleep(0.5)
                    if out.empty():
                        errors.append((dead[0], f"process exited with code {procs[dead[0]].exitcode} "
                                                "without reporting a result"))
                        break
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append((rank, value))
                # the other ranks may now hang in a collective; give them a moment, then stop
                deadline = min(deadline, time.monotonic() + 20)
    finally:
        for p in procs:
            p.join(timeout=1)
            if p.is_alive():
                p.kill()
    if errors:
        rank, tb = sorted(errors)[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    return [results[r] for r in range(world_size)]
