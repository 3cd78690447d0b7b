"""``ds-muon convert``: optimizer state moved between checkpoint formats by tensor name, re-grouped by ds_muon.

Every format is read into one neutral form, ``Named``: the model's weights and each tensor's optimizer
state (``momentum_buffer`` for Muon, ``exp_avg`` / ``exp_avg_sq`` / ``step`` for AdamW), keyed by the
tensor's name in the model.  Sources:

* a DeepSpeed ZeRO-1/2/3 checkpoint (ds_muon's ``"type": "DsMuon"`` or DeepSpeed's ``"type": "muon"``):
  DeepSpeed's universal conversion over every state key (:mod:`ds_muon.integrations.deepspeed_universal`), then read by name;
* a DeepSpeed universal checkpoint (a folder with ``zero/``);
* a DCP checkpoint (FSDP2/FSDP1 ``get_state_dict`` saved as ``{"model": ..., "optim": ...}``, any world
  size): ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``, then as a torch file;
* a torch file or dict with the model's state dict and one or more optimizer state dicts that name their
  tensors (``param_names`` in each group, as torch optimizers record when built from
  ``model.named_parameters()``; FQN-keyed state as DCP's full state dicts) — or live optimizers
  (torch.optim.Muon + AdamW, Keller's ``MuonWithAuxAdam``, any torch optimizer) with the model they step.

The state is then given to ds_muon's own groups (:func:`ds_muon.muon_param_groups` of the model: which
tensors take Muon is ds_muon's decision, never the source's), matched by name and shape, and written as a
plain ds_muon state dict (``{"model", "optim"}``, for one process, DDP and accelerate's DDP), a DCP
checkpoint (FSDP2 at any world size) or a DeepSpeed universal checkpoint (ZeRO-1/2/3 at any world size,
``"checkpoint": {"load_universal": true}``), the last through a one-rank DsMuon engine's own
``save_checkpoint``.  A tensor whose source state is another algorithm's (a source that put it in Muon
where ds_muon puts it in AdamW, or the reverse) is an error naming it unless ``fresh=True``, which starts
just those tensors' state at zero and lists them in a warning.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn

from .optimizer import Muon
from .param_groups import muon_param_groups

MUON_KEYS = ("momentum_buffer",)
NORMUON_V = "normuon_v"  # NorMuon's second moment, carried where the source has it (ds_muon.engine.exchange.row_moments)
ADAMW_KEYS = ("exp_avg", "exp_avg_sq")
FORMATS = ("auto", "deepspeed", "universal", "dcp", "torch")
TARGETS = ("universal", "dcp", "torch")


@dataclass
class Named:
    """Weights and per-tensor optimizer state keyed by the tensor's name in the model."""

    weights: Dict[str, torch.Tensor] = field(default_factory=dict)
    state: Dict[str, Dict[str, Any]] = field(default_factory=dict)


# -- reading -----------------------------------------------------------------------------------------------
def detect_format(src) -> str:
    if isinstance(src, dict):
        return "torch"
    src = os.fspath(src)
    if os.path.isfile(src):
        return "torch"
    if os.path.isfile(os.path.join(src, ".metadata")):
        return "dcp"
    if os.path.isdir(os.path.join(src, "zero")):
        return "universal"
    if any(f.endswith("_optim_states.pt") for f in os.listdir(src)):
        return "deepspeed"
    for latest in ("latest", "latest_universal"):
        path = os.path.join(src, latest)
        if os.path.isfile(path):
            with open(path) as f:
                return detect_format(os.path.join(src, f.read().strip()))
    raise ValueError(f"ds_muon.convert: cannot tell what {src} is (a torch file, a DCP folder with .metadata, a "
                     "DeepSpeed checkpoint folder with *_optim_states.pt or a latest file, or a universal one with "
                     "zero/); pass source= (ds-muon convert --source)")


def _tag_folder(src: str) -> str:
    if any(f.endswith("_optim_states.pt") for f in os.listdir(src)) or os.path.isdir(os.path.join(src, "zero")):
        return src
    for latest in ("latest", "latest_universal"):
        if os.path.isfile(os.path.join(src, latest)):
            with open(os.path.join(src, latest)) as f:
                return os.path.join(src, f.read().strip())
    return src


