"""PyTorch's generic optimizer tests (test/test_optim.py, ``TestOptimRenewed``), ported to ds_muon.

Each test below is one of torch's generic tests that applies to a Muon on the CPU, with its
parametrizations, run over torch's own inputs for its Muon (``optim_inputs_func_muon`` and
``get_error_inputs_for_all_optims`` of ``torch.testing._internal.common_optimizers``).  Where
ds_muon differs from torch.optim.Muon by design the port says so (docs/ADVANCED.md,
"torch.optim conventions", lists them):

* tensors that are not matrices (biases, norms) go to a ``use_muon=False`` group (AdamW):
  torch's Muon refuses them; the port builds such groups (:func:`muon`) where torch's test
  passes a bias;
* Muon takes tensors of 3 or more dimensions (``[d0, prod(rest)]``) and refuses complex
  ones at construction; it has ``scale_mode`` where torch has ``adjust_lr_fn``;
* not ported: foreach/fused/differentiable variants (torch's Muon has none), sparse and
  complex tests, and the CUDA-only ones (multi-GPU, CUDA state dicts, peak memory).

Comparisons are bitwise (``torch.equal``) where torch's use its default tolerances: the two
optimizers run the same operations.
"""

import functools
import math
import tempfile
from copy import deepcopy

import pytest
import torch
from torch.nn import Parameter
from torch.optim import SGD
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import dist_harness
import ds_muon
from ds_muon.engine.agreement.settings import acts_on

@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one thread (no oversubscription on a shared machine)."""
    with dist_harness.one_thread():
        yield


SCHEDULERS = [lambda opt: StepLR(opt, gamma=0.9, step_size=10), lambda opt: ReduceLROnPlateau(opt)]  # torch's defaults


class Input:
    """One of torch's ``OptimizerInput``s: keyword arguments and what they test."""

    def __init__(self, kwargs, desc):
        self.kwargs, self.desc = kwargs, desc


def inputs():
    """torch 2.13's inputs for its Muon (``optim_inputs_func_muon``; fresh each call: a tensor lr is
    mutated by schedulers).  Written out here because ``torch.testing._internal`` needs the
    ``expecttest`` package; :func:`test_inputs_are_torchs` compares them where it is installed."""
    return [Input({}, "default"), Input({"lr": 0.01}, "non-default lr"),
            Input({"lr": torch.tensor(0.001)}, "Tensor lr"), Input({"weight_decay": 0.2}, "non-default weight_decay"),
            Input({"momentum": 0.8}, "non-default momentum"), Input({"ns_steps": 6}, "passing alternative ns_steps"),
            Input({"ns_coefficients": (3.4, -4.7, 2.0)}, "passing alternative ns_coefficients")]


def _torch_common_optimizers():
    try:
        from torch.testing._internal import common_optimizers
    except ImportError as e:  # expecttest (a torch test dependency) missing
        pytest.skip(f"torch.testing._internal.common_optimizers is not importable here: {e}")
    return common_optimizers


def test_inputs_are_torchs():
    """The inputs and error inputs written out here are torch's own (where torch's test machinery imports)."""
    co = _torch_common_optimizers()
    theirs = co.optim_inputs_func_muon("cpu")
    assert [i.desc for i in theirs] == [i.desc for i in inputs()]
    for a, b in zip(theirs, inputs()):
        assert a.kwargs.keys() == b.kwargs.keys() and all(
            torch.equal(a.kwargs[k], b.kwargs[k]) if torch.is_tensor(a.kwargs[k]) else a.kwargs[k] == b.kwargs[k]
            for k in a.kwargs)
    errors = co.get_error_inputs_for_all_optims("cpu", torch.float32)
    assert [(e.error_type, e.error_regex) for e in errors] == [(t, r) for _, _, t, r in _ALL_OPTIMS_ERRORS()]


def _is_matrix(p) -> bool:
    return (p[1] if isinstance(p, tuple) else p).dim() >= 2


