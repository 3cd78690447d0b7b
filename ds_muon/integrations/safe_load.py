"""Checkpoint files are data, not code: every torch file ds_muon reads is loaded weights-only.

A torch file is a pickle, and unpickling calls whatever globals the file names: a checkpoint from
elsewhere (the one ``ds-muon convert`` is for) could run anything.  :func:`load` reads with
``weights_only=True`` under ``torch.serialization.safe_globals`` of the few classes DeepSpeed's and DCP's
checkpoints hold (:data:`DEEPSPEED_GLOBALS`, :data:`DCP_GLOBALS`, found by saving ZeRO-1/2/3 fp32, bf16 and
fp16 checkpoints, universal ones and DCP ones and listing what a weights-only load meets); any other global
is refused with :class:`UntrustedCheckpoint`, one line naming the file and the global, before any of it
runs.  DeepSpeed's converter reads the files of a ZeRO folder itself (``weights_only=False``), so
:func:`check_folder` reads each of them weights-only first; DCP's ``.metadata`` (a plain pickle) is read by
the same restricted unpickler.  The opt-in for a file the user vouches for: ``trust_checkpoint=True`` /
``--trust-checkpoint`` (:func:`trusted`), or ``DS_MUON_TRUST_CHECKPOINT=1`` for the reads of a training
resume.  A file that is no whole torch file (truncated, another format) is :class:`UnreadableCheckpoint`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import pickle
import re
import sys
from typing import Iterator, List

import torch

TRUST_ENV = "DS_MUON_TRUST_CHECKPOINT"
TRUST_HINT = ("Pass trust_checkpoint=True (ds-muon convert --trust-checkpoint; DS_MUON_TRUST_CHECKPOINT=1 for a "
              "training resume) only if you trust where the file came from")
DEEPSPEED_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.utils.tensor_fragment.fragment_address")
DCP_GLOBALS = tuple(f"torch.distributed.checkpoint.metadata.{n}" for n in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")) + (
    "torch.distributed.checkpoint.filesystem._StorageInfo", "pathlib.PosixPath", "pathlib.WindowsPath",
    "pathlib.PurePosixPath", "pathlib.PureWindowsPath", "torch.serialization._get_layout")

_trust_depth = 0


class UntrustedCheckpoint(ValueError):
    """A checkpoint file names a global outside the allow-list: loading it would run code."""


class UnreadableCheckpoint(ValueError):
    """A checkpoint file that is no whole torch file (truncated, another format)."""


def _resolve(name: str):
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):  # DeepSpeed absent, or a torch without that class: nothing to allow
        return None


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def allowed_globals() -> List[object]:
    """The classes a weights-only load of DeepSpeed's and DCP's checkpoints needs beyond torch's defaults
    (DeepSpeed's once it is imported, as every reader of its folders does: importing it costs seconds)."""
    names = (DEEPSPEED_GLOBALS if "deepspeed" in sys.modules else ()) + DCP_GLOBALS
    return [g for g in map(_resolve, names) if g is not None]


def is_trusted() -> bool:
    return _trust_depth > 0 or os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes")


@contextlib.contextmanager
def trusted(trust: bool = True) -> Iterator[None]:
    """Every read inside is a full unpickling when ``trust`` (the user's ``trust_checkpoint=True``)."""
    global _trust_depth
    _trust_depth += bool(trust)
    try:
        yield
    finally:
        _trust_depth -= bool(trust)


def _global_named(message: str) -> str:
    for pattern in (r"GLOBAL ([\w.]+)", r"[Gg]lobal:? ([\w.]+)"):
        m = re.search(pattern, message)
        if m and m.group(1) != "GLOBAL":
            return m.group(1)
    return "an object torch's weights-only load refuses"


def _untrusted(path, e: BaseException) -> UntrustedCheckpoint:
    return UntrustedCheckpoint(f"ds_muon: {os.fspath(path)} holds {_global_named(str(e))}, which only a full "
                               f"unpickling would call (code, not data); nothing of it ran. {TRUST_HINT}")


def _unreadable(path, e: BaseException) -> UnreadableCheckpoint:
    why = " ".join(str(e).split()).split(". ")[0][:160] or type(e).__name__
    return UnreadableCheckpoint(f"ds_muon: cannot read {os.fspath(path)} ({why}): it is no whole torch file "
                                "(truncated, or another format); copy it again from where it was saved, or give "
                                "the checkpoint's own files")


def load(path, mmap: bool = False, trust=None, name=None):
    """``torch.load(path)`` (a path or a stream, ``name`` saying what it is) on the CPU, weights-only with
    :func:`allowed_globals` unless trusted."""
    trust = is_trusted() if trust is None else trust
    shown = path if name is None else name
    try:
        if trust:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if _global_named(str(e)) in DEEPSPEED_GLOBALS and "deepspeed" not in sys.modules and _importable("deepspeed"):
            importlib.import_module("deepspeed")  # an allowed class of DeepSpeed's, not imported yet: allow it
            if hasattr(path, "seek"):
                path.seek(0)
            return load(path, mmap=mmap, trust=trust, name=name)
        if "weights_only" in str(e) or "Weights only" in str(e):
            raise _untrusted(shown, e) from None
        raise _unreadable(shown, e) from None
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except (RuntimeError, EOFError, ValueError, OSError) as e:  # (an empty file: OSError EINVAL from mmap)
        if mmap and isinstance(e, RuntimeError) and "mmap" in str(e):  # an old (non-zip) torch file: no mmap
            if hasattr(path, "seek"):
                path.seek(0)
            return load(path, mmap=False, trust=trust, name=name)
        raise _unreadable(shown, e) from None


class _Restricted(pickle.Unpickler):
    """The ``pickle`` module's own way to restrict globals (``find_class``): torch's weights-only allow-list and
    :data:`DCP_GLOBALS`, nothing else (torch's weights-only unpickler stops at protocol 4's FRAME, which DCP's
    ``.metadata`` uses)."""

    def __init__(self, file):
        from torch import _weights_only_unpickler

        super().__init__(file)
        self.allowed = dict(_weights_only_unpickler._get_allowed_globals())
        self.allowed.update((n, g) for n, g in zip(DCP_GLOBALS, map(_resolve, DCP_GLOBALS)) if g is not None)

    def find_class(self, module, name):
        full = f"{module}.{name}"
        if full in self.allowed:
            return self.allowed[full]
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {full}")


def loads_pickle(data: bytes, path) -> object:
    """A plain pickle (DCP's ``.metadata``) read with only :data:`DCP_GLOBALS` and torch's allowed, unless trusted."""
    if is_trusted():
        return pickle.loads(data)
    try:
        return _Restricted(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        if "Unsupported global" in str(e):
            raise _untrusted(path, e) from None
        raise _unreadable(path, e) from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
        raise _unreadable(path, e) from None


def check_folder(folder) -> None:
    """Every ``*.pt`` file under ``folder`` read weights-only (memory-mapped: the tensors are not read), so a
    reader that unpickles fully (DeepSpeed's converter and checkpoint classes) meets only data."""
    if is_trusted():
        return
    for root, dirs, files in os.walk(os.fspath(folder)):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".pt"):
                load(os.path.join(root, f), mmap=True)