def read_universal_named(folder: str) -> Named:
    from .integrations.deepspeed_universal import read_universal

    named = Named()
    for name, entries in read_universal(folder).items():
        named.weights[name] = entries.pop("fp32")
        if entries:
            named.state[name] = entries
    return named


def read_deepspeed(folder: str) -> Named:
    """A ZeRO-1/2/3 checkpoint folder (one tag, or its root with ``latest``) by tensor name."""
    from .integrations.deepspeed_universal import zero_to_universal

    with tempfile.TemporaryDirectory() as tmp:
        return read_universal_named(zero_to_universal(_tag_folder(folder), os.path.join(tmp, "universal")))


def _is_optimizer_sd(v) -> bool:
    return isinstance(v, dict) and "state" in v and "param_groups" in v


def _optimizer_state_dicts(obj) -> List[dict]:
    if _is_optimizer_sd(obj):
        return [obj]
    if isinstance(obj, dict):
        return [sd for v in obj.values() for sd in _optimizer_state_dicts(v)]
    if isinstance(obj, (list, tuple)):
        return [sd for v in obj for sd in _optimizer_state_dicts(v)]
    return []


def _model_state_dict(obj: dict) -> Dict[str, torch.Tensor]:
    for key in ("model", "module", "state_dict", "model_state_dict"):
        v = obj.get(key)
        if isinstance(v, dict) and v and all(torch.is_tensor(t) for t in v.values()):
            return v
    return {}


def named_state(optimizers, model: Optional[nn.Module] = None,
                param_names: Optional[Sequence[Sequence[str]]] = None) -> Dict[str, Dict[str, Any]]:
    """Per-tensor state by name from torch optimizers (live, with ``model``) or their state dicts.

    A state dict names its tensors by FQN-keyed state (DCP's full state dicts), by ``param_names`` in its
    groups, or by ``param_names`` given here (one list per group, over all optimizers in order)."""
    if not isinstance(optimizers, (list, tuple)):
        optimizers = [optimizers]
    out: Dict[str, Dict[str, Any]] = {}
    given = list(param_names) if param_names is not None else None
    for opt in optimizers:
        if isinstance(opt, torch.optim.Optimizer):
            if model is None:
                raise ValueError("ds_muon.convert.named_state: live optimizers need model= to name their tensors")
            names = {id(p): n for n, p in model.named_parameters()}
            for g in opt.param_groups:
                for p in g["params"]:
                    if id(p) not in names:
                        raise ValueError(f"ds_muon.convert: {type(opt).__name__} steps a tensor of shape "
                                         f"{tuple(p.shape)} that is not a parameter of the model given")
                    if opt.state.get(p):
                        out[names[id(p)]] = dict(opt.state[p])
            continue
        if not _is_optimizer_sd(opt):
            raise ValueError(f"ds_muon.convert: expected an optimizer or its state_dict(), got {type(opt).__name__}")
        state = opt["state"]
        if state and all(isinstance(k, str) for k in state):  # FQN-keyed (DCP full state dict)
            out.update({k: dict(v) for k, v in state.items()})
            continue
        for gi, g in enumerate(opt["param_groups"]):
            names = g.get("param_names")
            if names is None and given:
                names = given.pop(0)
            if names is None or len(names) != len(g["params"]):
                raise ValueError(
                    f"ds_muon.convert: param group {gi} of a {len(opt['param_groups'])}-group optimizer state dict "
                    f"does not name its {len(g['params'])} tensors; build the optimizer from model.named_parameters() "
                    "(torch records param_names then), pass the live optimizer with model=, or pass param_names=")
            for idx, name in zip(g["params"], names):
                if idx in state:
                    out[name] = dict(state[idx])
    return out