def muon(params, **kwargs):
    """``ds_muon.Muon`` with torch's ``params`` argument, non-matrices in a ``use_muon=False`` group
    (ds_muon's convention; torch's Muon refuses them)."""
    params = list(params)
    if params and isinstance(params[0], dict):
        groups = [dict(g, use_muon=all(_is_matrix(p) for p in g["params"])) for g in params]
        # torch's group kwargs are its Muon's: a group turned AdamW keeps those that act there (one that
        # does nothing on an AdamW group is refused: ds_muon.engine.agreement.settings.SCOPE)
        groups = [g if g["use_muon"] else {k: v for k, v in g.items() if acts_on(k, False)} for g in groups]
    else:
        groups = [{"params": [p for p in params if _is_matrix(p)]},
                  {"params": [p for p in params if not _is_matrix(p)], "use_muon": False}]
        groups = [g for g in groups if g["params"]]
    return ds_muon.Muon(groups, **kwargs)


def _equal(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(list(a)) == len(list(b))


def test_optim_infos_do_not_specify_global_cliquey_kwargs():
    for i in inputs():
        assert not {"foreach", "fused", "differentiable"} & set(i.kwargs)


def _ALL_OPTIMS_ERRORS():
    """torch 2.13's ``get_error_inputs_for_all_optims`` on the CPU: (params, kwargs, error, regex)."""
    a, b = Parameter(torch.randn(1, 1)), Parameter(torch.randn(1, 1))
    return [
        (a, {}, TypeError, "params argument given to the optimizer should be an iterable of Tensors or dicts"),
        ([a, a], {}, UserWarning, ".*a parameter group with duplicate parameters.*"),
        ([{"params": a}, {"params": a}], {}, ValueError, "some parameters appear in more than one parameter group"),
        (None, {"lr": torch.tensor([0.001, 0.001])}, ValueError, "Tensor lr must be 1-element"),
        ([("weight", a), b], {}, ValueError,
         "all optimizer params should be with/without names. Some param names are missing"),
        ([{"params": [a], "lr": 1e-2}, {"params": [("weight", b)]}], {}, ValueError,
         "all optimizer param groups should be with/without names. cannot add param group with names to the optimizer"),
    ]


def _ds_muon_error_inputs():
    """torch's errors for every optimizer, then its Muon's, as ds_muon words them (see the module)."""
    out = _ALL_OPTIMS_ERRORS()
    param = Parameter(torch.rand(2, 3))
    out += [([Parameter(torch.rand(3))], {}, ValueError, "Muon needs matrices"),  # torch: a 3-D tensor
            ([param], {"scale_mode": "arbitrary"}, ValueError, "scale_mode"),  # torch: adjust_lr_fn
            ([Parameter(torch.rand(2, 3, dtype=torch.complex64))], {}, ValueError, "real tensors only")]
    return out


@pytest.mark.parametrize("k", range(len(_ds_muon_error_inputs())))
def test_errors(k):
    params, kwargs, error, regex = _ds_muon_error_inputs()[k]
    if params is None:
        params = [Parameter(torch.randn(1, 1))]
    if issubclass(error, Warning):
        with pytest.warns(error, match=regex):
            ds_muon.Muon(params, **kwargs)
    else:
        with pytest.raises(error, match=regex):
            ds_muon.Muon(params, **kwargs)


def _weight_closure(opt, weight, inp):
    def closure():
        opt.zero_grad()
        loss = weight.mv(inp).pow(2).sum()
        loss.backward()
        return loss
    return closure


def _run_schedulers(schedulers, loss):
    for s in schedulers:
        s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()


@pytest.mark.parametrize("with_lrsched", [True, False])
@pytest.mark.parametrize("contiguous", [True, False])
def test_forloop_goes_right_direction(contiguous, with_lrsched):
    """Non-contiguous: strides (10, 2), stepped through a copy (ParamBinding.copied)."""
    for i in inputs():
        weight = Parameter(torch.randn(10, 5) if contiguous else torch.randn(10, 5, 2)[..., 0])
        inp = torch.randn(5)
        opt = ds_muon.Muon([weight], **i.kwargs)
        schedulers = [s(opt) for s in SCHEDULERS] if with_lrsched else []
        closure = _weight_closure(opt, weight, inp)
        initial = closure().item()
        for _ in range(20):
            loss = closure()
            opt.step()
            _run_schedulers(schedulers, loss)
        assert closure().item() < initial, i.desc
        assert weight.is_contiguous() == contiguous


def test_param_group_with_lrscheduler_goes_right_direction():
    weight, weight2, inp = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10, 5)), torch.randn(5)
    opt = ds_muon.Muon([{"params": [weight]}, {"params": [weight2], "lr": 0.01}])
    schedulers = [s(opt) for s in SCHEDULERS]

    def closure():
        opt.zero_grad()
        loss = (weight.mv(inp) + weight2.mv(inp)).pow(2).sum()
        loss.backward()
        return loss

    initial = closure().item()
    for _ in range(20):
        _run_schedulers(schedulers, opt.step(closure))
    assert closure().item() < initial


