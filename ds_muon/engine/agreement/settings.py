"""Param groups: their defaults, every setting's validation, and dtypes stored by name.

Groups are plain dicts that schedulers and users edit and that checkpoints carry, so
every setting is checked at construction, at load and at the start of every step,
and raises ValueError naming the group and the setting before anything changes.
"""

from __future__ import annotations

import inspect
import math
from typing import Dict, List, Optional

import torch

from ...rules.decay import WEIGHT_DECAY_MODES, check_mode  # noqa: F401 (the modes, read from here by callers)
from ...rules.newton_schulz import NS_METHODS, resolve_coefficients
from ...rules.ns_auto import AUTO
from ...rules.normuon import VARIANTS
from ...rules.scaling import check_scale_mode
from ..exchange.layout import global_shape, is_flat_shard


def as_dtype(value, name: str) -> torch.dtype:
    """A floating-point torch dtype from a dtype or its name ('bfloat16', 'torch.float32')."""
    d = value
    if isinstance(value, str):
        d = getattr(torch, value.replace("torch.", ""), None)
    if isinstance(d, torch.dtype) and d.is_floating_point and not d.is_complex:
        return d
    raise ValueError(f"{name}={value!r} is not a floating-point torch dtype (e.g. torch.bfloat16 or 'float32')")


_DTYPE_NAMES: Dict[object, str] = {}  # accepted dtypes and names -> name (the per-step check is a dict hit)


def dtype_name(value, name: str) -> str:
    """The name param_groups store (``'bfloat16'``): checkpoint tools (DCP's full and
    cpu-offloaded state dicts) walk param_groups and refuse a ``torch.dtype`` value."""
    try:
        return _DTYPE_NAMES[value]
    except (KeyError, TypeError):
        out = str(as_dtype(value, name)).replace("torch.", "")
        _DTYPE_NAMES[value] = out
        return out


def ns_dtype_name(value) -> str:
    """What a group stores for ``ns_dtype``: ``"auto"`` (the device decides at the step:
    :mod:`ds_muon.rules.ns_auto`) or a dtype's name."""
    if value == AUTO:
        return AUTO
    try:
        return dtype_name(value, "ns_dtype")
    except ValueError:
        raise ValueError(f"ns_dtype={value!r} is not a floating-point torch dtype (e.g. torch.bfloat16 or 'float32') "
                         "or 'auto' (the machine's fast dtype)") from None


# Keys torch's Optimizer.__setstate__ (run by load_state_dict) adds to ``defaults`` that are no
# ds_muon setting: copied into groups they would make a loaded optimizer's param_groups differ
# from the one that saved them (torch's own optimizers never copy them either).
TORCH_ADDED_DEFAULTS = ("differentiable",)


def fill_group_defaults(group: dict, defaults: dict, adam_betas, adam_eps) -> None:
    """Keys a group from an older ds_muon lacks: AdamW's ``betas``/``eps`` from the
    optimizer's ``adam_betas``/``adam_eps``, everything else that acts on the group's kind
    from ``defaults`` (a Muon-only default is not filled into an AdamW group: see :data:`SCOPE`)."""
    muon = group.setdefault("use_muon", True)
    if not muon:
        group.setdefault("betas", tuple(adam_betas))
        group.setdefault("eps", adam_eps)
    for k, v in defaults.items():
        if k not in TORCH_ADDED_DEFAULTS and acts_on(k, muon):
            group.setdefault(k, v)


# -- where each group key acts ------------------------------------------------------------------
# A group key acts on Muon groups (use_muon=True), on AdamW groups (use_muon=False), or on both;
# one given on a group of the other kind would do nothing, so it is refused (naming where it acts).
# Keys not listed (lr, weight_decay, weight_decay_mode, eps, foreach, use_muon, params and the
# param_* records, and anything torch or a scheduler adds: initial_lr, ...) are not checked.
MUON_KEYS = ("momentum", "nesterov", "ns_steps", "ns_coefficients", "ns_method", "ns_dtype", "scale_mode",
             "extra_scale_factor", "variant", "normuon_beta2", "compile",
             "adam_lr", "adam_betas", "adam_eps", "adam_weight_decay",  # the AdamW slices of FSDP1 mixed flat shards
             "head_names", "routers")  # how an FSDP1 flat shard of the group is bound
ADAMW_KEYS = ("betas",)
SCOPE: Dict[str, bool] = {**{k: True for k in MUON_KEYS}, **{k: False for k in ADAMW_KEYS}}  # key -> use_muon it needs
_OTHER_SPELLING = {  # (key, on a group of use_muon=...) -> the key that does it there
    ("momentum", False): "betas", ("adam_betas", False): "betas", ("adam_lr", False): "lr",
    ("adam_eps", False): "eps", ("adam_weight_decay", False): "weight_decay",
    ("betas", True): "momentum (or adam_betas for the AdamW slices of FSDP1 mixed flat shards)",
}


