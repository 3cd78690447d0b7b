"""Spawn gloo (or, with DS_MUON_TEST_BACKEND=nccl, NCCL) worker processes for a test, with a hard timeout.

``run(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in each
process and returns the list of per-rank return values; an exception on any rank
fails the test with that rank's traceback, and a hang fails after ``timeout``.

The ranks are pooled: a spawned rank imports torch (and DeepSpeed, transformers...) once, which on a
2-core box costs 3-7 s per call, so a world of ranks with its process group stays up between calls
with the same world size and ``env``. Each call starts from what a fresh rank would see where a test can
tell: ``os.environ``, the warning filters (once-only warnings show again), one thread, fp32 default
dtype, grad mode on, accelerate's shared state cleared. A call that fails or times out retires its
pool, so the next call starts fresh ranks. ``run(..., fresh=True)`` or ``DS_MUON_FRESH_RANKS=1`` spawn
ranks for the one call, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import queue
import socket
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import global_state
import stress


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


def _join(rank, world, port, env):
    """This spawned rank's environment, one thread, and its place in the process group."""
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(stress.RANK_THREADS)  # 1 unless the stress mode asks for more (tests/stress.py)
    be = backend()
    if be == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(be, rank=rank, world_size=world)


def _entry(rank, world, port, fn, args, out, env):
    try:
        _join(rank, world, port, env)
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


def _spawned_run(fn, world_size, args, timeout, env):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, out, dict(env or {})), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        results, errors = _collect(out, procs, world_size, timeout, lambda message: message)
    finally:
        for p in procs:
            p.join(timeout=1)
            if p.is_alive():
                p.kill()
    return results, errors


def _collect(out, procs, world_size, timeout, unpack):
    """Every rank's ``(rank, ok, value)`` from ``out``; a dead rank or the deadline ends the wait."""
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"distributed test timed out after {timeout}s "
                               f"(ranks done: {sorted(results)}; errors: {len(errors)})")
        try:
            message = unpack(out.get(timeout=min(left, 1.0)))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in results]
            if dead and out.empty():
                time.sleep(0.5)
                if out.empty():
                    errors.append((dead[0], f"process exited with code {procs[dead[0]].exitcode} "
                                            "without reporting a result"))
                    break
            continue
        if message is None:  # a stale message of an earlier call
            continue
        rank, ok, value = message
        if ok:
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append((rank, value))
            # the other ranks may now hang in a collective; give them a moment, then stop
            deadline = min(deadline, time.monotonic() + 20)
    return results, errors


def _fresh_call_state(rank):
    """What a test can see of earlier calls in a pooled rank, put back as a fresh rank has it."""
    torch.set_num_threads(stress.RANK_THREADS)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:  # a singleton per process: each call builds its own Accelerator
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerate_state.GradientState._reset_state()
    warnings._filters_mutated()  # "default"/"once" warnings show again, as in a new process


def _pooled_entry(rank, world, port, tasks, out, env):
    try:
        _join(rank, world, port, env)
    except BaseException:  # noqa: BLE001
        out.put((None, rank, False, traceback.format_exc()))
        out.close()
        out.join_thread()
        os._exit(0)
    environ, filters = dict(os.environ), list(warnings.filters)
    while True:
        task = tasks.get()
        if task is None:
            break
        call, fn, args = task
        result = None
        try:
            _fresh_call_state(rank)
            before = global_state.snapshot(env=False)  # the environment is put back below
            result = fn(rank, world, *args)
            dist.barrier()
            leaked = global_state.changes(before, global_state.snapshot(env=False))
            if leaked:  # the next call in this rank would see it: fail the call that made it
                raise AssertionError(f"{getattr(fn, '__qualname__', fn)} left process-wide state changed in a "
                                     f"pooled rank (a fresh rank would not see it):\n{leaked}")
            buf = io.BytesIO()
            torch.save(result, buf)
            out.put((call, rank, True, buf.getvalue()))
        except BaseException:  # noqa: BLE001 - a failed call retires the pool: its state is unknown
            out.put((call, rank, False, traceback.format_exc()))
            break
        finally:
            os.environ.clear()
            os.environ.update(environ)
            warnings.filters[:] = filters
            result = None
            gc.collect()
    out.close()
    out.join_thread()
    os._exit(0)


class _Pool:
    """``world`` ranks spawned once, with their process group, taking one call after another."""

    def __init__(self, world, env):
        ctx = mp.get_context("spawn")
        self.world, self.calls = world, 0
        self.out = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [ctx.Process(target=_pooled_entry, args=(r, world, port, self.tasks[r], self.out, dict(env)),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def call(self, fn, args, timeout):
        self.calls += 1
        for q in self.tasks:
            q.put((self.calls, fn, args))
        call = self.calls

        def unpack(message):
            got, rank, ok, value = message
            if got is None:  # the process group did not come up
                return rank, False, value
            return (rank, ok, value) if got == call else None

        return _collect(self.out, self.procs, self.world, timeout, unpack)

    def close(self):
        for q in self.tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()


_POOLS: dict = {}  # (world size, env) -> _Pool, least recently used first
_POOLED_RANKS = 8  # ranks kept alive at most (each holds torch and what the tests imported)


def _pool(world_size, env):
    key = (world_size, tuple(sorted(env.items())))
    pool = _POOLS.pop(key, None)
    if pool is None:
        while _POOLS and sum(p.world for p in _POOLS.values()) + world_size > _POOLED_RANKS:
            _POOLS.pop(next(iter(_POOLS))).close()
        pool = _Pool(world_size, env)
    _POOLS[key] = pool
    return key, pool


@atexit.register
def close_pools():
    while _POOLS:
        _POOLS.popitem()[1].close()


def run(fn, world_size: int, *args, timeout: float = 180.0, env=None, fresh: bool = False):
    if fresh or os.environ.get("DS_MUON_FRESH_RANKS") == "1":
        results, errors = _spawned_run(fn, world_size, args, timeout, env)
    else:
        key, pool = _pool(world_size, dict(env or {}))
        try:
            results, errors = pool.call(fn, args, timeout)
        except BaseException:
            _POOLS.pop(key, None)
            pool.close()
            raise
        if errors:
            _POOLS.pop(key, None)
            pool.close()
    if errors:
        rank, tb = sorted(errors)[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    return [results[r] for r in range(world_size)]