@pytest.mark.parametrize("num_dim", [0, 1, 2])
def test_tensor_lr(num_dim):
    for i in inputs():
        weight = Parameter(torch.randn(10, 5))
        weight_c = weight.detach().clone().requires_grad_(True)
        inp = torch.randn(5)
        kwargs = dict(i.kwargs)
        kwargs["lr"] = 1e-3
        opt_r = ds_muon.Muon([weight], **kwargs)
        kwargs["lr"] = torch.tensor(1e-3).reshape([1] * num_dim)
        opt = ds_muon.Muon([weight_c], **kwargs)
        for _ in range(5):
            _weight_closure(opt_r, weight, inp)()
            opt_r.step()
            _weight_closure(opt, weight_c, inp)()
            opt.step()
            # as torch's test: close, not equal (a float32 tensor lr is not the float 1e-3)
            torch.testing.assert_close(weight, weight_c, msg=i.desc)


def _weight_bias_loss(weight, bias, inp):
    return (weight.mv(inp) + bias).pow(2).sum()


def test_param_groups_weight_decay():
    for i in inputs():
        weight, bias, inp = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10)), torch.randn(5)
        opt = muon([dict(params=[weight], **i.kwargs), dict(params=[bias], **dict(i.kwargs, weight_decay=0.0))])
        initial = _weight_bias_loss(weight, bias, inp).item()
        for _ in range(20):
            opt.zero_grad()
            loss = _weight_bias_loss(weight, bias, inp)
            loss.backward()
            opt.step()
        assert loss.item() < initial, i.desc


def test_param_groups_lr():
    for i in inputs():
        kwargs = dict(i.kwargs)
        if "lr" not in kwargs or kwargs["lr"] == 0:
            kwargs["lr"] = 1e-3
        weight, bias, inp = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10)), torch.randn(5)
        irrelevant = Parameter(torch.randn(2, 2))
        irrelevant_clone = irrelevant.detach().clone()
        # torch's test puts weight and bias in one group: here they are a Muon and an AdamW group of its kwargs
        opt = muon([dict(params=[weight], **kwargs), dict(params=[bias], **kwargs), dict(params=[irrelevant])],
                   lr=1e-28)
        initial = _weight_bias_loss(weight, bias, inp).item()
        for _ in range(20):
            opt.zero_grad()
            loss = _weight_bias_loss(weight, bias, inp)
            loss.backward()
            irrelevant.grad = torch.rand_like(irrelevant)
            opt.step()
        assert loss.item() < initial, i.desc
        torch.testing.assert_close(irrelevant, irrelevant_clone)  # lr 1e-28: an update far below float32's ulp


def test_step_is_noop_when_params_have_no_grad():
    params = [torch.randn(2, 3, requires_grad=False) for _ in range(2)]
    old = [p.clone() for p in params]
    for i in inputs():
        ds_muon.Muon(params, **i.kwargs).step(lambda: torch.tensor([1.0]))
    _equal(params, old)


def test_step_is_noop_for_zero_grads():
    param = torch.randn((5, 1), requires_grad=True)
    old = param.detach().clone()
    for i in inputs():
        if i.kwargs.get("weight_decay", 0) != 0:
            continue
        opt = ds_muon.Muon([param], **i.kwargs)
        param.grad = torch.zeros_like(param)
        opt.step(lambda: torch.tensor([1.0]))
        assert torch.equal(param, old), i.desc


