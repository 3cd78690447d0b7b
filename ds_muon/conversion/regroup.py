"""Source state given to ds_muon's own groups (:func:`ds_muon.muon_param_groups` of the model), matched by
tensor name and shape; a tensor whose source state is another algorithm's is refused unless started fresh."""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..optimizer import Muon
from ..setup.build import build_optimizer
from .named import ADAMW_KEYS, MUON_KEYS, NORMUON_V, Named
from .read import named_state


OTHER_MODEL = "give the model the checkpoint was saved from (--model)"


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
                             f"tensor is {list(like.shape)}: the checkpoint is from another model; {OTHER_MODEL}")
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
    known = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    unknown = sorted(set(named.state) - known)
    if unknown:
        raise ValueError(f"ds_muon.convert: the source holds optimizer state for {len(unknown)} tensor(s) the model "
                         f"does not have ({unknown[:3]}): the checkpoint is from another model; {OTHER_MODEL}")
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
                             f"{list(p.shape)} in the model: the checkpoint is from another model; {OTHER_MODEL}")
    missing = sorted(set(params) - set(weights))
    if missing and any(n in weights for n in params):
        raise ValueError(f"ds_muon.convert: the source has no weights for {missing[:5]} ({len(missing)} in all); "
                         f"{OTHER_MODEL}")
    with torch.no_grad():
        for name, p in params.items():
            if name in weights:
                p.copy_(weights[name].to(p.dtype))
