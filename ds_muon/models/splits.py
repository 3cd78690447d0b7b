"""The blocks a weight's output is split into, read from the pieces the trace saw (:mod:`.recorder`).

Every piece of a weight's output (a ``chunk``, ``split``, ``unbind`` or slice, after any view exposing a block
axis) was replayed on the output's *companion*, each element's output-feature index.  The pieces of one
tensor that partition its features are a split; the blocks are the features no split tells apart.  A split
undone later (pieces concatenated back as they were, or added together as a rotary embedding does) is none.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch


def output_blocks(uses, pieces: Dict[int, List[torch.Tensor]], sources: Dict[int, Tuple[str, torch.Tensor]],
                  rejoined: List[Tuple[str, torch.Tensor]],
                  mixed: List[Tuple[str, torch.Tensor, torch.Tensor]]) -> Dict[str, List[List[int]]]:
    """Parameter name -> the output features of each block, for each weight whose output is split."""
    out: Dict[str, List[List[int]]] = {}
    splits: Dict[str, List[torch.Tensor]] = {}  # param -> per split: piece id of each feature (-1: not in)
    for sid, parts in pieces.items():
        pname, comp = sources[sid]
        n = uses[pname].features or int(comp.max()) + 1
        whole = _present(comp, n)
        sets: List[torch.Tensor] = []
        for pc in parts:
            m = _present(pc, n)
            if torch.equal(m, whole):
                continue  # a piece with every feature: rows or tokens picked, not a split
            if not any(torch.equal(m, t) for t in sets):
                sets.append(m)
        if len(sets) < 2 or not torch.equal(torch.stack(sets).sum(0), whole.long()):
            continue  # not a partition of the features
        if any(r.shape == comp.shape and torch.equal(r, comp) for p, r in rejoined if p == pname):
            continue  # concatenated back as it was
        piece_of = torch.full((n,), -1, dtype=torch.int64)
        for k, m in enumerate(sets):
            piece_of[m] = k
        splits.setdefault(pname, []).append(piece_of)
    for pname, c1, c2 in mixed:  # splits whose pieces are added together again are undone
        if pname not in splits:
            continue
        a, b = c1.reshape(-1).long(), c2.reshape(-1).long()
        kept = []
        for piece_of in splits[pname]:
            pa, pb = piece_of[a], piece_of[b]
            if not bool(((pa != pb) & (pa >= 0) & (pb >= 0)).any()):
                kept.append(piece_of)
        splits[pname] = kept
    for pname, plist in splits.items():
        if not plist:
            continue
        n = int(plist[0].numel())
        sig = torch.stack(plist, dim=1)  # [features, splits]
        groups: Dict[tuple, List[int]] = {}
        for f in range(n):
            groups.setdefault(tuple(sig[f].tolist()), []).append(f)
        if len(groups) > 1:
            out[pname] = sorted(groups.values(), key=lambda g: g[0])

    return out


def _present(comp: torch.Tensor, n: int) -> torch.Tensor:
    """Which of the ``n`` output features a companion holds (a mask)."""
    return torch.bincount(comp.reshape(-1).long(), minlength=n)[:n] > 0
