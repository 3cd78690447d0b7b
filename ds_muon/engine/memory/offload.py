"""Optimizer state in host memory, Newton–Schulz on the accelerator.

Under ZeRO-Offload (``offload_optimizer: {device: cpu}``) and FSDP2's ``CPUOffloadPolicy``
the tensors Muon steps (fp32 partitions, shards) and so its momentum and AdamW moments
live in host memory.  Momentum, AdamW and the final update stay there; only the NS work
moves:

* :func:`exchange_device`: where an exchange's buffers live.  Host pieces over a
  backend that moves host tensors (gloo, or a group of one rank): on the host, and the
  stacks a home assembles go to the accelerator in chunks (:func:`run_ns`).  Over NCCL
  (device tensors only): on the accelerator, so each rank's own pieces cross to the
  device once when packed and the results come back once when applied.
* :func:`run_ns`: NS on a host stack, in chunks of whole matrices: chunk k+1 is copied
  host→device on one stream and chunk k-1 device→host on another while chunk k runs NS,
  through two pinned staging slots each way.  Device scratch memory is bounded by
  :func:`scratch_bytes` ≤ 256 MiB (``DEFAULT_SCRATCH_BYTES``; set ``ds_muon.engine.memory.offload.SCRATCH_BYTES``
  to change it), unless one matrix alone needs more: then chunks hold one matrix.
  Without an accelerator NS runs on whole stacks where they are (nothing to bound); with
  ``SCRATCH_BYTES`` set, the same chunk loop runs on the host and copies nothing.

Every chunk is orthogonalized by the same call on the same device as the whole stack
would be (NS treats each matrix of a batch on its own), so results do not depend on
where the state lives.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist

DEFAULT_SCRATCH_BYTES = 256 * 2**20  # device memory one NS call on offloaded stacks may use
# Set to a number of bytes to chunk by it everywhere, on the host too (where tests exercise the
# pipeline's loop); None: DEFAULT_SCRATCH_BYTES on an accelerator, whole stacks without one.
SCRATCH_BYTES: Optional[int] = None
NS_WORKSPACE = 8  # NS temporaries per matrix, in elements of the matrix (input cast, X, two buffers, A, B, output)


def accelerator() -> Optional[torch.device]:
    """The current accelerator (CUDA), or None on a CPU-only machine."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def moves_host_tensors(group) -> bool:
    """Can ``group``'s collectives move host tensors (gloo), or is there nothing to move (one rank)?"""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return True
    return "gloo" in str(dist.get_backend(group)).lower()


def exchange_device(host: torch.device, group) -> torch.device:
    """Where an exchange of pieces held on ``host`` keeps its buffers (see the module docstring)."""
    acc = accelerator()
    if host.type != "cpu" or acc is None or moves_host_tensors(group):
        return host
    return acc


def scratch_bytes(numel: int, count: int, in_itemsize: int, out_itemsize: int) -> int:
    """Device bytes one chunk of ``count`` matrices of ``numel`` elements may occupy: two input
    slots, two result slots (the pipeline's depth) and one chunk's NS workspace."""
    per_matrix = numel * (2 * in_itemsize + 2 * out_itemsize + NS_WORKSPACE * max(in_itemsize, out_itemsize))
    return per_matrix * count


