"""``ds_muon.find_muon(obj)``: the :class:`ds_muon.Muon` behind whatever a front door returned.

Front doors hand back other libraries' objects: ``ds_muon.deepspeed.initialize`` returns DeepSpeed's
engine and its ZeRO optimizer wrapper, ``ds_muon.accelerate.prepare`` accelerate's
``AcceleratedOptimizer`` (around DeepSpeed's wrapper under DeepSpeed), ``MuonTrainer`` a Trainer.
The Muon's own methods (``summary()``, ``flush()``) live on the Muon, so this walks the attributes
those wrappers keep their inner optimizer under, instead of users guessing ``.optimizer.optimizer``.
"""

from __future__ import annotations

from typing import Optional

from .models.module_types import unwrap_model  # noqa: F401 - the module behind DDP, compile, PEFT, engines
from .optimizer import Muon

# where the wrappers keep what they wrap: DeepSpeed's ZeRO/BF16 wrappers and accelerate's optimizer wrappers
# (``optimizer``), DeepSpeed's engine (``basic_optimizer`` before wrapping, ``optimizer``), MuonTrainer (``muon``),
# transformers' Trainer (``optimizer``)
_INNER = ("muon", "optimizer", "basic_optimizer", "base_optimizer")
_MAX_DEPTH = 6


def find_muon(obj, required: bool = True) -> Optional[Muon]:
    """The ``ds_muon.Muon`` inside ``obj``: a Muon, a DeepSpeed engine or ZeRO optimizer, an accelerate
    optimizer wrapper, a ``MuonTrainer`` (after ``train()`` started), or any object keeping one under
    ``.optimizer``.  Raises ``TypeError`` naming what was searched when there is none (``required=False``:
    returns None)."""
    seen, frontier, path = set(), [obj], []
    for _ in range(_MAX_DEPTH):
        nxt = []
        for o in frontier:
            if o is None or id(o) in seen:
                continue
            seen.add(id(o))
            if isinstance(o, Muon):
                return o
            path.append(type(o).__name__)
            for attr in _INNER:
                try:
                    inner = getattr(o, attr, None)
                except Exception:  # a property that needs state the object does not have yet
                    inner = None
                if inner is not None and not isinstance(inner, (str, int, float, bool, dict, list, tuple)):
                    nxt.append(inner)
        frontier = nxt
    if not required:
        return None
    raise TypeError(f"ds_muon.find_muon: no ds_muon.Muon inside {type(obj).__name__} (looked through "
                    f"{' -> '.join(dict.fromkeys(path)) or 'nothing'} under .{', .'.join(_INNER)}); pass the engine, "
                    "optimizer or trainer built with ds_muon (a MuonTrainer holds it once train() has started)")

