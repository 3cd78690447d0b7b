"""Module paths that moved, importable one release more, each with a ``DeprecationWarning``.

The engine was arranged by stage in 0.2 (``ds_muon.engine.planner`` is now
``ds_muon.engine.plan.planner``, and so on: :data:`MOVED`).  An old path imports the module at
its new place (the same module object, so a monkeypatch through either path patches both) and
warns once, naming the new path.  Two old module names are now packages (``engine.exchange``,
``engine.agreement``); their old names are served by those packages' ``__getattr__``
(:func:`forward_names`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_E = "ds_muon.engine."
MOVED = {_E + old: _E + new for old, new in {
    "layout": "exchange.layout", "slots": "exchange.slots", "tag_keys": "exchange.tag_keys",
    "copies": "exchange.copies", "pieces": "exchange.pieces", "row_moments": "exchange.row_moments",
    "identity": "agreement.identity", "extremes": "agreement.extremes", "state_check": "agreement.state_check",
    "timeouts": "agreement.timeouts", "groups": "agreement.settings",
    "planner": "plan.planner", "costs": "plan.costs", "compile": "plan.compile", "team": "plan.team",
    "budget": "memory.budget", "lending": "memory.lending", "offload": "memory.offload",
    "summary": "report.summary", "summary_file": "report.summary_file",
}.items()}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; import it from there (the old path goes in the next release)",
                  DeprecationWarning, stacklevel=3)


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of :data:`MOVED` and loads it as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        _warn(spec.name, MOVED[spec.name])
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        """(The module at the new path is already executed.)"""


def install() -> None:
    """Serve the old paths (once per process; ``import ds_muon`` calls it)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def forward_names(package: str, old: str, new: str):
    """A module ``__getattr__`` for ``package`` (an old module name, now a package) that hands out
    the names the old module had, from ``new``, with a ``DeprecationWarning``."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        module = importlib.import_module(new)
        if not hasattr(module, name):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        _warn(f"{old}.{name}", f"{new}.{name}")
        return getattr(module, name)

    return __getattr__