def chunk_matrices(stack: torch.Tensor, out_dtype: torch.dtype, budget: Optional[int] = None) -> int:
    """How many matrices of ``stack`` one chunk holds so that :func:`scratch_bytes` stays within
    ``budget`` (default ``SCRATCH_BYTES`` or ``DEFAULT_SCRATCH_BYTES``; at least one)."""
    if budget is None:
        budget = SCRATCH_BYTES if SCRATCH_BYTES is not None else DEFAULT_SCRATCH_BYTES
    per = scratch_bytes(stack[0].numel(), 1, stack.element_size(), out_dtype.itemsize) if len(stack) else 1
    return max(1, min(len(stack), budget // max(per, 1)))


def run_ns(run: Callable[[torch.Tensor], torch.Tensor], stack: torch.Tensor, out_dtype: torch.dtype,
           device: Optional[torch.device] = None, budget: Optional[int] = None) -> torch.Tensor:
    """``run`` (NS on a batch ``[k, rows, cols]``) over ``stack`` in chunks on ``device``
    (default :func:`accelerator`, else the stack's own); the result is on the stack's device."""
    device = device if device is not None else (accelerator() or stack.device)
    if torch.device(device) == stack.device and budget is None and SCRATCH_BYTES is None:
        return run(stack)  # no device memory to bound: the whole stack where it is
    chunk = chunk_matrices(stack, out_dtype, budget)
    if chunk >= len(stack) and torch.device(device) == stack.device:
        return run(stack)  # one chunk, nothing to copy
    bounds = [(k, min(k + chunk, len(stack))) for k in range(0, len(stack), chunk)]
    if torch.device(device).type == "cuda" and stack.device.type == "cpu":
        return _pipelined(run, stack, out_dtype, torch.device(device), bounds)
    out = torch.empty(stack.shape, dtype=out_dtype, device=stack.device)
    for k0, k1 in bounds:  # same device: the chunk loop, no copies
        out[k0:k1].copy_(run(stack[k0:k1]))
    return out


def _pipelined(run, stack: torch.Tensor, out_dtype: torch.dtype, device: torch.device, bounds: List[tuple]):
    """Host→device, NS, device→host for each chunk, on three streams, two slots each way."""
    size = bounds[0][1] - bounds[0][0]
    shape = (size,) + tuple(stack.shape[1:])
    stage_in = [torch.empty(shape, dtype=stack.dtype, pin_memory=True) for _ in range(2)]
    stage_out = [torch.empty(shape, dtype=out_dtype, pin_memory=True) for _ in range(2)]
    dev_in = [torch.empty(shape, dtype=stack.dtype, device=device) for _ in range(2)]
    out = torch.empty(stack.shape, dtype=out_dtype)
    main = torch.cuda.current_stream(device)
    h2d, d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)
    copied_in: List[Optional[torch.cuda.Event]] = [None, None]  # slot's H2D done (its pinned input is free)
    consumed: List[Optional[torch.cuda.Event]] = [None, None]  # NS done reading the slot's device input
    copied_out: List[Optional[torch.cuda.Event]] = [None, None]  # slot's D2H done (its pinned result is ready)

    def drain(c):
        s = c % 2
        k0, k1 = bounds[c]
        copied_out[s].synchronize()
        out[k0:k1].copy_(stage_out[s][:k1 - k0])

    for c, (k0, k1) in enumerate(bounds):
        s, m = c % 2, k1 - k0
        if copied_in[s] is not None:
            copied_in[s].synchronize()
        stage_in[s][:m].copy_(stack[k0:k1])
        with torch.cuda.stream(h2d):
            if consumed[s] is not None:
                h2d.wait_event(consumed[s])
            dev_in[s][:m].copy_(stage_in[s][:m], non_blocking=True)
            copied_in[s] = h2d.record_event()
        main.wait_event(copied_in[s])
        result = run(dev_in[s][:m])
        consumed[s] = main.record_event()
        if c >= 2:
            drain(c - 2)  # the slot's pinned result is read before it is written again
        with torch.cuda.stream(d2h):
            d2h.wait_event(consumed[s])
            stage_out[s][:m].copy_(result, non_blocking=True)
            result.record_stream(d2h)
            copied_out[s] = d2h.record_event()
    for c in range(max(0, len(bounds) - 2), len(bounds)):
        drain(c)
    return out


def host_state(param: torch.Tensor, offload: bool = False) -> bool:
    """Are ``param``'s pieces (and optimizer state) offloaded to host memory?  ``offload``: the
    stack said so (DeepSpeed's ``offload_optimizer``); an FSDP2 shard on the host of a mesh on
    an accelerator is one (``CPUOffloadPolicy``)."""
    if offload:
        return True
    mesh = getattr(param, "device_mesh", None)
    if mesh is None or mesh.device_type == "cpu" or not hasattr(param, "to_local"):
        return False
    return param.to_local().device.type == "cpu"


class HostNS:
    """A stack's NS settings, run by :func:`run_ns` (chunked, on the accelerator when there is
    one) on stacks assembled in host memory.  Has the ``run`` of the settings it wraps."""

    def __init__(self, ns, budget: Optional[int] = None):
        self.ns, self.budget = ns, budget

    def run(self, stack: torch.Tensor) -> torch.Tensor:
        return run_ns(self.ns.run, stack, self.ns.dtype, budget=self.budget)

    def __repr__(self) -> str:
        return f"HostNS({self.ns!r}, budget={self.budget})"