def test_optimizer_can_be_printed():
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for i in inputs():
        assert "Muon" in repr(ds_muon.Muon(params, **i.kwargs))


def _named(params, named):
    return [(f"name{k}", p) for k, p in enumerate(params)] if named else params


def _without_names(sd):
    sd = deepcopy(sd)
    for g in sd["param_groups"]:
        g.pop("param_names", None)
    return sd


def _assert_same_state_dict(a, b):
    """Equal state dicts: groups by value (a tensor lr by value too), state tensors bitwise."""
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        assert all(torch.equal(torch.as_tensor(a["state"][k][n]), torch.as_tensor(b["state"][k][n]))
                   for n in a["state"][k])
    assert len(a["param_groups"]) == len(b["param_groups"])
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        assert ga.keys() == gb.keys(), set(ga) ^ set(gb)
        for key in ga:
            same = torch.equal(ga[key], gb[key]) if torch.is_tensor(ga[key]) else ga[key] == gb[key]
            assert same, key


@pytest.mark.parametrize("named1", [True, False])
@pytest.mark.parametrize("named0", [True, False])
def test_state_dict_deterministic(named0, named1):
    """A loaded optimizer steps bitwise like the one it was saved from, and its state dict (param
    groups included: no key such as torch's ``differentiable`` added by the load) is the same."""
    weight, bias, inp = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2)), torch.randn(3)

    def fwd_bwd(opt, w, b):
        opt.zero_grad()
        loss = _weight_bias_loss(w, b, inp)
        loss.backward()
        return loss

    for i in inputs():
        opt = muon(_named([weight, bias], named0), **i.kwargs)
        for _ in range(10):
            fwd_bwd(opt, weight, bias)
            opt.step()
        with torch.no_grad():
            weight_c, bias_c = Parameter(weight.clone()), Parameter(bias.clone())
        opt_c = muon(_named([weight_c, bias_c], named1), **i.kwargs)
        opt_c.load_state_dict(deepcopy(opt.state_dict()))
        for _ in range(10):
            fwd_bwd(opt, weight, bias)
            fwd_bwd(opt_c, weight_c, bias_c)
            opt.step()
            opt_c.step()
            assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c), i.desc
        _assert_same_state_dict(_without_names(opt.state_dict()), _without_names(opt_c.state_dict()))
        opt_c.param_groups.extend(opt_c.param_groups)  # repeated groups: the same representation
        _assert_same_state_dict(
            {"state": {}, "param_groups": _without_names(opt.state_dict())["param_groups"][-1:]},
            {"state": {}, "param_groups": _without_names(opt_c.state_dict())["param_groups"][-1:]})


def test_loaded_param_groups_are_the_saved_ones():
    """heavyball's save/restore check: a restored optimizer's param_groups equal the saved ones."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 3),
                                torch.nn.Linear(3, 2))  # 0: input layer, 3: output layer
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    saved = deepcopy(opt.state_dict())
    restored = ds_muon.Muon(ds_muon.muon_param_groups(model))
    restored.load_state_dict(deepcopy(saved))
    _assert_same_state_dict(restored.state_dict(), saved)
    assert "differentiable" not in restored.param_groups[0]
    restored.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, 2))], "param_names": ["extra"]})
    assert "differentiable" not in restored.param_groups[-1]


def _conv_bn():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2), torch.nn.BatchNorm2d(2, eps=1e-05, momentum=0.1))


def _conv_fwd_bwd(opt, model, inp):
    opt.zero_grad()
    model(inp).sum().backward()


def test_can_load_older_state_dict():
    """Muon's OptimizerInfo lists no flags added after its release: the state dict loads as saved."""
    for i in inputs():
        model, inp = _conv_bn(), torch.rand(1, 4, 16, 16)
        opt = muon(model.parameters(), **i.kwargs)
        for _ in range(3):
            _conv_fwd_bwd(opt, model, inp)
            opt.step()
        opt.load_state_dict(deepcopy(opt.state_dict()))
        _conv_fwd_bwd(opt, model, inp)
        opt.step()


