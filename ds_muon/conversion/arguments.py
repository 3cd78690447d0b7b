"""What ``ds-muon convert``'s arguments become: the settings of the groups (``--set``, or ``--config``'s DsMuon
params), and the model (``--model MODULE:CALLABLE``), each failure a ValueError naming the argument."""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Optional

from torch import nn

from ..setup.dsmuon_entry import is_dsmuon_entry, load_config


def resolve_config(config, settings: Optional[Dict[str, Any]]):
    """(the DeepSpeed config as a dict or None, the settings): a config's DsMuon params are the settings
    unless ``settings`` are given."""
    if config is None or settings is not None and not isinstance(config, (str, os.PathLike)):
        return config, settings
    cfg = load_config(config)
    if not isinstance(cfg, dict):
        raise ValueError(f"ds_muon.convert: the DeepSpeed config is a JSON {type(cfg).__name__}, not an object")
    if settings is None:
        params = cfg["optimizer"].get("params") if is_dsmuon_entry(cfg) else None
        if params is not None and not isinstance(params, dict):
            raise ValueError("ds_muon.convert: the DeepSpeed config's optimizer.params is not a JSON object")
        settings = dict(params or {}) if is_dsmuon_entry(cfg) else None
    return cfg, settings


def load_factory(spec: str) -> nn.Module:
    """``"package.module:callable"`` → ``callable()`` (the model to convert for, built on the CPU); every
    way that can fail is a ValueError naming ``--model`` and what to give instead."""
    import importlib

    mod, sep, fn = spec.partition(":")
    if not sep or not mod or not fn:
        raise ValueError(f"--model {spec!r}: give MODULE:CALLABLE, e.g. examples.gpt:tiny_model")
    try:
        module = importlib.import_module(mod)
    except Exception as e:  # ModuleNotFoundError, or the module's own import failing
        raise ValueError(f"--model {spec!r}: cannot import {mod!r} ({_one_line(e)}); give a module importable "
                         "here (on PYTHONPATH, run from the project's folder)") from None
    target = module
    for part in fn.split("."):
        if not hasattr(target, part):
            raise ValueError(f"--model {spec!r}: {mod} has no {fn!r}; give the name of a function or class in it "
                             "that builds the model") from None
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"--model {spec!r}: {mod}.{fn} is a {type(target).__name__}, not callable; give a function "
                         "or class that builds the model")
    try:
        model = target()
    except Exception as e:
        raise ValueError(f"--model {spec!r}: {mod}.{fn}() raised {_one_line(e)}; give a callable that builds the "
                         "model with no arguments") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r}: {mod}.{fn}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def settings_from(items: Iterable[str]) -> Dict[str, Any]:
    """``--set KEY=VALUE ...`` → {KEY: VALUE} (VALUE read as JSON where it is, else as a string)."""
    import json

    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k.strip() or not k.isidentifier():
            raise ValueError(f"--set {item!r}: give KEY=VALUE with KEY a setting name, e.g. lr=0.02")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out
