"""Buffers kept across steps whose memory exists only while a step uses them.

A step reuses the same buffers every time (home stacks, send and receive buffers, Nesterov
inputs, the agreement's scratch) and the views cut from them once, because making the views
again costs host time per matrix.  Holding the buffers' memory between steps, though, made
ds_muon hold 2.5× what ``torch.optim.Muon`` holds (issue 25: four 1024² matrices, 40 MiB
against 16).  So the memory is given back when the stage that needs it is done (the storage
is resized to 0 bytes) and taken again at the next use (resized to its size): the tensor and
every view cut from it stay valid objects, as FSDP2 does with its unsharded parameters.  The
contents do not survive a give-back: every buffer lent this way is written before it is read.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

# DS_MUON_POISON_LENT=1: memory taken back is filled with 0xFF bytes (NaN in every float dtype) first, so a
# buffer read before it is written shows at once instead of reading whatever the allocator handed back
# (zero pages in a new process, an earlier call's data in a long-lived one): tests/test_lending.py.  Read at
# each take (a rank's environment may be set after import)
POISON_ENV = "DS_MUON_POISON_LENT"


def _need(t: torch.Tensor) -> int:
    return (t.storage_offset() + t.numel()) * t.element_size()


_poisoned = [0]  # takes poisoned in this process (a test reads it to know the check ran)


def take(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a contiguous tensor) with its storage's memory back, if it was given back."""
    s = t.untyped_storage()
    need = _need(t)
    if s.nbytes() < need:
        s.resize_(need)
        if os.environ.get(POISON_ENV) == "1":
            torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (s.nbytes(),)).fill_(255)
            _poisoned[0] += 1
    return t


def take_all(ts: Iterable[torch.Tensor]) -> None:
    for t in ts:
        take(t)


def give_back(t: torch.Tensor) -> None:
    """Free ``t``'s memory (its storage resized to 0 bytes); views of it stay, unusable until
    :func:`take`.  Call it only when nothing in flight (a collective, a kernel on another
    stream) still reads or writes the memory."""
    s = t.untyped_storage()
    if s.nbytes():
        s.resize_(0)


def give_back_all(ts: Iterable[torch.Tensor]) -> None:
    for t in ts:
        give_back(t)


def full_bytes(t: torch.Tensor) -> int:
    """The bytes ``t`` takes while in use, whether its memory is lent out now or not."""
    return _need(t)