@pytest.mark.parametrize("named1", [True, False])
@pytest.mark.parametrize("named0", [True, False])
def test_can_load_from_to_named_state_dict(named0, named1):
    for i in inputs():
        model, inp = _conv_bn(), torch.rand(1, 4, 16, 16)
        opt = muon(model.named_parameters() if named0 else model.parameters(), **i.kwargs)
        for _ in range(3):
            _conv_fwd_bwd(opt, model, inp)
            opt.step()
        opt2 = muon(model.named_parameters() if named1 else model.parameters(), **i.kwargs)
        opt2.load_state_dict(deepcopy(opt.state_dict()))
        _conv_fwd_bwd(opt2, model, inp)
        opt2.step()
        if named0 or named1:  # names kept; here over the Muon group, then the AdamW group
            names = [n for g in opt2.state_dict()["param_groups"] for n in g["param_names"]]
            assert names == ["0.weight", "0.bias", "1.weight", "1.bias"]


@pytest.mark.parametrize("named", [True, False])
def test_save_load_equality_with_weights_only(named):
    weight, bias, inp = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2)), torch.randn(3)
    for i in inputs():
        opt = muon(_named([weight, bias], named), **i.kwargs)

        def closure():
            opt.zero_grad()
            loss = _weight_bias_loss(weight, bias, inp)
            loss.backward()
            return loss

        for _ in range(3):
            opt.step(closure)
        sd = opt.state_dict()
        with tempfile.TemporaryFile() as f:
            torch.save(sd, f)
            for weights_only in (False, True):
                f.seek(0)
                _assert_same_state_dict(torch.load(f, weights_only=weights_only), sd)


def test_load_nontensor_step():
    params = [Parameter(torch.randn(2, 3)), Parameter(torch.randn(3))]
    for p in params:
        p.grad = torch.rand_like(p)
    for i in inputs():
        opt = muon(params, **i.kwargs)
        for _ in range(3):
            opt.step()
        sd = deepcopy(opt.state_dict())
        for st in sd["state"].values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].item()
        opt.load_state_dict(sd)
        opt.step()
        assert all(torch.is_tensor(opt.state[p]["step"]) for p in params[1:])


def _state_dict_pre_hook(opt):
    opt.state["test"] = 1


def _state_dict_post_hook(opt, sd):
    if "test" in sd["state"]:
        sd["state"].pop("test")
        sd["ran_state_dict_pre_hook"] = True
    else:
        sd["ran_state_dict_pre_hook"] = False
    return sd


def _one_matrix(i):
    return ds_muon.Muon([torch.rand(2, 3, requires_grad=True)], **i.kwargs)


def test_state_dict_pre_hook():
    for i in inputs():
        opt = _one_matrix(i)
        opt.register_state_dict_pre_hook(_state_dict_pre_hook)
        assert opt.state_dict()["state"]["test"] == 1


def test_state_dict_post_hook():
    for i in inputs():
        opt = _one_matrix(i)
        opt.register_state_dict_post_hook(_state_dict_post_hook)
        assert opt.state_dict()["ran_state_dict_pre_hook"] is False


def test_state_dict_pre_post_hook():
    for i in inputs():
        opt = _one_matrix(i)
        opt.register_state_dict_pre_hook(_state_dict_pre_hook)
        opt.register_state_dict_post_hook(_state_dict_post_hook)
        sd = opt.state_dict()
        assert "test" not in sd["state"] and sd["ran_state_dict_pre_hook"]


def _load_pre_hook1(opt, sd):
    sd["param_groups"][0]["lr"] = 0.002


def _load_pre_hook2(opt, sd):
    mine = deepcopy(sd)
    mine["param_groups"][0]["lr"] = 0.003
    return mine


def _load_post_hook(opt):
    opt.state["ran_load_state_dict_pre_hook2"] = opt.param_groups[0]["lr"] == 0.003
    opt.state["ran_load_state_dict_post_hook"] = True


