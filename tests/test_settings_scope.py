"""A setting that does nothing is an error: a census over (group key, group kind, door).

Every group key acts on Muon groups (``use_muon=True``), on AdamW groups (``use_muon=False``) or on
both (the table below is the spec, written here independently of ds_muon.engine.agreement.settings).  Given where
it acts, a key is accepted and lands there; given where it does nothing, it is refused with a
ValueError naming the group and the key, and nothing changes.  Doors: a group dict at construction,
``add_param_group``, ``load_state_dict`` of a saved group carrying it, an edit of ``param_groups``
before a step, ``muon_param_groups(**options)``; and the settings doors, which take keywords rather
than groups (the DsMuon JSON's ``params``, ``ds_muon.accelerate`` settings, ``MuonTrainer``'s
``muon_settings``): whatever they accept must land only on groups where it acts.
"""

from __future__ import annotations

import copy
import os

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st
import torch
from torch import nn

import ds_muon

MUON, ADAMW, BOTH = "muon", "adamw", "both"
# key -> (where it acts, a valid value other than the default, observable on a plain (non-FSDP1) model?)
KEYS = {
    "momentum": (MUON, 0.8, True), "nesterov": (MUON, False, True), "ns_steps": (MUON, 3, True),
    "ns_coefficients": (MUON, "polar_express", True), "ns_method": (MUON, "gram", False),
    "ns_dtype": (MUON, "float16", True), "scale_mode": (MUON, "spectral", True),  # (auto: bf16 or fp32)
    "extra_scale_factor": (MUON, 2.0, True), "variant": (MUON, "normuon", True), "normuon_beta2": (MUON, 0.5, False),
    "compile": (MUON, True, False),
    "adam_lr": (MUON, 1e-3, False), "adam_betas": (MUON, (0.8, 0.9), False), "adam_eps": (MUON, 1e-6, False),
    "adam_weight_decay": (MUON, 0.1, False), "head_names": (MUON, ("head",), False), "routers": (MUON, "muon", False),
    "betas": (ADAMW, (0.5, 0.6), True),
    "lr": (BOTH, 0.05, True), "weight_decay": (BOTH, 0.1, True), "eps": (BOTH, 0.5, True),
    "weight_decay_mode": (BOTH, "independent", False), "foreach": (BOTH, False, False),
}
# keys one Muon variant alone reads: on a Muon group of another variant they do nothing (a third kind of group)
VARIANT_OF = {"normuon_beta2": "normuon"}
OTHER_VARIANT = "muon of another variant"
GROUP_DOORS = ("construct", "add_param_group", "load_state_dict", "edit", "muon_param_groups")
SETTINGS_DOORS = ("json", "accelerate", "trainer")
PG_NAMED = ("lr", "weight_decay", "head_names", "routers", "adam_lr", "adam_weight_decay")  # muon_param_groups' own


def kinds_of(key):
    return (MUON, ADAMW) + ((OTHER_VARIANT,) if key in VARIANT_OF else ())


def acts(key, use_muon, kind=None):
    if kind == OTHER_VARIANT:
        return False
    where = KEYS[key][0]
    return where == BOTH or where == (MUON if use_muon else ADAMW)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))  # 2: the hidden matrix


def backward(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(5, 4, generator=g)).square().mean().backward()


def snapshot(model, opt):
    sd = opt.state_dict()
    return ([p.detach().clone() for p in model.parameters()], copy.deepcopy(sd["state"]),
            [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]])


def same(a, b):
    (pa, sa, ga), (pb, sb, gb) = a, b
    flat = lambda s: [(i, k, v) for i in sorted(s) for k, v in sorted(s[i].items())]  # noqa: E731
    return (all(torch.equal(x, y) for x, y in zip(pa, pb)) and ga == gb
            and [(i, k) for i, k, _ in flat(sa)] == [(i, k) for i, k, _ in flat(sb)]
            and all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for (_, _, x), (_, _, y) in zip(flat(sa), flat(sb))))


def trained(seed=0, **kw):
    model = mlp(seed)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model), log_summary=False, **kw)
    backward(model)
    opt.step()
    opt.zero_grad()
    return model, opt


