"""Module paths that moved, importable one release more, each with a ``DeprecationWarning``.

The engine was arranged by stage in 0.2 (``ds_muon.engine.planner`` is now
``ds_muon.engine.plan.planner``, and so on: :data:`MOVED`).  An old path that moved whole imports
the module at its new place (the same module object, so a monkeypatch through either path patches
both) and warns once, naming the new path.  An old module whose names were then split between
several modules (``planner``, ``costs``, ``summary``) imports as a :class:`SplitModule`: each name
read through it warns, naming the module that now holds it, and a name set through it (a monkeypatch)
is set in every module that holds it.  Two old module names are now packages (``engine.exchange``,
``engine.agreement``); their old names are served by those packages' ``__getattr__``
(:func:`forward_names`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from typing import List, Tuple

_E = "ds_muon.engine."
# old path -> the modules that hold its names now (one: the old module moved whole; several: in import
# order, a module before those importing from it, so a constant is named where it is defined)
MOVED = {_E + old: tuple(n if n.startswith("ds_muon.") else _E + n for n in ((new,) if isinstance(new, str) else new))
         for old, new in {
    "layout": "exchange.layout", "slots": "exchange.slots", "tag_keys": "ds_muon.tensors.tag_keys",
    "exchange.tag_keys": "ds_muon.tensors.tag_keys",  # to the ground floor (issue 43): models/ reads no engine
    "copies": "exchange.copies", "pieces": "exchange.pieces", "row_moments": "exchange.row_moments",
    "identity": "agreement.identity", "extremes": "agreement.extremes", "state_check": "agreement.state_check",
    "timeouts": "agreement.timeouts", "groups": "agreement.settings",
    "planner": ("exchange.routes", "plan.cost_model", "plan.team_plan", "plan.planner"),
    "costs": ("plan.costs", "plan.mesh_costs"), "compile": "plan.compile", "team": "plan.team",
    "budget": "memory.budget", "lending": "memory.lending", "offload": "memory.offload",
    "summary": ("report.rows", "report.summary"), "summary_file": "report.summary_file",
}.items()}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; import it from there (the old path goes in the next release)",
                  DeprecationWarning, stacklevel=3)


def _holders(name: str, homes: Tuple[str, ...]) -> Tuple[List[types.ModuleType], str]:
    """The modules of ``homes`` that hold ``name`` bound to the object the first of them holds, and
    the module it is defined in (a function's or class's own; else the first holder)."""
    modules = [importlib.import_module(m) for m in homes]
    found = [m for m in modules if name in vars(m)]
    if not found:
        return [], ""
    value = vars(found[0])[name]
    own = value.__module__ if isinstance(value, (type, types.FunctionType)) else None
    return [m for m in found if vars(m)[name] is value], own if own in homes else found[0].__name__


class _Forwarded:
    """One name of a :class:`SplitModule`, a data descriptor: read from the module that holds it now,
    with a ``DeprecationWarning`` naming it; set or deleted in every one of them that holds the same
    object, so each module that reads the name sees a monkeypatch through the old path (which saves
    and restores it as it would a module attribute)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, module, owner=None):
        if module is None:
            return self
        found, own = _holders(self.name, module._homes)
        if not found:
            raise AttributeError(f"module {module.__name__!r} has no attribute {self.name!r}")
        _warn(f"{module.__name__}.{self.name}", f"{own}.{self.name}")
        return vars(found[0])[self.name]

    def __set__(self, module, value) -> None:
        found, _ = _holders(self.name, module._homes)
        for home in found or [importlib.import_module(module._homes[-1])]:  # none: the last, the old module's heir
            setattr(home, self.name, value)

    def __delete__(self, module) -> None:
        found, _ = _holders(self.name, module._homes)
        if not found:
            raise AttributeError(self.name)
        for home in found:
            delattr(home, self.name)


class SplitModule(types.ModuleType):
    """An old module whose names now live in several modules: each of their names is a
    :class:`_Forwarded` of its own class (:meth:`of`)."""

    _homes: Tuple[str, ...] = ()

    @classmethod
    def of(cls, name: str, homes: Tuple[str, ...]) -> "SplitModule":
        names = {n for m in homes for n in vars(importlib.import_module(m)) if not n.startswith("__")}
        return type(cls.__name__, (cls,), {"_homes": homes, **{n: _Forwarded(n) for n in names}})(name)

    def __dir__(self):
        return sorted({n for m in self._homes for n in vars(importlib.import_module(m))})


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of :data:`MOVED` and loads it as the module at its new path (or, split, a
    :class:`SplitModule`)."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        homes = MOVED[spec.name]
        if len(homes) > 1:
            return SplitModule.of(spec.name, homes)  # warns per name read, naming its module
        _warn(spec.name, homes[0])
        return importlib.import_module(homes[0])

    def exec_module(self, module) -> None:
        """(The module at the new path is already executed.)"""


def install() -> None:
    """Serve the old paths (once per process; ``import ds_muon`` calls it)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def forward_names(package: str, old: str, *new: str):
    """A module ``__getattr__`` for ``package`` (an old module name, now a package) that hands out
    the names the old module had, from the modules ``new`` that hold them now, with a ``DeprecationWarning``."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        found, own = _holders(name, new)
        if not found:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        _warn(f"{old}.{name}", f"{own}.{name}")
        return vars(found[0])[name]

    return __getattr__
