"""What one optimizer steps, as every rank can name it: for the step's agreement.

Several ``Muon`` optimizers in one job (two halves of a model, a model and its
EMA teacher, ...) each run the step's collectives.  Stepped in different orders on
different ranks, one rank's first optimizer would meet another's second in the
same all_reduce and all_to_all: wrong results, or a hang.  The agreement
(:func:`~ds_muon.engine.agreement.fingerprints.settings_of`) hashes :func:`identity_of` into its settings row, so such
a pairing is the same clear error on every rank, before anything changes, with no
collective of its own.

The identity is the optimizer's place among the ``Muon`` optimizers this process
built over tensors of the same structure (every rank builds its optimizers in the
same order), and the structure of what it steps now: per param group the tensor
names, each Muon matrix's global shape and the number of AdamW tensors.  Both are
equal on every rank for one optimizer and tell two optimizers apart even where
their halves of a model look alike.
"""

from __future__ import annotations

import zlib
from collections import Counter
from typing import Dict, List

_BUILT: Counter = Counter()  # structure key -> how many Muon optimizers this process built over it


def _shape(p) -> tuple:
    return tuple(getattr(p, "shape", ()))


def structure_key(param_groups: List[dict]) -> int:
    """A fingerprint of the param groups as given at construction (counts, names, shapes)."""
    parts = []
    for g in param_groups:
        parts.append((bool(g.get("use_muon", True)), len(g["params"]), tuple(g.get("param_names") or ()),
                      tuple(_shape(p) for p in g["params"])))
    return zlib.crc32(repr(parts).encode())


def next_ordinal(param_groups: List[dict]) -> int:
    """This optimizer's place among those built in this process over the same structure."""
    key = structure_key(param_groups)
    ordinal = _BUILT[key]
    _BUILT[key] += 1
    return ordinal


def identity_of(optimizer) -> str:
    """What ``optimizer`` steps, the same string on every rank (see the module docstring):
    e.g. ``"Muon #2 (of this structure) over 6 tensors, 'layers.0.weight' ... 'head.bias',
    fingerprint 1a2b3c4d"``."""
    runtime = optimizer.runtime
    key = (runtime.signature,
           tuple((id(g), len(g["params"]), id(g.get("param_names"))) for g in optimizer.param_groups))
    cached = getattr(optimizer, "_identity", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    bindings: Dict[int, object] = runtime.bindings
    parts, names = [], []
    for gi, g in enumerate(optimizer.param_groups):
        for pi, p in enumerate(g["params"]):
            names.append(runtime.name(gi, pi))
        if g.get("use_muon", True):
            shapes = tuple(tuple(tuple(s.shape) for s in b.matrices) if b is not None else None
                           for b in (bindings.get(id(p)) for p in g["params"]))
        else:
            shapes = len(g["params"])
        parts.append((tuple(names[-len(g["params"]):]) if g["params"] else (), shapes))
    fingerprint = zlib.crc32(repr(parts).encode())
    span = f"{names[0]!r} ... {names[-1]!r}" if names else "no tensors"
    out = (f"Muon #{getattr(optimizer, '_ordinal', 0) + 1} (of this structure) over {len(names)} tensors, "
           f"{span}, fingerprint {fingerprint:08x}")
    optimizer._identity = (key, out)
    return out