def refused_by_name(fn, gi, key):
    """None if ``fn`` raised the ValueError naming param_groups[gi] and key, else what happened."""
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        return None if f"param_groups[{gi}]" in msg and key in msg else f"ValueError without the group or key: {msg}"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "accepted"


_FIXED = object()


def group_door(key, kind, door, value=_FIXED):
    """'ok' when the case behaves, else what went wrong (never raises)."""
    value = KEYS[key][1] if value is _FIXED else value
    gi = 1 if kind == ADAMW else 0
    use_muon = kind != ADAMW
    foreign = not acts(key, use_muon, kind)
    extra = {"variant": VARIANT_OF[key]} if kind == MUON and key in VARIANT_OF else {}  # the variant that reads it
    model = mlp()
    if door == "muon_param_groups":
        if not use_muon or key in PG_NAMED:
            return "n/a"  # its options go to the Muon group; its named keywords mean something else
        build = lambda: ds_muon.Muon(ds_muon.muon_param_groups(model, **{key: value}, **extra),  # noqa: E731
                                     log_summary=False)
    elif door == "construct":
        def build():
            groups = ds_muon.muon_param_groups(model)
            groups[gi].update({key: value}, **extra)
            return ds_muon.Muon(groups, log_summary=False)
    elif door == "add_param_group":
        groups = ds_muon.muon_param_groups(model)
        opt0 = ds_muon.Muon([groups[1 - gi]], log_summary=False)
        groups[gi].update({key: value}, **extra)

        def build():
            opt0.add_param_group(groups[gi])
            return opt0
        if foreign:
            why = refused_by_name(build, 1, key)
            if why:
                return why
            return "ok" if len(opt0.param_groups) == 1 else "refused but the group was added"
        opt = build()
        return "ok" if opt.param_groups[1][key] == value else f"lands as {opt.param_groups[1].get(key)!r}"
    elif door == "load_state_dict":
        _, src = trained()
        sd = src.state_dict()
        sd["param_groups"][gi].update({key: value}, **extra)
        model, opt = trained(1)
        before = snapshot(model, opt)
        if foreign:
            why = refused_by_name(lambda: opt.load_state_dict(sd), gi, key)
            return why or ("ok" if same(before, snapshot(model, opt)) else "refused but something changed")
        opt.load_state_dict(sd)
        return "ok" if opt.param_groups[gi][key] == value else f"lands as {opt.param_groups[gi].get(key)!r}"
    elif door == "edit":
        model, opt = trained()
        opt.param_groups[gi].update({key: value}, **extra)
        backward(model, 2)
        before = snapshot(model, opt)
        if foreign:
            why = refused_by_name(opt.step, gi, key)
            return why or ("ok" if same(before, snapshot(model, opt)) else "refused but something changed")
        if key != "compile":  # (compiling NS here would only cost time)
            opt.step()
        return "ok" if opt.param_groups[gi][key] == value else "edited value lost"
    if foreign:
        return refused_by_name(build, gi, key) or "ok"
    opt = build()
    return "ok" if opt.param_groups[gi][key] == value else f"lands as {opt.param_groups[gi].get(key)!r}"


def foreign_keys(opt):
    """Group keys (of the table) that sit on a group where they do nothing."""
    return [(gi, k) for gi, g in enumerate(opt.param_groups) for k in g if k in KEYS and not acts(k, g["use_muon"])]


LANDS = {"adam_lr": ("lr", False), "adam_weight_decay": ("weight_decay", False), "adam_betas": ("betas", False),
         "adam_eps": ("eps", False)}  # settings-door keys that set another key of the AdamW group


