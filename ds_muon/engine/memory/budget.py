"""How much memory a step may take beyond the optimizer's state, and how it keeps to it.

``torch.optim.Muon`` runs one matrix at a time: besides the momentum it holds one matrix's
Nesterov input, its cast and its NS workspace (about 3× the matrix) at once.  ds_muon batches
matrices of one shape into one NS call, so without a bound a step held every matrix's
Nesterov input, its home stacks and a batched NS workspace together (issue 25: 41 MiB of
transients for four 1024² matrices, against torch's 13).  The bound, :func:`budget_bytes`,
is the larger of the biggest matrix, :data:`FLOOR_BYTES` (below it batching costs nothing
worth counting) and 1/:data:`STATE_FRACTION` of the matrices' own bytes (what a 10 % margin
over torch's peak affords):

* :func:`split_by_bytes`: in one process (nothing to overlap with communication) a wave holds
  at most that many bytes of matrices, and each wave runs whole (inputs, NS, apply) before the
  next one starts;
* :class:`ChunkedNS`: a stack's NS runs in chunks whose workspace stays within it, each
  chunk's result written straight into the stack's own memory (NS is done reading it) by the
  last product itself where the matrices are wide (``newton_schulz(out=...)``).

Either way each matrix goes through the same NS call on the same inputs (NS treats every
matrix of a batch on its own), so results stay bitwise those of one whole batch.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

FLOOR_BYTES = 4 << 20  # waves and NS chunks this small are never split (a 1 MiB floor cut the demo GPT's step into 9 NS calls and ran it 1.28x torch.optim.Muon's CPU time; 4 MiB: 4 calls, 0.92-0.94x: docs/PERFORMANCE.md)
STATE_FRACTION = 32  # a wave may hold 1/32 of all matrices' bytes (NS workspace ~3x: < 10 % of the state)


def ns_workspace_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """What NS holds per matrix of a chunk besides its input, in ``dtype``: the standard iteration's cast
    and two X buffers (m·n each) with A and B (m², m the short side), or the Gram iteration's five m²
    and two m·n, whichever is more; an fp16 iteration's cast is fp32 (``newton_schulz.input_dtype``).
    (Counted before in the stack's dtype, 5 m·n of fp32 for a bf16 NS: twice too much, so a 256×1024
    stack ran one matrix per NS call, 1.08-1.20x torch's time where two per call took 0.92-1.06x.)"""
    from ...rules.newton_schulz import input_dtype

    rows, cols = shape
    long, short = max(rows, cols), min(rows, cols)
    elements = max(3 * long * short + 2 * short * short, 2 * long * short + 5 * short * short)
    cast_extra = long * short * (input_dtype(dtype).itemsize - dtype.itemsize)
    return elements * dtype.itemsize + cast_extra


def budget_bytes(matrix_bytes: Sequence[int]) -> int:
    """Bytes of matrices one wave (one process) or one NS chunk's workspace may take."""
    if not matrix_bytes:
        return FLOOR_BYTES
    return max(max(matrix_bytes), FLOOR_BYTES, sum(matrix_bytes) // STATE_FRACTION)


def split_by_bytes(waves: List[List[int]], nbytes: Sequence[int], budget: int) -> List[List[int]]:
    """Each wave cut into consecutive runs of at most ``budget`` bytes (``nbytes[i]`` of matrix
    ``i``; a matrix larger than the budget is a run of its own)."""
    out = []
    for wave in waves:
        cur, acc = [], 0
        for i in wave:
            if cur and acc + nbytes[i] > budget:
                out.append(cur)
                cur, acc = [], 0
            cur.append(i)
            acc += nbytes[i]
        if cur:
            out.append(cur)
    return out


class ChunkedNS:
    """A stack's NS settings (``ns.run``, ``ns.dtype``), run in chunks of whole matrices whose
    NS workspace stays within ``budget`` bytes; the stack is returned holding the results (in
    its own memory, reinterpreted where the result dtype is narrower)."""

    def __init__(self, ns, budget: int):
        self.ns, self.budget = ns, budget

    @property
    def dtype(self) -> torch.dtype:
        return self.ns.dtype

    def chunk(self, stack: torch.Tensor) -> int:
        return max(1, self.budget // ns_workspace_bytes(stack.shape[-2:], self.ns.dtype)) if len(stack) else 1

    def run(self, stack: torch.Tensor) -> torch.Tensor:
        out_dtype = self.ns.dtype
        if not stack.is_contiguous() or out_dtype.itemsize > stack.element_size():
            return self.ns.run(stack, max_chunk=self.chunk(stack))  # results wider than the stack: no room in it
        out = stack if out_dtype == stack.dtype else \
            stack.view(-1).view(torch.uint8)[:stack.numel() * out_dtype.itemsize].view(out_dtype).view(stack.shape)
        # each chunk's results land on bytes of matrices before its end only, all read already; the
        # last product writes them there itself (wide matrices), so nothing is copied back
        return self.ns.run(stack, out=out, max_chunk=self.chunk(stack))

    def __repr__(self) -> str:
        return f"ChunkedNS({self.ns!r}, budget={self.budget})"