def read_torch(obj, param_names=None) -> Named:
    """A torch file (or the dict in it): the model's state dict and the optimizer state dicts beside it."""
    if not isinstance(obj, dict):
        obj = torch.load(os.fspath(obj), map_location="cpu", weights_only=False)
    sds = _optimizer_state_dicts(obj)
    if not sds:
        raise ValueError("ds_muon.convert: found no optimizer state dict (a dict with 'state' and 'param_groups') in "
                         f"the source (top-level keys: {sorted(obj)[:8]})")
    return Named(weights=dict(_model_state_dict(obj)), state=named_state(sds, param_names=param_names))


def read_dcp(folder: str) -> Named:
    """A DCP checkpoint, any world size: DCP's own ``dcp_to_torch_save``, then :func:`read_torch`."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(folder, path)
        return read_torch(path)


def read(src, source: str = "auto", param_names=None) -> Named:
    """Any source format as :class:`Named`."""
    if source not in FORMATS:
        raise ValueError(f"ds_muon.convert: source={source!r} is unknown; use one of {list(FORMATS)}")
    kind = detect_format(src) if source == "auto" else source
    if kind == "torch":
        return read_torch(src, param_names)
    return {"deepspeed": read_deepspeed, "universal": read_universal_named, "dcp": read_dcp}[kind](os.fspath(src))


# -- re-grouping -------------------------------------------------------------------------------------------
def _as_tensor_like(value, like: torch.Tensor, name: str, key: str) -> torch.Tensor:
    t = torch.as_tensor(value)
    if key == "step":
        return t.detach().to(torch.float32).reshape(()).clone()  # never the source's own counter
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    if tuple(t.shape) != tuple(like.shape):
        if t.numel() == like.numel() and t.dim() == 1:
            t = t.view(like.shape)  # universal / flat fragments keep the element order
        else:
            raise ValueError(f"ds_muon.convert: {name} {key} has shape {list(t.shape)} in the source and the model's "
                             f"tensor is {list(like.shape)}: the checkpoint is from another model")
    return t.detach().to(device=like.device, dtype=like.dtype).clone()


def load_named(muon: Muon, named_or_state, model: Optional[nn.Module] = None, fresh: bool = False) -> List[str]:
    """Give each tensor of ``muon`` (an unwrapped model's Muon, built with ``param_names``) the source state of
    the tensor of the same name; returns the tensors started fresh (``fresh=True``).  Raises naming the first
    tensor whose state is missing or another algorithm's, before anything changes."""
    state = named_or_state.state if isinstance(named_or_state, Named) else dict(named_or_state)
    plan, fresh_names = [], []
    for gi, g in enumerate(muon.param_groups):
        names = g.get("param_names")
        if names is None:
            raise ValueError(f"ds_muon.convert: param group {gi} records no param_names; build the groups with "
                             "ds_muon.muon_param_groups(model)")
        keys = MUON_KEYS if g["use_muon"] else ADAMW_KEYS
        for p, name in zip(g["params"], names):
            src = state.get(name, {})
            if all(k in src for k in keys):
                new = {k: _as_tensor_like(src[k], p, name, k) for k in keys}
                if g["use_muon"] and NORMUON_V in src:  # NorMuon's v: whole per tensor, float32 (any source layout)
                    new[NORMUON_V] = torch.as_tensor(src[NORMUON_V]).detach().to(device=p.device,
                                                                                 dtype=torch.float32).clone()
                if not g["use_muon"]:
                    new["step"] = _as_tensor_like(src.get("step", 0), p, name, "step")
                plan.append((p, new))
            elif fresh:
                fresh_names.append(name)
            else:
                other = "AdamW's" if any(k in src for k in ADAMW_KEYS) else "Muon's" if "momentum_buffer" in src else "no"
                raise ValueError(
                    f"ds_muon.convert: {name} takes {'Muon' if g['use_muon'] else 'AdamW'} in ds_muon "
                    f"(muon_param_groups) and the source holds {other} state for it ({sorted(src) or 'nothing'}); "
                    "nothing was changed. Pass fresh=True (--fresh) to start such tensors' state at zero")
    for p, new in plan:
        muon.state[p].clear()
        muon.state[p].update(new)
    if fresh_names:
        warnings.warn(f"ds_muon.convert: {len(fresh_names)} tensor(s) start with fresh optimizer state (the source "
                      f"used the other algorithm for them): {fresh_names}")
    return fresh_names


def load_state_from(muon: Muon, optimizers, model: Optional[nn.Module] = None, param_names=None,
                    fresh: bool = False) -> List[str]:
    """Coming from another Muon: ``optimizers`` (torch.optim.Muon + AdamW, Keller's MuonWithAuxAdam, ...;
    live ones with the ``model`` they step, or state dicts that name their tensors) give their state to
    ``muon`` by tensor name and shape."""
    return load_named(muon, named_state(optimizers, model, param_names), fresh=fresh)


def build(model: nn.Module, named: Named, settings: Optional[Dict[str, Any]] = None, fresh: bool = False) -> Muon:
    """The model (weights loaded from ``named`` where it has them) and a ``Muon`` holding ``named``'s state,
    built as a ``"type": "DsMuon"`` entry with ``settings`` as its ``params`` builds it (``lr``, ``adam_lr``,
    ``momentum``, ... : ``muon_param_groups`` and ``Muon`` keywords), so its groups are the engine's."""
    from .deepspeed import build_optimizer

    if named.weights:
        _load_weights(model, named.weights)
    muon = build_optimizer(model, dict({"log_summary": False}, **(settings or {})))
    load_named(muon, named, fresh=fresh)
    return muon


def _load_weights(model: nn.Module, weights: Dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name in weights and tuple(weights[name].shape) != tuple(p.shape):
            raise ValueError(f"ds_muon.convert: {name} is {list(weights[name].shape)} in the source and "
                             f"{list(p.shape)} in the model: the checkpoint is from another model")
    missing = sorted(set(params) - set(weights))
    if missing and any(n in weights for n in params):
        raise ValueError(f"ds_muon.convert: the source has no weights for {missing[:5]} ({len(missing)} in all)")
    with torch.no_grad():
        for name, p in params.items():
            if name in weights:
                p.copy_(weights[name].to(p.dtype))


# -- writing -----------------------------------------------------------------------------------------------
def write_torch(model: nn.Module, muon: Muon, path: str) -> str:
    torch.save({"model": model.state_dict(), "optim": muon.state_dict()}, path)
    return path


def write_dcp(model: nn.Module, muon: Muon, folder: str) -> str:
    """``{"model", "optim"}`` as ``get_state_dict`` gives them (FQN-keyed optimizer state), saved with DCP: FSDP2
    at any world size loads it with ``dcp.load`` + ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with _one_rank_group():
        msd, osd = get_state_dict(model, muon)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    return folder


@contextlib.contextmanager
def _one_rank_group():
    """A gloo group of one rank while ``body`` runs, when the caller has none (DeepSpeed and DCP writers)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def write_universal(model: nn.Module, muon: Muon, folder: str, config: Optional[dict] = None,
                    tag: Optional[str] = None) -> str:
    """A DeepSpeed universal checkpoint of ``model`` and ``muon``'s state: a one-rank ZeRO-1 DsMuon engine
    (``config``'s DsMuon entry and settings) is given the state through DeepSpeed's
    ``safe_set_full_optimizer_state``, saves with ``save_checkpoint``, and is converted by
    :func:`ds_muon.integrations.deepspeed_universal.zero_to_universal` into ``folder`` (``latest_universal`` beside it)."""
    from deepspeed.utils import safe_set_full_optimizer_state

    from .deepspeed import initialize
    from .integrations.deepspeed_universal import zero_to_universal

    cfg = dict(config or {})
    cfg.setdefault("optimizer", {"type": "DsMuon", "params": {}})
    cfg["train_micro_batch_size_per_gpu"] = 1
    cfg.pop("train_batch_size", None)
    cfg["zero_optimization"] = dict(cfg.get("zero_optimization") or {}, stage=1)
    cfg.pop("checkpoint", None)
    by_name = {}
    for g in muon.param_groups:
        for p, n in zip(g["params"], g["param_names"]):
            by_name[n] = (g["use_muon"], muon.state[p])
    held = [n for n, (_, st) in by_name.items() if NORMUON_V in st]
    if held:
        raise NotImplementedError(
            f"ds_muon.convert: {held[0]} (and {len(held) - 1} more) holds NorMuon's second moment ({NORMUON_V!r}), "
            "which this writer cannot lay out per DeepSpeed flat partition yet; nothing was written. Convert to a "
            "torch file or DCP, or convert the DeepSpeed checkpoint itself (zero_to_universal carries it)")
    with _one_rank_group(), tempfile.TemporaryDirectory() as tmp:
        engine, _, _, _ = initialize(model=model, config=cfg)
        target = engine.basic_optimizer
        ours = {n for g in target.param_groups for n in g["param_names"]}
        if ours != set(by_name):
            raise ValueError(f"ds_muon.convert: the DeepSpeed config groups the tensors otherwise than the settings "
                             f"given ({sorted(ours ^ set(by_name))[:5]}); pass the same settings to both")
        target.runtime.fill_state()  # every group's state, so each tensor's fragment of it is linked below
        engine.optimizer._lazy_init_hp_params_optimizer_state()
        steps = {}
        for n, p in engine.module.named_parameters():
            use_muon, st = by_name[n]
            for k in (MUON_KEYS if use_muon else ADAMW_KEYS):
                safe_set_full_optimizer_state(p, st[k], k)
            if not use_muon:
                steps[n] = st["step"]
        if steps:
            first = next(iter(steps.values()))
            if any(not torch.equal(s, first) for s in steps.values()):
                raise ValueError("ds_muon.convert: the AdamW tensors have different step counts; ZeRO keeps one per "
                                 "group")
            for flat, st in target.state.items():
                if "step" in st:
                    st["step"] = first.clone()
        tag = tag or os.path.basename(os.path.abspath(folder))
        engine.save_checkpoint(tmp, tag=tag)
        return zero_to_universal(os.path.join(tmp, tag), folder)


def convert(src, dst: str, model: nn.Module, to: str = "universal", source: str = "auto",
            settings: Optional[Dict[str, Any]] = None, config: Optional[dict] = None, fresh: bool = False,
            param_names=None) -> str:
    """``src`` (any source format) → ``dst`` in ds_muon's groups for ``model``: ``to`` is ``"universal"``
    (DeepSpeed, any ZeRO stage and world size), ``"dcp"`` (FSDP2, any world size) or ``"torch"`` (one file)."""
    if to not in TARGETS:
        raise ValueError(f"ds_muon.convert: to={to!r} is unknown; use one of {list(TARGETS)}")
    config, settings = resolve_config(config, settings)
    muon = build(model, read(src, source, param_names), settings, fresh=fresh)
    return write(to, model, muon, dst, config, settings)


def resolve_config(config, settings: Optional[Dict[str, Any]]):
    """(the DeepSpeed config as a dict or None, the settings): a config's DsMuon params are the settings
    unless ``settings`` are given."""
    if config is None or settings is not None and not isinstance(config, (str, os.PathLike)):
        return config, settings
    from .deepspeed import is_dsmuon_entry, load_config

    cfg = load_config(config)
    if not isinstance(cfg, dict):
        raise ValueError(f"ds_muon.convert: the DeepSpeed config is a JSON {type(cfg).__name__}, not an object")
    if settings is None:
        params = cfg["optimizer"].get("params") if is_dsmuon_entry(cfg) else None
        if params is not None and not isinstance(params, dict):
            raise ValueError("ds_muon.convert: the DeepSpeed config's optimizer.params is not a JSON object")
        settings = dict(params or {}) if is_dsmuon_entry(cfg) else None
    return cfg, settings


def write(to: str, model: nn.Module, muon: Muon, dst: str, config: Optional[dict] = None,
          settings: Optional[Dict[str, Any]] = None) -> str:
    """Write ``muon`` (and ``model``'s weights) as ``to`` at ``dst``; returns what was written."""
    if to == "torch":
        return write_torch(model, muon, dst)
    if to == "dcp":
        return write_dcp(model, muon, dst)
    if config is None:
        config = {"optimizer": {"type": "DsMuon", "params": dict(settings or {})}}
    return write_universal(model, muon, dst, config)


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


def _settings_from(items: Iterable[str]) -> Dict[str, Any]:
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
