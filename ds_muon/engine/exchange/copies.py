"""Which ranks hold identical copies of a DTensor's local shard, for the step's check.

ds_muon plans a sharded matrix once over every rank that holds a copy of its pieces
(HSDP's replicate dim; FSDP2 x TP parameters that TP leaves on the ``dp`` sub-mesh,
copied on every ``tp`` coordinate; dense parameters of EP x FSDP2 on every ``ep``
coordinate), and one home's result overwrites every copy.  That is only right when the
copies' gradients are equal, which :class:`~ds_muon.engine.agreement.check.Agreement` checks with
the fingerprints of these groups.

A rank's :func:`copy_key` of a tensor is equal on two ranks exactly when DTensor's
own metadata puts the same elements there: same global shape, mesh shape and
placements, same coordinate along every mesh dim that is not ``Replicate``.  The mesh
itself is left out on purpose: the ``dp`` sub-meshes of different ``tp`` coordinates are
different meshes holding the same shards.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Sequence

import torch

from .layout import _DTENSOR_OR_NONE as _DTENSOR


def copy_key(p: torch.Tensor) -> Optional[int]:
    """A 64-bit value equal on exactly the ranks whose local shard of ``p`` holds the same
    elements (None: not a DTensor, or this rank is not on its mesh)."""
    if not isinstance(p, _DTENSOR):
        return None
    spec = p._spec
    coord = spec.mesh.get_coordinate()
    if coord is None:
        return None
    sharded_at = tuple(-1 if pl.is_replicate() else int(c) for c, pl in zip(coord, spec.placements))
    text = repr((tuple(p.shape), tuple(spec.mesh.shape), tuple(map(str, spec.placements)), sharded_at))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def holders(keys: Sequence[Optional[int]]) -> List[List[int]]:
    """Groups of at least two positions (ranks of the agreement group) with equal keys, in
    order of their first rank."""
    by_key: Dict[int, List[int]] = {}
    for r, k in enumerate(keys):
        if k is not None:
            by_key.setdefault(k, []).append(r)
    return [g for g in by_key.values() if len(g) > 1]


def copy_dims(p: torch.Tensor, ranks: Sequence[int]) -> List[str]:
    """The dims of ``p``'s root device mesh along which the (global) ``ranks`` lie, by name,
    for error messages; [] when the root mesh cannot tell."""
    try:
        root = p.device_mesh._get_root_mesh()
        grid = root.mesh
        coords = [tuple(int(c) for c in (grid == r).nonzero()[0].tolist()) for r in ranks]
    except Exception:  # a private API, or a rank off the root mesh: the ranks alone name the copies
        return []
    names = root.mesh_dim_names or tuple(str(d) for d in range(grid.ndim))
    return [names[d] for d in range(grid.ndim) if len({c[d] for c in coords}) > 1]


def describe(name: str, p: torch.Tensor, ranks: Sequence[int]) -> str:
    """``name`` with the ranks that hold the copies (and the mesh dims they span)."""
    dims = copy_dims(p, ranks)
    along = f", mesh dim{'s' if len(dims) > 1 else ''} {', '.join(map(repr, dims))}" if dims else ""
    return f"{name} (copies on ranks {list(ranks)}{along})"
