"""Optimizer state that does not fit its parameter, refused before anything changes.

Two ways in: a loaded state dict (``Muon.load_state_dict``: torch casts floating-point
state to the parameter's dtype and device, but takes any shape), and a parameter that
changed after the state was made (``model.to(torch.bfloat16)`` after some steps: the
state stays float32).  Either would fail inside the step (an unnamed size or dtype error
from a foreach kernel) after AdamW had already written its tensors.  These checks run at
load and at the start of every step, before the first write, and name the tensor.

torch.optim's own AdamW and Muon fail on a dtype change too (``expected dtype float for
`end```); their remedy, and ours, is the load's cast: ``opt.load_state_dict(opt.state_dict())``.
"""

from __future__ import annotations

from itertools import chain
from typing import Callable, List, Mapping

import torch

from ..exchange.row_moments import KEY as MOMENT_KEY

STATE_TENSORS = ("momentum_buffer", "exp_avg", "exp_avg_sq")  # shaped like their parameter
ADAMW_KEYS = ("step", "exp_avg", "exp_avg_sq")  # AdamW's state: all of them or none
RECAST = ("cast the state to the parameters' dtypes and devices as torch's load does: "
          "opt.load_state_dict(opt.state_dict()); or build a new optimizer")


def check_loaded_state(groups: List[dict], state_dict: Mapping, name: Callable[[int, int], str]) -> None:
    """ValueError naming the tensor when the saved state of a parameter of ``groups`` (matched as
    torch's load matches them: in order) holds a tensor of another shape than the parameter, a
    non-real-floating tensor (torch would cast it silently), or an incomplete AdamW state."""
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if len(saved_groups) != len(groups) or any(len(s["params"]) != len(g["params"])
                                               for s, g in zip(saved_groups, groups)):
        return  # torch's own check names this
    where = [(gi, pi) for gi, g in enumerate(groups) for pi in range(len(g["params"]))]
    for (gi, pi), saved_id in zip(where, chain.from_iterable(s["params"] for s in saved_groups)):
        st = saved_state.get(saved_id)
        if not st:
            continue
        p = groups[gi]["params"][pi]
        for key, v in st.items():
            if key == "step":
                if torch.is_tensor(v) and v.numel() != 1:
                    raise ValueError(f"ds_muon: loaded state of {name(gi, pi)}: 'step' holds {v.numel()} "
                                     "elements, not one; the state dict is not this optimizer's")
                continue
            if not torch.is_tensor(v):
                continue
            if key == MOMENT_KEY:  # NorMuon's v: whole per matrix, 1-D (its length is checked at the step)
                if v.dim() != 1 or not v.is_floating_point() or v.is_complex():
                    raise ValueError(f"ds_muon: loaded state of {name(gi, pi)}: {key!r} is {v.dtype} of shape "
                                     f"{tuple(v.shape)}, not a 1-D real floating-point tensor; nothing was loaded")
                continue
            if tuple(v.shape) != tuple(p.shape):
                raise ValueError(
                    f"ds_muon: loaded state of {name(gi, pi)}: {key!r} has shape {tuple(v.shape)} but the parameter "
                    f"has shape {tuple(p.shape)}; nothing was loaded. The state dict comes from another model or "
                    "another order of tensors: load it into the optimizer of the model it was saved from (state of "
                    "another optimizer or layout comes over by tensor name with ds_muon.convert / `ds-muon convert`, "
                    "docs/CHECKPOINTS.md)")
            if not v.is_floating_point() or v.is_complex():
                raise ValueError(
                    f"ds_muon: loaded state of {name(gi, pi)}: {key!r} is {v.dtype}, not a real floating-point "
                    "tensor; nothing was loaded")
        if not groups[gi]["use_muon"]:  # a Muon tensor's moments (FSDP1 mixed slices) carry no step of their own
            _check_adamw_keys(st, name(gi, pi), "loaded state of ")


def _check_adamw_keys(st: Mapping, who: str, what: str = "") -> None:
    held = [k for k in ADAMW_KEYS if k in st]
    if held and len(held) != len(ADAMW_KEYS):
        missing = [k for k in ADAMW_KEYS if k not in st]
        raise ValueError(f"ds_muon: {what}{who}: AdamW's state holds {held} but lacks {missing}; nothing was "
                         "changed. Load a complete state dict, or drop this tensor's state to start it afresh")


def check_state(groups: List[dict], state: Mapping, name: Callable[[int, int], str]) -> None:
    """Before the step writes anything: every state tensor shaped, typed and placed as its
    parameter (the state ``_init_state`` made, or one a user or a dtype change altered)."""
    for gi, g in enumerate(groups):
        for pi, p in enumerate(g["params"]):
            st = state.get(p)
            if not st:
                continue
            for key in STATE_TENSORS:
                v = st.get(key)
                if v is None:
                    continue
                if v.shape != p.shape:
                    raise ValueError(
                        f"ds_muon: {name(gi, pi)} has shape {tuple(p.shape)} but its optimizer state {key!r} has "
                        f"shape {tuple(v.shape)}; nothing was changed. Was the parameter replaced or resized "
                        "after the optimizer made its state? Drop that tensor's state (opt.state.pop(param)) to "
                        "start it afresh, or rebuild the optimizer")
                if v.dtype != p.dtype or v.device != p.device:
                    raise ValueError(
                        f"ds_muon: {name(gi, pi)} is {p.dtype} on {p.device} but its optimizer state {key!r} is "
                        f"{v.dtype} on {v.device} (the parameter changed after the optimizer made its state, e.g. "
                        f"model.to(torch.bfloat16)); nothing was changed (torch.optim's AdamW and Muon refuse "
                        f"this too). To go on at the new dtype, {RECAST}")
            if not g["use_muon"]:
                _check_adamw_keys(st, name(gi, pi))


def check_state_listed(groups: List[dict], state: Mapping, deepspeed: bool) -> None:
    """Before a state dict is saved: RuntimeError when the optimizer holds state of tensors ``groups``
    do not list now (``deepspeed``: a stack that narrows ``param_groups`` outside ``step()``; the error
    says how to save through it)."""
    held = {id(p) for g in groups for p in g["params"]}
    if any(id(p) not in held for p in state):
        raise RuntimeError(
            "ds_muon: Muon.state_dict(): the optimizer holds state of tensors its param_groups do not list now "
            + ("(DeepSpeed ZeRO-3 hands the optimizer its partitions only inside step()): save through DeepSpeed, "
               "engine.optimizer.state_dict() (what deepspeed.initialize returned as the optimizer; no collective) "
               "or engine.save_checkpoint(dir) on every rank" if deepspeed else
               "(a tensor was removed from param_groups): drop its state (opt.state.pop(param)) first"))
