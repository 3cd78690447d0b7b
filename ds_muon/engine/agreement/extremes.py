"""Each tensor's (min, max) for many tensors at once: the agreement's fingerprints and finite check.

One ``aminmax`` per tensor costs a few microseconds of host time each, more than the work
on a small gradient.  Small tensors are instead copied into a kept scratch buffer (one
``torch._foreach_copy_`` per chunk) and reduced per segment (``torch.segment_reduce``,
min and max): a handful of calls for any number of tensors.  Large ones are reduced on
their own (the call costs nothing next to their size).  Min and max do not round, so
the values are those ``aminmax`` gives, NaN and ±inf included.

On CPU, ``segment_reduce`` is a scalar loop (~3.5 ns per element and reduction against
~0.2 for a whole-tensor ``aminmax``), so there only tensors of up to ``CPU_BULK_NUMEL``
elements are packed (the crossover with one ``aminmax`` per tensor, ~3 µs of host time, is
near 500 elements on an EPYC): the demo GPT's 45 local gradients (0.44 M elements) took
3.0 ms packed and take 0.2 ms one by one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch

from ..memory.lending import give_back_all, take, take_all

BULK_NUMEL = 1 << 16  # tensors up to this size are reduced together (off the CPU)
CPU_BULK_NUMEL = 512  # ... and on the CPU, whose segment_reduce is slow per element
CHUNK_NUMEL = 1 << 22  # elements reduced per segment_reduce call (the scratch buffer's size bound)
PLANS_KEPT = 4  # packings kept (the set of gradients may change between steps)


class _Chunk:
    """Tensors (by position) packed end to end into one scratch buffer, with views made once."""

    def __init__(self, scratch: torch.Tensor, positions: List[int], shapes: List[torch.Size]):
        numels = [s.numel() for s in shapes]
        total = sum(numels)
        self.positions = positions
        self.scratch = scratch  # its memory is lent only while the extremes are taken (ds_muon.engine.memory.lending)
        self.where = torch.tensor(positions, dtype=torch.int64, device=scratch.device)
        self.data = scratch[:total]
        self.views = [v.view(s) for v, s in zip(self.data.split(numels), shapes)]
        self.lengths = torch.tensor(numels, dtype=torch.int64, device=scratch.device)
        self.everything = False  # all the tensors, in order (set by the plan)


class Extremes:
    """``extremes(tensors)``: ``[n, 2]`` (min, max) of each (non-empty) tensor, in order, in
    the tensors' promoted dtype.  The packing is planned once per list of shapes and dtypes;
    one scratch buffer per dtype and device (at most ``CHUNK_NUMEL`` elements) is kept, its memory
    lent only while a call runs."""

    def __init__(self):
        self._plans: "OrderedDict[tuple, tuple]" = OrderedDict()  # least recently used first
        self._scratch: Dict[tuple, torch.Tensor] = {}

    def clear(self) -> None:
        self._plans.clear()
        self._scratch.clear()

    def __call__(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        key = tuple((t.shape, t.dtype) for t in tensors)  # (a tensor on another device is still copied right)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(tensors)
            if len(self._plans) > PLANS_KEPT:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        dtype, chunks, alone, alone_at = plan
        out = torch.empty((len(tensors), 2), dtype=dtype, device=tensors[0].device if tensors else "cpu")
        take_all(chunk.scratch for chunk in chunks)
        for chunk in chunks:
            torch._foreach_copy_(chunk.views, tensors if chunk.everything else [tensors[k] for k in chunk.positions])
            out[chunk.where, 0] = torch.segment_reduce(chunk.data, "min", lengths=chunk.lengths).to(dtype)
            out[chunk.where, 1] = torch.segment_reduce(chunk.data, "max", lengths=chunk.lengths).to(dtype)
        if alone_at is not None:  # one stack and one write for all of them (stack promotes: exact)
            pairs = [x for k in alone for x in torch.aminmax(tensors[k])]
            out[alone_at] = torch.stack(pairs).view(len(alone), 2).to(dtype)
        else:  # on several devices: row by row (each row copied across)
            for k in alone:
                out[k] = torch.stack(torch.aminmax(tensors[k])).to(dtype)
        give_back_all(chunk.scratch for chunk in chunks)  # a copy of the gradients: not kept between steps
        return out

    def _plan(self, tensors: List[torch.Tensor]) -> Tuple[torch.dtype, List[_Chunk], List[int], Optional[torch.Tensor]]:
        dtype = tensors[0].dtype if tensors else torch.float32
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        devices = {t.device for t in tensors}
        alone, packs = [], {}
        for k, t in enumerate(tensors):
            bulk = CPU_BULK_NUMEL if t.device.type == "cpu" else BULK_NUMEL
            if t.numel() > bulk or len(devices) > 1:
                alone.append(k)
            else:
                packs.setdefault((t.dtype, t.device), []).append(k)
        chunks = []
        for (dt, device), ks in packs.items():
            size = min(CHUNK_NUMEL, sum(tensors[k].numel() for k in ks))
            scratch = self._scratch.get((dt, device))
            if scratch is None or scratch.numel() < size:
                scratch = self._scratch[(dt, device)] = torch.empty(size, dtype=dt, device=device)
            take(scratch)  # views are cut while its memory is there
            start, used = 0, 0
            for j, k in enumerate(ks + [None]):
                n = tensors[k].numel() if k is not None else 0
                if k is None or used + n > CHUNK_NUMEL:
                    if j > start:
                        chunks.append(_Chunk(scratch, ks[start:j], [tensors[q].shape for q in ks[start:j]]))
                    start, used = j, 0
                used += n
        if len(chunks) == 1 and chunks[0].positions == list(range(len(tensors))):
            chunks[0].everything = True
        alone_at = None
        if alone and len(devices) == 1:
            alone_at = torch.tensor(alone, dtype=torch.int64, device=tensors[0].device)
        return dtype, chunks, alone, alone_at
