"""The agreement's table: one int64 row per tensor (and per group of copies, plus a stale row and a
settings row), written on the device and all-reduced once; then one code per row for the host.


Each rank contributes, per row, ``(1, h, h²)`` for a 16-bit hash ``h``; after the
sum, all contributions were equal exactly when ``n·Σh² == (Σh)²`` (equality in
Cauchy–Schwarz), in exact integer arithmetic for up to 2¹⁵ ranks.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .fingerprints import minmax_hash


# columns of the agreement table
HAS_GRAD, NO_GRAD, NONFINITE, N_HASHED, HASH, HASH_SQ = range(6)
COLUMNS = 6


def hashed_row(h: int) -> List[int]:
    row = [0] * COLUMNS
    row[N_HASHED], row[HASH], row[HASH_SQ] = 1, h, h * h
    return row


def hashes_differ(row: Sequence[int]) -> bool:
    """After the sum: did the ranks that hashed this row hash it differently?"""
    n, s, q = row[N_HASHED], row[HASH], row[HASH_SQ]
    return n > 1 and n * q != s * s


def _on_device(nrows: int, has: List[int], missing: List[int], extra: List[List[int]], checks: List[int],
               mm: Optional[torch.Tensor], hashed: List[int], stale, device: torch.device,
               copies: bool = False) -> torch.Tensor:
    """The agreement table on ``device``: ``nrows`` rows of tensors (``has``: rows with a gradient,
    ``missing``: without one) and the ``extra`` rows, with the finite flags, fingerprints
    and the stale flag written in on the device, so that reading the (reduced) table is the
    step's only wait for the device.  ``mm[j]`` is the (min, max) of row ``checks[j]``'s
    gradient, fingerprinted in row ``hashed[j]`` (-1: not); ``copies``: some of those rows are
    rows of groups of copies (not ``checks[j]`` itself)."""
    table = torch.cat([torch.zeros((nrows, COLUMNS), dtype=torch.int64), torch.tensor(extra, dtype=torch.int64)])
    if has:
        table[torch.tensor(has, dtype=torch.int64), HAS_GRAD] = 1
    if missing:
        table[torch.tensor(missing, dtype=torch.int64), NO_GRAD] = 1
    table = table.to(device, non_blocking=True)
    if checks:
        mm = mm.to(device)
        row = _host_to(device, checks)
        nonfinite = (~torch.isfinite(mm).all(dim=1)).to(torch.int64)
        table[row, NONFINITE] = nonfinite
        pick = [j for j, at in enumerate(hashed) if at >= 0]
        if pick:  # its gradient must be that of every rank holding it (whole, or a copy of the same shard)
            sub = _host_to(device, pick) if len(pick) < len(hashed) else None
            h = minmax_hash(mm if sub is None else mm[sub])
            if copies:  # rows of their own; a non-finite copy is reported as such, not as a difference
                at = _host_to(device, [hashed[j] for j in pick])
                table[at, NONFINITE] = nonfinite if sub is None else nonfinite[sub]
            else:
                at = row if sub is None else row[sub]
            table[at, N_HASHED] = 1
            table[at, HASH] = h
            table[at, HASH_SQ] = h * h
    if torch.is_tensor(stale):
        table[nrows, 0] = stale.to(device=device, dtype=torch.int64)
    else:
        table[nrows, 0] = int(stale)
    return table


# bits of each row's code in the summary the host reads (see _summary); the stale row's
# column FAILED_AT counts the ranks whose local checks failed (LocalFailure)
ACTIVE, CONFLICT, DRIFT, NONFINITE_BIT, STALE, FAILED = 1, 2, 4, 8, 1, 2
FAILED_AT = NO_GRAD


def _summary(table: torch.Tensor, nrows: int) -> torch.Tensor:
    """The reduced table as one code per row, computed on its device: ACTIVE (a gradient on some
    rank), CONFLICT (a gradient on some ranks, none on others), DRIFT (the ranks that hashed the
    row hashed it differently; not for non-finite rows), NONFINITE_BIT.  The stale row reads as
    its flag (STALE) and FAILED when some rank's local check failed, the settings row as DRIFT
    when the settings differ; one more code, last, is nonzero
    when any row has CONFLICT or DRIFT."""
    n, s, q = table[:, N_HASHED], table[:, HASH], table[:, HASH_SQ]
    differ = (n > 1) & (n * q != s * s)
    has, nonfinite = table[:, HAS_GRAD] > 0, table[:, NONFINITE] > 0
    codes = (has.long() | ((has & (table[:, NO_GRAD] > 0)).long() << 1) | ((differ & ~nonfinite).long() << 2)
             | (nonfinite.long() << 3))
    codes[nrows] = (table[nrows, 0] != 0).long() | ((table[nrows, FAILED_AT] != 0).long() << 1)
    problems = (codes[:nrows] & (CONFLICT | DRIFT)).amax(dim=0, keepdim=True) if nrows else codes[:1] * 0
    return torch.cat([codes, problems])


def _host_to(device: torch.device, values) -> torch.Tensor:
    """int64 values from the host, copied without waiting for work already queued on the device
    (a blocking host-to-device copy synchronizes the stream)."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _comm_device(group, grads_on: torch.device) -> torch.device:
    """Where the table is reduced: the gradients' GPU when the group's backend runs collectives
    there (NCCL: the device the parameters live on, not whichever is current), else the CPU."""
    backend = dist.get_backend(group)
    if grads_on.type == "cuda" and "nccl" in backend:
        return grads_on
    if backend == "nccl":  # no local gradient elements on this rank to tell
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