def settings_door(key, door, trainer=None):
    value = KEYS[key][1]
    model = mlp()
    if door == "json":
        from ds_muon.deepspeed import build_optimizer
        build = lambda: build_optimizer(model, {key: list(value) if isinstance(value, tuple) else value})  # noqa: E731
    elif door == "accelerate":
        from ds_muon.accelerate import build_muon
        build = lambda: build_muon(model, {key: value})  # noqa: E731
    else:
        def build():
            trainer.optimizer, trainer.muon = None, None
            trainer.muon_settings = {key: value}
            return trainer.create_optimizer()
    try:
        opt = build()
    except (ValueError, TypeError) as e:
        return "ok" if key in str(e) else f"refused without naming {key}: {e}"
    if key in ("head_names", "routers"):  # classification inputs of muon_param_groups, not group keys here
        return "ok" if not foreign_keys(opt) else f"keys where they do nothing: {foreign_keys(opt)}"
    target, use_muon = LANDS.get(key, (key, True))
    landed = [g.get(target) == (tuple(value) if isinstance(value, tuple) else value)
              for g in opt.param_groups if g["use_muon"] == use_muon]
    if not landed or not all(landed):
        return f"{target} of the {'Muon' if use_muon else 'AdamW'} group is not {value!r}"
    return "ok" if not foreign_keys(opt) else f"keys where they do nothing: {foreign_keys(opt)}"


def make_trainer(tmp_path):
    from transformers import TrainingArguments

    from ds_muon.trainer import MuonTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    return MuonTrainer(model=mlp(), args=args, muon_settings={})


def test_every_key_kind_and_door_is_accepted_where_it_acts_and_refused_by_name_elsewhere(tmp_path):
    """The census: 23 keys x 2 kinds (3 for a key one variant alone reads) x 5 group doors (minus n/a) + 23 keys
    x 3 settings doors."""
    trainer = make_trainer(tmp_path)
    results = {}
    for key in KEYS:
        for kind in kinds_of(key):
            for door in GROUP_DOORS:
                try:
                    results[(key, kind, door)] = group_door(key, kind, door)
                except Exception as e:  # noqa: BLE001 - a case that crashed is a failure, reported below
                    results[(key, kind, door)] = f"raised {type(e).__name__}: {e}"
        for door in SETTINGS_DOORS:
            try:
                results[(key, "-", door)] = settings_door(key, door, trainer)
            except Exception as e:  # noqa: BLE001
                results[(key, "-", door)] = f"raised {type(e).__name__}: {e}"
    members = {k: v for k, v in results.items() if v != "n/a"}
    bad = {k: v for k, v in members.items() if v != "ok"}
    print(f"settings scope census: {len(members) - len(bad)} of {len(members)} hold")
    assert not bad, f"{len(bad)} of {len(members)} fail, e.g.:\n" + "\n".join(
        f"{k}: {v[:300]}" for k, v in list(bad.items())[:25])


@pytest.mark.parametrize("key", [k for k, (_, _, seen) in KEYS.items() if seen])
def test_accepted_keys_change_the_step(key):
    """Where it is accepted a key acts: the same step with the key at another value moves the tensors
    of its group kind differently (keys observable on a plain model)."""
    where, value, _ = KEYS[key]
    out = {}
    for kind in ((MUON, ADAMW) if where == BOTH else (where,)):
        gi = 0 if kind == MUON else 1
        for v in (None, value):
            model = mlp()
            groups = ds_muon.muon_param_groups(model, adam_lr=1e-2)
            if v is not None:
                groups[gi][key] = v
            if key == "weight_decay_mode":
                groups[gi]["weight_decay"] = 0.1
            opt = ds_muon.Muon(groups, log_summary=False)
            for s in range(2):
                backward(model, s)
                opt.step()
                opt.zero_grad()
            out[(kind, v is None)] = [p.detach().clone() for p in opt.param_groups[gi]["params"]]
        assert not all(torch.equal(a, b) for a, b in zip(out[(kind, True)], out[(kind, False)])), \
            f"{key}={value!r} on a {kind} group changed nothing"


def test_constructor_keywords_are_defaults_not_given():
    """Muon(...) keywords are defaults for the groups where they act: Muon(variant='normuon', ...) over
    muon_param_groups is accepted and leaves the AdamW group without Muon's keys."""
    model = mlp()
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model), variant="normuon", ns_steps=6, momentum=0.9,
                       log_summary=False)
    assert opt.param_groups[0]["variant"] == "normuon" and opt.param_groups[0]["ns_steps"] == 6
    assert not foreign_keys(opt), foreign_keys(opt)
    backward(model)
    opt.step()