def acts_on(key: str, use_muon: bool) -> bool:
    """Does group key ``key`` act on a group with this ``use_muon``?"""
    return SCOPE.get(key, use_muon) == bool(use_muon)


def _kind(use_muon: bool) -> str:
    return "Muon groups (use_muon=True)" if use_muon else "AdamW groups (use_muon=False)"


def no_effect(group: dict, gi: int, key: str, how: str = "given") -> str:
    """The refusal of ``key`` on a group where it does nothing."""
    muon = bool(group.get("use_muon", True))
    other = _OTHER_SPELLING.get((key, muon))
    fix = f"on this group use {other} instead" if other else f"remove it, or put it on a {'AdamW' if muon else 'Muon'} group"
    return (f"param_groups[{gi}] ({'Muon' if muon else 'AdamW'}, use_muon={muon}): {key}={group[key]!r} is {how} but "
            f"acts only on {_kind(not muon)}; here it would do nothing: {fix} (Muon(...) keywords are defaults "
            "for the groups where they act)")


VARIANT_KEYS = {"normuon_beta2": "normuon"}  # Muon group keys that one variant alone reads


def check_variant_keys(group: dict, gi: int, defaults: dict, given=(), how: str = "given") -> None:
    """ValueError when a key only one variant reads (:data:`VARIANT_KEYS`) is on a Muon group of another
    variant, given there (``given``) or set to a value other than the optimizer's default: it would do nothing.
    (The default itself stays filled in, so a group switched to that variant later finds it.)"""
    if group.get("use_muon", True) is not True:
        return
    variant = group.get("variant", defaults.get("variant"))
    for key, needs in VARIANT_KEYS.items():
        if key in group and variant != needs and (key in given or not (key in defaults
                                                                          and _same(group[key], defaults[key]))):
            raise ValueError(f"param_groups[{gi}] (Muon, variant={variant!r}): {key}={group[key]!r} is {how} but only "
                             f"variant={needs!r} reads it; here it would do nothing: remove it, or set "
                             f"variant={needs!r} on this group")


def check_given_keys(group: dict, gi: int, given) -> None:
    """ValueError when a key ``given`` on the group (not a filled default) does nothing on its kind."""
    muon = group.get("use_muon", True)
    if not isinstance(muon, bool):
        return  # refused by check_settings, naming use_muon
    for key in given:
        if not acts_on(key, muon):
            raise ValueError(no_effect(group, gi, key))


def drop_filled_defaults(group: dict, given) -> None:
    """Remove defaults torch's ``add_param_group`` filled in that do nothing on this group's kind."""
    muon = bool(group.get("use_muon", True))
    for key in [k for k in group if k not in given and not acts_on(k, muon)]:
        del group[key]


def check_edited_keys(group: dict, gi: int, defaults: dict) -> None:
    """At every step: a key edited into ``param_groups`` where it does nothing (a value other than the
    optimizer's default for it: an equal one changes nothing and is left alone)."""
    muon = group["use_muon"]
    for key in group:
        if not acts_on(key, muon) and not (key in defaults and _same(group[key], defaults[key])):
            raise ValueError(no_effect(group, gi, key, "set"))
    check_variant_keys(group, gi, defaults, how="set")


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an odd value: not the default
        return False


def _old_format(group: dict, defaults: dict) -> bool:
    """A group of an older ds_muon, which filled every default into every group?"""
    filled = [k for k in defaults if not acts_on(k, bool(group.get("use_muon", True)))]
    return bool(filled) and all(k in group for k in filled)


def drop_old_defaults(group: dict, defaults: dict) -> None:
    """In place (a pickle of an older ds_muon): the defaults it filled where they do nothing."""
    if _old_format(group, defaults):
        for key in [k for k in defaults if k in group and not acts_on(k, bool(group["use_muon"]))]:
            del group[key]


def loaded_group(saved: dict, gi: int, defaults: dict) -> dict:
    """A saved group with the keys that do nothing on its kind refused or dropped, before anything is
    assigned.  A state dict of this ds_muon holds only keys that act; one of an older ds_muon holds every
    default in every group (all of them filled, so none was given: dropped).  Otherwise a key equal to the
    default is dropped (it changes nothing) and any other is refused, as at construction."""
    muon = bool(saved.get("use_muon", True))
    try:
        check_variant_keys(saved, gi, defaults, how="saved")
    except ValueError as e:
        raise ValueError(f"ds_muon: loaded {e}; nothing was loaded") from None
    foreign = [k for k in saved if not acts_on(k, muon)]
    if not foreign:
        return saved
    old_format = _old_format(saved, defaults)
    out = dict(saved)
    for key in foreign:
        if not old_format or key not in defaults:
            if not (key in defaults and _same(saved[key], defaults[key])):
                raise ValueError("ds_muon: loaded " + no_effect(saved, gi, key, "saved") + "; nothing was loaded")
        del out[key]
    return out