def test_load_state_dict_pre_hook_and_prepend():
    for i in inputs():
        opt = _one_matrix(i)
        sd = opt.state_dict()
        opt.register_load_state_dict_pre_hook(_load_pre_hook1)
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["lr"] == 0.002
        opt.register_load_state_dict_pre_hook(_load_pre_hook2, prepend=True)
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["lr"] == 0.002  # prepended: hook 1 runs last


def test_load_state_dict_post_hook():
    for i in inputs():
        opt = _one_matrix(i)
        opt.register_load_state_dict_post_hook(_load_post_hook)
        opt.load_state_dict(opt.state_dict())
        assert not opt.state["ran_load_state_dict_pre_hook2"] and opt.state["ran_load_state_dict_post_hook"]


def test_load_state_dict_pre_post_hook():
    for i in inputs():
        opt = _one_matrix(i)
        opt.register_load_state_dict_pre_hook(_load_pre_hook2)
        opt.register_load_state_dict_post_hook(_load_post_hook)
        opt.load_state_dict(opt.state_dict())
        assert opt.state["ran_load_state_dict_pre_hook2"] and opt.state["ran_load_state_dict_post_hook"]


def _hook_params():
    return [torch.tensor([[1.0, 1.0]])]  # torch's [1, 1], as a matrix: no gradient, the step is a no-op


@pytest.mark.parametrize("kind", ["post", "pre"])
def test_step_hook(kind):
    """torch's test_step_post_hook and test_step_pre_hook."""
    for i in inputs():
        opt = ds_muon.Muon(_hook_params(), **i.kwargs)
        data = [2 if kind == "post" else 5]

        def hook(o, args, kwargs):
            data[0] += 2

        handle = getattr(opt, f"register_step_{kind}_hook")(hook)
        opt.step()
        opt.step()
        assert data[0] == (6 if kind == "post" else 9)
        handle.remove()
        opt.step()
        assert data[0] == (6 if kind == "post" else 9)


def test_step_all_hooks():
    for i in inputs():
        params = _hook_params()
        opt, opt2, data = ds_muon.Muon(params, **i.kwargs), SGD(params), []
        handles = [register_optimizer_step_pre_hook(lambda o, a, k: data.append(0)),
                   register_optimizer_step_post_hook(lambda o, a, k: data.append(5))]
        for o in (opt, opt2):
            handles += [o.register_step_pre_hook(lambda o, a, k: data.append(1)),
                        o.register_step_post_hook(lambda o, a, k: data.append(2))]
        try:
            opt.step()
            opt2.step()
            opt.step()
            assert data == [0, 1, 2, 5] * 3
        finally:
            for h in handles:
                h.remove()
        opt.step()
        opt2.step()
        assert data == [0, 1, 2, 5] * 3


def test_deepcopy_copies_all_public_attrs():
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)
    for i in inputs():
        opt = ds_muon.Muon(params, **i.kwargs)
        for _ in range(3):
            opt.step()
        public = lambda o: {k for k in o.__dict__ if not k.startswith("_")}  # noqa: E731
        assert public(opt) == public(deepcopy(opt))


def test_non_empty_state():
    model, inp = torch.nn.Linear(5, 5), torch.rand(2, 5)
    for i in inputs():
        opt = muon(model.parameters(), **i.kwargs)
        opt.zero_grad()
        model(inp).sum().backward()
        opt.step()
        assert all(len(st) > 0 for st in opt.state.values())


# -- beyond torch's suite: the state before the first step (issue 51) ------------------------------------
def _lm():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 10))


_TOKENS = torch.randint(0, 10, (2, 3), generator=torch.Generator().manual_seed(0))


def _ds(model):
    return ds_muon.Muon(ds_muon.muon_param_groups(model, example_inputs=(_TOKENS,)), log_summary=False)


def _train(model, opt, steps=3):
    for _ in range(steps):
        model(_TOKENS).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_state_is_made_at_the_first_step_as_torchs():
    """As torch.optim.Muon and AdamW (and Keller's MuonWithAuxAdam): no state before the first step, so a
    step-0 ``state_dict()`` holds the groups only and loads into a fresh optimizer, which then trains exactly
    as the one that saved it."""
    model = _lm()
    ours, theirs = _ds(model), torch.optim.Muon([model[1].weight])
    assert len(ours.state) == len(theirs.state) == 0
    saved = deepcopy(ours.state_dict())
    assert saved["state"] == {}
    reference = _train(model, ours)
    again = _lm()
    opt = _ds(again)
    opt.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(_train(again, opt), reference))


