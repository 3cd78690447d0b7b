"""Names, the last evidence: what a module or tensor is called, read only where nothing else tells.

A name says nothing a model cannot contradict, so :mod:`.decide` reads it after the module types, the
config and the traced forward, and only where they are silent (or the user gave ``head_names``).
"""

from __future__ import annotations

import fnmatch
from typing import Iterable, Optional, Tuple

HEAD_NAMES: Tuple[str, ...] = ("lm_head", "head", "output", "classifier")  # output heads, by default
HEAD_PROJ_NAMES = ("q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv", "q", "k", "v")
NORM_WORDS = ("norm", "Norm")
_WRAP_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def head_named(module_name: str, head_names: Tuple[str, ...]) -> bool:
    """Whether the module's own name (its last path part) is one of ``head_names``."""
    return module_name.rsplit(".", 1)[-1] in head_names


def norm_named(module) -> bool:
    """A module whose class is called a norm (its raw parameters are gains, not maps)."""
    return any(w in type(module).__name__ for w in NORM_WORDS)


def clean_name(name: str) -> str:
    """A parameter name without the prefixes FSDP1, activation checkpointing and torch.compile insert."""
    for p in _WRAP_PREFIXES:
        name = name.replace(p, "")
    return name


def matches(name: str, patterns: Iterable[str]) -> Optional[str]:
    """The first of ``patterns`` (exact names or globs) that ``name`` matches."""
    for pat in patterns:
        if name == pat or fnmatch.fnmatchcase(name, pat):
            return pat
    return None