def test_the_same_group_dicts_build_a_second_optimizer_as_written():
    """torch fills its defaults into the dicts it is given; ds_muon fills copies, so a resume script or a sweep
    that builds Muon twice from the same dicts is not told that a default the first build filled in
    (normuon_beta2, betas on the Muon group, ...) was a setting given to the second (issue 51)."""
    model = mlp()
    groups = ds_muon.muon_param_groups(model)
    written = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    first = ds_muon.Muon(groups, lr=0.02, log_summary=False)
    assert [{k: v for k, v in g.items() if k != "params"} for g in groups] == written
    second = ds_muon.Muon(groups, lr=0.02, log_summary=False)
    assert [sorted(g) for g in first.param_groups] == [sorted(g) for g in second.param_groups]
    third = ds_muon.Muon(groups, lr=0.02, variant="normuon", log_summary=False)  # a sweep over the variant
    assert third.param_groups[0]["variant"] == "normuon" and "normuon_beta2" in third.param_groups[0]
    with pytest.raises(ValueError, match="normuon_beta2"):  # what the caller writes is still checked
        ds_muon.Muon([dict(groups[0], normuon_beta2=0.9), groups[1]], lr=0.02, log_summary=False)
    for opt in (first, second):
        backward(model)
        opt.step()


def test_older_state_dict_with_every_default_in_every_group_still_loads():
    """An older ds_muon filled every default into every group: those (none of them given) are dropped."""
    model, opt = trained()
    sd = copy.deepcopy(opt.state_dict())
    for k, v in opt.defaults.items():
        if k != "differentiable":
            sd["param_groups"][1].setdefault(k, v)
    model2, opt2 = trained(1)
    opt2.load_state_dict(sd)
    assert not foreign_keys(opt2)
    backward(model2, 3)
    opt2.step()


# values drawn per key (valid ones; the census above uses one fixed value per key)
VALUES = {
    "momentum": st.floats(0.0, 0.99), "nesterov": st.booleans(), "ns_steps": st.integers(1, 8),
    "ns_coefficients": st.sampled_from(["keller", "quintic", "polar_express", (3.0, -3.2, 1.2)]),
    "ns_method": st.sampled_from(["standard", "gram", "auto"]), "ns_dtype": st.sampled_from(["float32", "bfloat16"]),
    "scale_mode": st.sampled_from(["shape_scaling", "spectral", "unit_rms_norm", "none"]),
    "extra_scale_factor": st.floats(0.0, 4.0), "variant": st.sampled_from(["muon", "normuon"]),
    "normuon_beta2": st.floats(0.0, 0.99), "compile": st.booleans(), "adam_lr": st.floats(0.0, 1.0),
    "adam_betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 0.99)), "adam_eps": st.floats(1e-12, 1e-2),
    "adam_weight_decay": st.floats(0.0, 0.5), "head_names": st.sampled_from([("head",), ("lm_head", "out")]),
    "routers": st.sampled_from(["adamw", "muon"]), "betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 0.99)),
    "lr": st.floats(0.0, 0.1), "weight_decay": st.floats(0.0, 0.5), "eps": st.floats(1e-9, 1.0),
    "weight_decay_mode": st.sampled_from(["decoupled", "l2", "independent", "cautious"]),
    "foreach": st.sampled_from([None, True, False]),
}
_DEFAULTS = dict(ds_muon.Muon([nn.Parameter(torch.zeros(2, 2))]).defaults, betas=(0.9, 0.95))


@settings(max_examples=int(os.environ.get("DS_MUON_SCOPE_EXAMPLES", 40)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), key=st.sampled_from(sorted(KEYS)), door=st.sampled_from(GROUP_DOORS))
def test_drawn_values_through_every_group_door(data, key, door):
    """(key, kind, door) drawn with a value drawn for the key (not the default, which changes nothing):
    accepted and kept where the key acts, refused by name elsewhere."""
    kind = data.draw(st.sampled_from(kinds_of(key)), label="kind")
    value = data.draw(VALUES[key], label="value")
    assume(not (key in _DEFAULTS and value == _DEFAULTS[key]))
    verdict = group_door(key, kind, door, value)
    assert verdict in ("ok", "n/a"), verdict