def test_a_step_0_dcp_checkpoint_changes_no_parameter_and_resumes_exactly():
    """``get_optimizer_state_dict`` at step 0 fills the state with one step of zero gradients at lr 0 (torch's
    ``_init_optim_state``): no parameter moves, every parameter gets its state, and the checkpoint loaded into
    a fresh optimizer trains as the optimizer that saved it.  (That zero step counts as AdamW's first, as it
    does for torch.optim.AdamW: the run differs from one never checkpointed at step 0, for both.)"""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = _lm()
    opt = _ds(model)
    before = [p.detach().clone() for p in model.parameters()]
    saved = deepcopy(get_optimizer_state_dict(model, opt))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert set(saved["state"]) == {n for n, _ in model.named_parameters()}
    reference = _train(model, opt)
    again = _lm()
    fresh = _ds(again)
    set_optimizer_state_dict(again, fresh, saved)
    assert all(torch.equal(a, b) for a, b in zip(_train(again, fresh), reference))


def test_add_param_group_before_the_first_step_trains_as_one_construction():
    """The group added before any step (a script that adds the head later) steps as if it had been given at
    construction: same settings filled in, same updates."""
    whole, split = _lm(), _lm()
    groups = ds_muon.muon_param_groups(whole, example_inputs=(_TOKENS,))
    reference = _train(whole, ds_muon.Muon(groups, log_summary=False))
    groups = ds_muon.muon_param_groups(split, example_inputs=(_TOKENS,))
    opt = ds_muon.Muon(groups[:1], log_summary=False)
    for g in groups[1:]:
        opt.add_param_group(g)
    assert all(torch.equal(a, b) for a, b in zip(_train(split, opt), reference))


# -- beyond torch's suite: non-contiguous parameters are bitwise the contiguous ones' -----------------
@pytest.mark.parametrize("overlap", [False, True])
def test_non_contiguous_parameter_steps_bitwise_like_contiguous(overlap):
    """A weight with strides (10, 2) (no flat view) in a model, decoupled and L2 decay, with and
    without overlap (``apply_in_forward``: the deferred update lands through the same copy):
    bitwise the contiguous model's, and the parameter keeps its strides."""
    def build(contiguous):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Tanh(), torch.nn.Linear(5, 10), torch.nn.Tanh(),
                                    torch.nn.Linear(10, 3))  # 2: the hidden matrix
        if not contiguous:
            strided = torch.empty(10, 5, 2)[..., 0]
            strided.copy_(model[2].weight.detach())
            model[2].weight = Parameter(strided)
        groups = ds_muon.muon_param_groups(model, weight_decay=0.1)
        groups[0]["weight_decay_mode"] = "l2" if overlap else "decoupled"
        return model, ds_muon.Muon(groups, ns_dtype=torch.float32, overlap=overlap, model=model,
                                   apply_in_forward=overlap, dispatch_in_backward=False)

    (a, oa), (b, ob) = build(True), build(False)
    assert b[2].weight.stride() == (10, 2)
    x = torch.randn(4, 5)
    for _ in range(3):  # the same gradients for both (a matmul with a strided weight rounds differently)
        oa.zero_grad()
        a(x).square().sum().backward()
        with torch.no_grad():
            b(x)  # overlap: the previous step's deferred updates land in the forward
        for p, q in zip(a.parameters(), b.parameters()):
            q.grad = p.grad.clone()
        oa.step()
        ob.step()
    with torch.no_grad():
        for m in (a, b):
            m(x)
    _equal(list(a.parameters()), list(b.parameters()))
    assert b[2].weight.stride() == (10, 2)
    assert torch.equal(oa.state[a[2].weight]["momentum_buffer"], ob.state[b[2].weight]["momentum_buffer"])