def validate_group(group: dict, gi: int) -> None:
    """Every setting (:func:`check_settings`) and the tensors of one group."""
    check_settings(group, gi)
    for p in group["params"]:
        if torch.is_complex(p):
            raise ValueError(f"param_groups[{gi}]: complex parameter of shape {tuple(p.shape)}; ds_muon supports real tensors only")
    if not group["use_muon"]:
        return
    names = group.get("param_names")
    for pi, p in enumerate(group["params"]):
        if len(global_shape(p)) < 2 and not is_flat_shard(p):
            name = names[pi] if names else f"params[{pi}]"
            raise ValueError(
                f"param_groups[{gi}] {name}: a Muon group holds a tensor of shape {global_shape(p)}; Muon "
                "needs matrices (ndim >= 2). Build groups with ds_muon.muon_param_groups(model) or put "
                "this tensor in a group with use_muon=False (AdamW)"
            )


# Group settings that are booleans.  Python reads any non-empty string as true, so
# ``nesterov="false"`` (a JSON or YAML config) would run as *on*: they must be bools.
BOOLEAN_GROUP_KEYS = ("use_muon", "nesterov", "compile")
OPTIONAL_BOOLEAN_GROUP_KEYS = ("foreach",)  # torch's AdamW flag: None (its default choice), True or False


def check_boolean(value, name: str) -> bool:
    """``value`` if it is a bool, else ValueError naming the setting."""
    if not isinstance(value, bool):
        raise ValueError(_not_boolean(name, value))
    return value


def _not_boolean(name: str, value) -> str:
    hint = " (any non-empty string reads as true)" if isinstance(value, str) else ""
    return f"{name} must be True or False, got {value!r} ({type(value).__name__}){hint}"


def check_keyword_booleans(function, passed: dict) -> None:
    """Every keyword of ``function`` whose default is a bool must be passed a bool (found from
    the signature, so a new boolean keyword is checked too).  ``passed``: the call's ``locals()``."""
    for name, param in inspect.signature(function).parameters.items():
        if isinstance(param.default, bool) and name in passed:
            check_boolean(passed[name], name)


def _check_booleans(group: dict, gi: int) -> None:
    for key in BOOLEAN_GROUP_KEYS:
        if key in group and not isinstance(group[key], bool):
            raise ValueError(f"param_groups[{gi}]: {_not_boolean(key, group[key])}")
    for key in OPTIONAL_BOOLEAN_GROUP_KEYS:
        v = group.get(key)
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"param_groups[{gi}]: {_not_boolean(key, v)} (or None)")


def _number(group: dict, key: str, gi: int, low: float = 0.0, strict: bool = False, below: Optional[float] = None):
    """``group[key]`` as a finite real number in [low, below) (or (low, ...) if strict), else ValueError.
    NaN fails every comparison, so it is refused like any other bad value."""
    v = group[key]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if ok:
        ok = (v > low if strict else v >= low) and (v < below if below is not None else v < math.inf)
    if not ok:
        span = f"{'(' if strict else '['}{low}, {below if below is not None else 'inf'})"
        raise ValueError(f"param_groups[{gi}]: {key} must be a finite number in {span}, got {v!r}")
    return v


def _check_lr(group: dict, key: str, gi: int) -> None:
    """A learning rate: a finite number >= 0 or, as in torch.optim, a 1-element tensor."""
    lr = group[key]
    if torch.is_tensor(lr):
        if lr.numel() != 1 or lr.is_complex():
            raise ValueError(f"param_groups[{gi}]: Tensor {key} must be 1-element (and real), got shape {tuple(lr.shape)}")
        if not group["use_muon"] and group.get("foreach"):
            raise ValueError(f"param_groups[{gi}]: a tensor {key} needs foreach=False (torch's AdamW refuses it with foreach=True)")
        if lr.device.type != "cpu":
            return  # reading it would wait for the device every step; torch.optim does not check it either
        lr = lr.item()
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0.0 <= lr < math.inf):
        raise ValueError(f"param_groups[{gi}]: {key} must be a finite number >= 0, got {group[key]!r}")


def _check_betas(group: dict, key: str, gi: int) -> None:
    betas = group[key]
    try:
        b1, b2 = betas
        ok = all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in (b1, b2))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"param_groups[{gi}]: {key} must be two numbers in [0, 1), got {betas!r}")


_GOOD_SCHEDULES: set = set()  # (coefficients, steps) seen valid; the per-step check is a set hit


