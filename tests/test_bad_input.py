"""Bad input is refused with a clear error naming what is wrong, before anything changes.

Booleans (every boolean setting, found from the signature and the group defaults), loaded
state that does not fit its parameter, a dtype change under the optimizer, invariant: a step
that raises leaves every parameter and state tensor as it was; ``summary()`` on one rank
before the first step; the planner CLI's arguments; crafted ``Summary`` files.
"""

import copy
import os
import inspect
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import dist_harness
import ds_muon
from ds_muon import cli
from ds_muon.deepspeed import build_optimizer
from ds_muon.engine.report.rows import Summary


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one thread (no oversubscription on a shared machine)."""
    with dist_harness.one_thread():
        yield


def _model(seed=0):
    torch.manual_seed(seed)
    # 0: the input layer and 6: the output layer (AdamW); 2 and 4: hidden matrices (Muon)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 5), nn.LayerNorm(5),
                         nn.Linear(5, 3))


def _train(model, opt, steps=2, dtype=torch.float32):
    x = torch.randn(4, 8, dtype=dtype, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()


def _backward(model, dtype=torch.float32):
    model.zero_grad()
    model(torch.randn(4, 8, dtype=dtype)).square().sum().backward()


# -- booleans ----------------------------------------------------------------------------
BOOL_KEYWORDS = [n for n, p in inspect.signature(ds_muon.Muon.__init__).parameters.items()
                 if isinstance(p.default, bool)]
BOOL_GROUP_KEYS = [k for k, v in ds_muon.Muon([nn.Parameter(torch.zeros(2, 2))]).defaults.items()
                   if isinstance(v, bool)]


def test_every_boolean_setting_is_found():
    """The lists below come from the signature and the defaults: a new boolean is checked too."""
    assert {"nesterov", "overlap", "dispatch_in_backward", "log_summary", "compile"} <= set(BOOL_KEYWORDS)
    assert {"nesterov", "use_muon", "compile"} <= set(BOOL_GROUP_KEYS)


@pytest.mark.parametrize("key", BOOL_KEYWORDS)
@pytest.mark.parametrize("value", ["false", "True", 0, 1, None])
def test_boolean_keyword_must_be_a_bool(key, value):
    with pytest.raises(ValueError, match=f"{key} must be True or False, got {value!r}"):
        ds_muon.Muon(ds_muon.muon_param_groups(_model()), **{key: value})


@pytest.mark.parametrize("key", BOOL_GROUP_KEYS)
def test_boolean_group_setting_must_be_a_bool(key):
    model = _model()
    groups = ds_muon.muon_param_groups(model)
    with pytest.raises(ValueError, match=rf"param_groups\[0\]: {key} must be True or False, got 'false'"):
        ds_muon.Muon([{**groups[0], key: "false"}, groups[1]])
    opt = ds_muon.Muon(groups)  # edited into a group after construction: refused by the step, nothing changed
    _train(model, opt, 1)
    before = copy.deepcopy((list(model.state_dict().values()), opt.state_dict()))
    opt.param_groups[0][key] = "false"
    _backward(model)
    with pytest.raises(ValueError, match=f"{key} must be True or False"):
        opt.step()
    _assert_unchanged(before, model, opt)
    sd = opt.state_dict()  # and a loaded one
    opt.param_groups[0][key] = True
    with pytest.raises(ValueError, match=f"{key} must be True or False"):
        opt.load_state_dict(sd)


def test_adamw_foreach_is_none_or_a_bool():
    groups = ds_muon.muon_param_groups(_model())
    groups[1]["foreach"] = "no"
    with pytest.raises(ValueError, match=r"param_groups\[1\]: foreach must be True or False"):
        ds_muon.Muon(groups)


@pytest.mark.parametrize("key", ["nesterov", "overlap", "log_summary", "compile"])
def test_dsmuon_json_booleans(key):
    """The DsMuon JSON entry's "params" go through the same checks (JSON's "false" is a string)."""
    with pytest.raises(ValueError, match=f"{key} must be True or False, got 'false'"):
        build_optimizer(_model(), json.loads(f'{{"{key}": "false"}}'))
    build_optimizer(_model(), json.loads(f'{{"{key}": false}}'))  # a JSON boolean is fine


# -- loaded state ------------------------------------------------------------------------
def _trained():
    model = _model()
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model), ns_dtype=torch.float32)
    _train(model, opt)
    return model, opt


@pytest.mark.parametrize("key,value,match", [
    ("momentum_buffer", torch.zeros(3, 3), r"'momentum_buffer' has shape \(3, 3\) but the parameter has shape \(6, 8\)"),
    ("momentum_buffer", torch.zeros(6, 8, dtype=torch.int64), "'momentum_buffer' is torch.int64, not a real floating"),
    ("momentum_buffer", torch.zeros(48), r"'momentum_buffer' has shape \(48,\)"),
])
def test_loaded_momentum_that_does_not_fit_is_refused_naming_it(key, value, match):
    model, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0][key] = value  # state 0: the first Muon matrix, 2.weight
    before = copy.deepcopy((list(model.state_dict().values()), opt.state_dict()))
    with pytest.raises(ValueError, match="loaded state of 2.weight: " + match):
        opt.load_state_dict(sd)
    _assert_unchanged(before, model, opt)


def test_loaded_adamw_state_that_does_not_fit_is_refused_naming_it():
    model, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    adamw = opt.param_groups[1]
    index = len(opt.param_groups[0]["params"])  # the first AdamW tensor's state key
    sd["state"][index]["exp_avg"] = torch.zeros(7)
    with pytest.raises(ValueError, match=rf"loaded state of {adamw['param_names'][0]}: 'exp_avg' has shape \(7,\)"):
        opt.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][index]["exp_avg_sq"]
    with pytest.raises(ValueError, match=r"AdamW's state holds \['step', 'exp_avg'\] but lacks \['exp_avg_sq'\]"):
        opt.load_state_dict(sd)


# -- no half-steps: every fault leaves every tensor as it was ------------------------------
def _snapshot(model, opt):
    return copy.deepcopy((list(model.state_dict().values()), opt.state_dict()))


def _assert_unchanged(before, model, opt):
    params, sd = before
    assert all(torch.equal(a, b) for a, b in zip(params, model.state_dict().values()))
    now = opt.state_dict()
    assert now["state"].keys() == sd["state"].keys()
    for k, st_ in sd["state"].items():
        assert now["state"][k].keys() == st_.keys()
        for key, v in st_.items():
            assert torch.equal(torch.as_tensor(now["state"][k][key]), torch.as_tensor(v)), (k, key)


def _fault_momentum_shape(model, opt, monkeypatch):
    opt.state[model[2].weight]["momentum_buffer"] = torch.zeros(3, 3)
    return r"2.weight has shape \(6, 8\) but its optimizer state 'momentum_buffer' has shape \(3, 3\)"


def _fault_momentum_dtype(model, opt, monkeypatch):
    st_ = opt.state[model[4].weight]
    st_["momentum_buffer"] = st_["momentum_buffer"].double()
    return "4.weight is torch.float32 on cpu but its optimizer state 'momentum_buffer' is torch.float64"


def _fault_momentum_device(model, opt, monkeypatch):
    opt.state[model[4].weight]["momentum_buffer"] = torch.zeros(5, 6, device="meta")
    return "4.weight is torch.float32 on cpu but its optimizer state 'momentum_buffer' is torch.float32 on meta"


def _fault_adamw_second_tensor(model, opt, monkeypatch):
    opt.state[model[5].weight]["exp_avg"] = torch.zeros(4)  # AdamW's later tensors: the first would have stepped
    return r"5.weight has shape \(5,\) but its optimizer state 'exp_avg' has shape \(4,\)"


def _fault_planner(model, opt, monkeypatch):
    import ds_muon.engine.runtime as runtime

    def refuse(*a, **k):
        raise RuntimeError("injected: the plan refuses")

    opt.invalidate_layouts()
    monkeypatch.setattr(runtime, "compile_exchanges", refuse)
    return "injected: the plan refuses"


def _fault_setting(model, opt, monkeypatch):
    opt.param_groups[0]["ns_steps"] = 0
    return "ns_steps"


FAULTS = [_fault_momentum_shape, _fault_momentum_dtype, _fault_momentum_device, _fault_adamw_second_tensor,
          _fault_planner, _fault_setting]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__[7:])
def test_a_step_that_raises_changes_nothing(fault, monkeypatch):
    """Invariant: for each injected fault, the step raises and every parameter and every state
    tensor is bitwise what it was (no AdamW half-step before a Muon stage refuses)."""
    model, opt = _trained()
    _backward(model)
    match = fault(model, opt, monkeypatch)
    before = _snapshot(model, opt) if fault is not _fault_momentum_device else None
    with pytest.raises((ValueError, RuntimeError), match=match):
        opt.step()
    if before is not None:
        _assert_unchanged(before, model, opt)
    else:  # a meta tensor has no values to compare: the parameters, and the AdamW state
        assert all(p.grad is not None for p in model.parameters())


def test_dtype_change_fails_naming_the_tensor_then_recast_goes_on():
    """``model.to(torch.bfloat16)`` after steps: refused naming the tensor (torch.optim's AdamW and
    Muon fail too, unnamed); the remedy in the message, torch's load cast, then steps exactly as an
    optimizer built at bf16 from the same state."""
    model, opt = _trained()
    ref_model = copy.deepcopy(model).to(torch.bfloat16)
    saved = copy.deepcopy(opt.state_dict())
    model.to(torch.bfloat16)
    _backward(model, torch.bfloat16)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=r"2.weight is torch.bfloat16 on cpu but its optimizer state "
                                         r"'momentum_buffer' is torch.float32.*opt.load_state_dict\(opt.state_dict\(\)\)"):
        opt.step()
    _assert_unchanged(before, model, opt)
    opt.load_state_dict(opt.state_dict())
    ref = ds_muon.Muon(ds_muon.muon_param_groups(ref_model), ns_dtype=torch.float32)
    ref.load_state_dict(saved)
    for m, o in ((model, opt), (ref_model, ref)):
        _train(m, o, 2, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


# -- summary() on one rank before the first step -----------------------------------------------
# (multi-rank: tests/test_summary.py's FSDP2 worker calls it on rank 0 alone first; no spawn of its own here)
def test_summary_in_one_process_needs_no_keyword():
    assert "ds_muon.Muon summary" in str(ds_muon.Muon(ds_muon.muon_param_groups(_model())).summary())


# -- ds-muon plan: argument bounds --------------------------------------------------------------
NUMERIC_FLAGS = {"--ns-steps": "int", "--tflops": "float", "--link-gbps": "float", "--pcie-gbps": "float",
                 "--intra-gbps": "float", "--ranks-per-node": "int", "--world-sizes": "int"}


@pytest.fixture(scope="module")
def shapes_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("shapes") / "shapes.json"
    path.write_text(json.dumps({"matrices": [{"name": "a", "shape": [16, 8]}, {"name": "b", "shape": [8, 32]}]}))
    return str(path)


@pytest.mark.parametrize("flag,value", [("--ns-steps", "-1"), ("--ns-steps", "0"), ("--tflops", "-400"),
                                        ("--tflops", "0"), ("--link-gbps", "0"), ("--world-sizes", "0"),
                                        ("--world-sizes", str(10**12)), ("--intra-gbps", "nan"),
                                        ("--mesh", "dp=100000,tp=100000")])
def test_plan_refuses_bad_numbers_with_a_clear_message(flag, value, shapes_file, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--shapes", shapes_file, flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and "Traceback" not in err


@settings(max_examples=int(os.environ.get("DS_MUON_BAD_INPUT_EXAMPLES", 40)), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(sorted(NUMERIC_FLAGS)),
       value=st.one_of(st.integers(-10**15, 10**15).map(str), st.floats(allow_nan=True).map(repr),
                       st.sampled_from(["", "x", "1e400", "-inf", "0x10", " 3", "1_000"])))
def test_plan_argument_vectors_never_crash(flag, value, shapes_file, capsys):
    """Generated argument vectors: a table (exit 0) or argparse's exit 2 with the flag named, never
    a traceback, a ZeroDivisionError or a MemoryError."""
    argv = ["plan", "--shapes", shapes_file, "--strategies", "locality", "--json", flag, value]
    if flag != "--world-sizes":
        argv += ["--world-sizes", "2"]
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
        assert code == 2 and f"argument {flag}:" in capsys.readouterr().err
        return
    assert code == 0 and json.loads(capsys.readouterr().out)


# -- Summary.load on crafted files --------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_summary(tmp_path_factory):
    path = tmp_path_factory.mktemp("summary") / "run.json"
    ds_muon.Muon(ds_muon.muon_param_groups(_model())).summary().save(str(path))
    return json.loads(path.read_text())


def _paths(d, prefix=()):
    """Every (path, value) inside a JSON value."""
    yield prefix, d
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(d, list):
        for k, v in enumerate(d):
            yield from _paths(v, prefix + (k,))


def _set(d, path, value):
    for k in path[:-1]:
        d = d[k]
    if value is _DELETE:
        del d[path[-1]]
    else:
        d[path[-1]] = value


_DELETE = object()
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                 st.text(max_size=5), st.lists(st.integers(-3, 3), max_size=3), st.just({}), st.just(_DELETE))


@settings(max_examples=int(os.environ.get("DS_MUON_BAD_INPUT_EXAMPLES", 60)), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_crafted_summary_files_load_or_raise_value_error(data, saved_summary, tmp_path):
    """One to three fields of a real saved summary replaced by junk (or deleted): ``Summary.load``
    returns a summary whose planner table runs, or raises ValueError naming the field."""
    d = copy.deepcopy(saved_summary)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p, _ in _paths(d) if p]
        if not paths:
            break
        _set(d, data.draw(st.sampled_from(paths)), data.draw(JUNK))
    path = tmp_path / "crafted.json"
    path.write_text(json.dumps(d))
    try:
        s = Summary.load(str(path))
    except ValueError as e:
        assert "crafted.json" in str(e)
        return
    str(s)
    if len({m.domain for m in s.matrices}) <= 1:  # (several domains: plan_rows says it compares one at a time)
        s.plan_rows()


@pytest.mark.parametrize("text,match", [("{", "not JSON"), ("[]", "must be an object"),
                                        ('{"tensors": []}', "missing field"),
                                        ('{"world_size": 1, "rank": 0, "mode": "sharded", "planner": "auto", '
                                         '"waves": 1, "tensors": [], "ranks": [{"rank": 0}]}',
                                         r"ranks\[0\]: missing field")])
def test_broken_summary_files_name_what_is_wrong(text, match, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        Summary.load(str(path))


def test_summary_round_trip(tmp_path):
    s = ds_muon.Muon(ds_muon.muon_param_groups(_model())).summary()
    s.save(str(tmp_path / "s.json"))
    assert Summary.load(str(tmp_path / "s.json")) == s