def _check_schedule(coefficients, steps) -> None:
    try:
        key = (coefficients, steps, type(steps))
        if key in _GOOD_SCHEDULES:
            return
    except TypeError:  # a list of triples: not hashable, checked in full
        key = None
    resolve_coefficients(coefficients, steps)
    if key is not None:
        _GOOD_SCHEDULES.add(key)


def check_settings(group: dict, gi: int) -> None:
    """Every hyper-parameter of one group, checked before anything changes (at
    construction, at load and at the start of every ``step()``: groups are plain
    dicts that schedulers and users edit).  Raises ValueError naming the group and
    the setting.  A ``torch.dtype`` ``ns_dtype`` is stored by name."""
    _check_booleans(group, gi)
    _check_lr(group, "lr", gi)
    _number(group, "weight_decay", gi)
    _check_decay_mode(group, gi)
    if not group["use_muon"]:
        _check_betas(group, "betas", gi)
        _number(group, "eps", gi)
        return
    _number(group, "momentum", gi, below=1.0)
    if group["variant"] not in VARIANTS:
        raise ValueError(f"param_groups[{gi}]: variant={group['variant']!r} is unknown; use one of {list(VARIANTS)}")
    _number(group, "normuon_beta2", gi, below=1.0)  # NorMuon's second-moment decay (read only by normuon)
    try:
        _check_schedule(group["ns_coefficients"], group["ns_steps"])
        check_scale_mode(group["scale_mode"])
        group["ns_dtype"] = ns_dtype_name(group["ns_dtype"])
    except ValueError as e:
        raise ValueError(f"param_groups[{gi}]: {e}") from None
    if group["ns_method"] not in NS_METHODS:
        raise ValueError(f"param_groups[{gi}]: ns_method={group['ns_method']!r} is unknown; use one of {list(NS_METHODS)}")
    _number(group, "eps", gi, strict=True)  # the NS normalisation floor
    _number(group, "extra_scale_factor", gi)
    for key in ("adam_lr", "adam_weight_decay", "adam_eps", "adam_betas"):  # mixed flat shards (FSDP1)
        if key in group:
            {"adam_lr": _check_lr, "adam_betas": _check_betas}.get(key, _number)(group, key, gi)


def _check_decay_mode(group: dict, gi: int) -> None:
    """The mode (AdamW groups too: they decay by it, ds_muon.rules.decay.adamw_decay_); independent
    decay multiplies by ``1 - weight_decay`` every step, so there it must be below 1 (and so must
    ``adam_weight_decay``, the AdamW slices' decay of a Muon group)."""
    mode = group.get("weight_decay_mode", "decoupled")  # an AdamW group from before AdamW read it
    bad = check_mode(mode)
    if bad:
        raise ValueError(f"param_groups[{gi}]: {bad}")
    if mode == "independent":
        for key in ("weight_decay", "adam_weight_decay"):
            if key in group and isinstance(group[key], (int, float)) and group[key] >= 1:
                raise ValueError(
                    f"param_groups[{gi}]: {key}={group[key]!r} with weight_decay_mode='independent' multiplies the "
                    f"weights by 1 - {key} = {1 - group[key]!r} every step (independent decay is not scaled by lr); "
                    f"use a {key} in [0, 1), typically lr times the decoupled value")


def check_loaded_groups(groups: List[dict], saved_groups: List[dict], defaults: dict, adam_betas, adam_eps) -> None:
    """ValueError, before anything changes, when a saved group would give its tensors
    the other algorithm or other tensors' state, or holds an invalid setting."""
    if len(saved_groups) != len(groups):
        return  # torch's own check names this
    for gi, (now, saved) in enumerate(zip(groups, saved_groups)):
        saved = dict(saved)
        fill_group_defaults(saved, defaults, adam_betas, adam_eps)
        if bool(saved["use_muon"]) != bool(now["use_muon"]):
            first = (now.get("param_names") or saved.get("param_names") or ["?"])[0]
            raise ValueError(
                f"ds_muon: loaded param_groups[{gi}] has use_muon={saved['use_muon']} but this optimizer's "
                f"group {gi} (first tensor {first}) has use_muon={now['use_muon']}: the state dict's groups are "
                "in another order or from other groups; build the optimizer with the groups it was saved with")
        ours, theirs = now.get("param_names"), saved.get("param_names")
        if ours and theirs and list(ours) != list(theirs):
            k = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            a = ours[k] if k < len(ours) else "(none)"
            b = theirs[k] if k < len(theirs) else "(none)"
            raise ValueError(
                f"ds_muon: loaded param_groups[{gi}] names tensor {k} {b!r} but this optimizer's group names "
                f"{a!r}: the state would go to the wrong tensors; build the optimizer with the groups (and "
                "tensor order) it was saved with")
        check_settings(saved, gi)
