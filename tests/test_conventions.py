"""torch.optim conventions: loading, copying, pickling, tensor lr, validation, DCP, torch.compile,
empty matrices and channels_last weights."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from torch import nn

import ds_muon

import dist_harness


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def grads(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=g)
    model(x).square().mean().backward()


def train(model, opt, steps=2, seed=1):
    for s in range(steps):
        opt.zero_grad()
        grads(model, seed + s)
        opt.step()


def snapshot(model, opt):
    sd = opt.state_dict()
    return ([p.detach().clone() for p in model.parameters()],
            {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in st.items()} for k, st in sd["state"].items()})


def same(a, b):
    (pa, sa), (pb, sb) = a, b
    return (all(torch.equal(x, y) for x, y in zip(pa, pb)) and sa.keys() == sb.keys()
            and all(sa[k].keys() == sb[k].keys() and all(torch.equal(torch.as_tensor(sa[k][n]), torch.as_tensor(sb[k][n]))
                                                         for n in sa[k]) for k in sa))


def build(model, **kw):
    return ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=1e-2), ns_dtype=torch.float32, **kw)


# -- 1. load_state_dict checks that groups match ------------------------------------------------

def test_load_refuses_swapped_groups_and_other_tensor_names():
    a = mlp()
    opt = build(a)
    train(a, opt)
    sd = opt.state_dict()
    assert [len(g["params"]) for g in sd["param_groups"]] == [1, 5]  # 0.weight, 4.weight: input and output layers, AdamW
    b = mlp(1)
    fresh = build(b)
    train(b, fresh, steps=1)
    before = snapshot(b, fresh)
    swapped = dict(sd, param_groups=sd["param_groups"][::-1])
    with pytest.raises(ValueError, match=r"param_groups\[0\] has use_muon=False.*first tensor 2.weight.*use_muon=True"):
        fresh.load_state_dict(swapped)
    renamed = copy.deepcopy(sd)
    renamed["param_groups"][0]["param_names"][0] = "blocks.9.weight"
    with pytest.raises(ValueError, match=r"param_groups\[0\] names tensor 0 'blocks.9.weight'.*'2.weight'"):
        fresh.load_state_dict(renamed)
    assert same(before, snapshot(b, fresh))
    fresh.load_state_dict(sd)  # the matching one still loads


# -- 2. older state dicts -----------------------------------------------------------------------

def test_older_state_dict_gets_defaults_and_tensor_steps():
    a = mlp()
    opt = build(a)
    train(a, opt, steps=1)
    sd = copy.deepcopy(opt.state_dict())
    b = mlp(1)
    with torch.no_grad():
        for pb, pa in zip(b.parameters(), a.parameters()):
            pb.copy_(pa)
    del sd["param_groups"][0]["ns_method"]  # a key added since
    del sd["param_groups"][1]["betas"], sd["param_groups"][1]["eps"]
    for st in sd["state"].values():
        if "step" in st:
            st["step"] = float(st["step"])  # older torch / hand-made state dicts
    old = build(b)
    old.load_state_dict(sd)
    assert old.param_groups[0]["ns_method"] == old.defaults["ns_method"] == "auto"  # the default fills it
    assert old.param_groups[1]["betas"] == opt.adam_betas and old.param_groups[1]["eps"] == opt.adam_eps
    steps = [st["step"] for st in old.state.values() if "step" in st]
    assert steps and all(torch.is_tensor(s) and s.dtype == torch.float32 for s in steps)
    for model, o in ((a, opt), (b, old)):
        o.zero_grad()
        grads(model, 5)
        o.step()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


# -- 3. deepcopy and pickle ---------------------------------------------------------------------

SETTINGS = dict(mode="duplicated", planner="lpt", overlap=True, waves=2, comm_dtype=torch.float32,
                nonfinite="skip", adam_betas=(0.8, 0.9), adam_eps=1e-6)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_keeps_settings_and_steps_bitwise_like_original(how):
    model = mlp()
    opt = build(model, **SETTINGS)
    train(model, opt)
    dup = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    for k in ("mode", "planner", "overlap", "waves", "comm_dtype", "nonfinite", "adam_betas", "adam_eps"):
        assert getattr(dup, k) == getattr(opt, k), k
    grads(model, 9)
    ours = [p for g in opt.param_groups for p in g["params"]]
    theirs = [p for g in dup.param_groups for p in g["params"]]
    assert all(a is not b and torch.equal(a, b) for a, b in zip(ours, theirs))
    for a, b in zip(ours, theirs):
        b.grad = a.grad.clone()
    opt.step()
    dup.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert all(torch.equal(opt.state[a]["momentum_buffer"], dup.state[b]["momentum_buffer"])
               for a, b in zip(opt.param_groups[0]["params"], dup.param_groups[0]["params"]))


def test_copy_of_bound_optimizer_must_be_bound_again():
    from ds_muon.integrations.default import default_adapter

    model = mlp()
    opt = build(model)
    opt.attach(default_adapter())  # stands for a DeepSpeed binding: not carried by a copy
    train(model, opt, steps=1)
    dup = copy.deepcopy(opt)
    grads(model, 3)
    for a, b in zip(opt.param_groups[0]["params"] + opt.param_groups[1]["params"],
                    dup.param_groups[0]["params"] + dup.param_groups[1]["params"]):
        b.grad = a.grad.clone()
    with pytest.raises(RuntimeError, match="copy.*bound to a DeepSpeed engine.*deepspeed.bind"):
        dup.step()
    dup.attach(default_adapter())
    dup.step()


# -- 4. tensor lr ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(), (1,)], ids=["0-dim", "1-elem"])
def test_tensor_lr_like_torch(shape):
    lr, adam_lr = torch.full(shape, 0.02), torch.full(shape, 1e-2)
    a, b = mlp(), mlp()
    groups = ds_muon.muon_param_groups(a, lr=lr, adam_lr=adam_lr, weight_decay=0.1, adam_weight_decay=0.01)
    ours = ds_muon.Muon(groups, ns_dtype=torch.float32)
    # reference: Muon with lr read as a number, torch's own AdamW with the same tensor lr
    muon = {n for g in groups if g["use_muon"] for n in g["param_names"]}  # 4.weight: the output layer, AdamW
    ref_muon = ds_muon.Muon([p for n, p in b.named_parameters() if n in muon], lr=float(lr), weight_decay=0.1,
                            ns_dtype=torch.float32)
    ref_adam = torch.optim.AdamW([p for n, p in b.named_parameters() if n not in muon], lr=adam_lr, betas=ours.adam_betas,
                                 eps=ours.adam_eps, weight_decay=0.01)
    for s in range(3):
        for m, opts in ((a, [ours]), (b, [ref_muon, ref_adam])):
            for o in opts:
                o.zero_grad()
            grads(m, s)
            for o in opts:
                o.step()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_tensor_lr_of_several_elements_refused_before_anything_changes():
    model = mlp()
    with pytest.raises(ValueError, match=r"param_groups\[0\]: Tensor lr must be 1-element"):
        ds_muon.Muon([nn.Parameter(torch.zeros(2, 2))], lr=torch.ones(2))
    opt = build(model)
    train(model, opt, steps=1)
    opt.param_groups[1]["lr"] = torch.tensor([1e-3, 1e-3])
    grads(model, 4)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"param_groups\[1\]: Tensor lr must be 1-element"):
        opt.step()
    assert same(before, snapshot(model, opt))


# -- 5. validation -----------------------------------------------------------------------------

NAN = float("nan")
BAD = [(0, "weight_decay", NAN), (0, "eps", NAN), (0, "extra_scale_factor", NAN), (0, "momentum", NAN),
       (0, "lr", NAN), (0, "ns_steps", 0), (0, "ns_dtype", torch.int32), (0, "extra_scale_factor", math.inf),
       (1, "weight_decay", NAN), (1, "eps", NAN), (1, "lr", NAN), (1, "betas", (NAN, 0.9))]


@pytest.mark.parametrize("gi,key,value", BAD, ids=[f"{'muon' if g == 0 else 'adamw'}-{k}-{v}" for g, k, v in BAD])
def test_bad_setting_refused_at_construction_and_when_edited(gi, key, value):
    model = mlp()
    groups = ds_muon.muon_param_groups(model, adam_lr=1e-2)
    groups[gi][key] = value
    with pytest.raises(ValueError, match=rf"param_groups\[{gi}\].*{key}"):
        ds_muon.Muon(groups, ns_dtype=torch.float32)
    opt = build(model)
    train(model, opt, steps=1)
    opt.param_groups[gi][key] = value
    grads(model, 4)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=rf"param_groups\[{gi}\].*{key}"):
        opt.step()
    assert same(before, snapshot(model, opt)), "an invalid setting changed parameters or state before it was refused"


@pytest.mark.parametrize("key", ["comm_dtype", "ns_dtype"])
def test_integer_dtypes_refused(key):
    with pytest.raises(ValueError, match=f"{key}=torch.int32 is not a floating-point"):
        ds_muon.Muon([nn.Parameter(torch.zeros(4, 4))], **{key: torch.int32})


def test_step_settings_check_is_cheap():
    """The per-step settings check reads a group's settings only: no torch call, and the same few Python
    calls per group whatever the group holds (counted, not timed: a timed test fails on a loaded machine)."""
    import sys

    from torch.overrides import TorchFunctionMode

    from ds_muon.engine.agreement.settings import check_settings as _check_settings

    class TorchCalls(TorchFunctionMode):
        seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    def cost(model):
        opt, calls = build(model), [0]

        def count(frame, event, arg):
            calls[0] += event in ("call", "c_call")
        with TorchCalls() as mode:
            sys.setprofile(count)
            try:
                for gi, g in enumerate(opt.param_groups):
                    _check_settings(g, gi)
            finally:
                sys.setprofile(None)
        return calls[0], mode.seen

    small, wide = cost(mlp()), cost(nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)]))
    assert small[1] == [] and wide[1] == [], (small[1], wide[1])
    assert small[0] == wide[0] < 100, (small[0], wide[0])  # 2 groups either way, 3 matrices against 12


# -- 7. torch.compile --------------------------------------------------------------------------

def test_compiled_train_step_matches_eager():
    """A compiled step that calls opt.step(): the optimizer runs eagerly (a graph break).
    backend='aot_eager' traces forward and backward like inductor but computes them with
    eager kernels, so the parameters can be compared bitwise."""
    with dist_harness.one_thread():
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        out = []
        for compiled in (False, True):
            torch._dynamo.reset()
            model = mlp()
            opt = build(model)

            def train_step(x):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()

            f = torch.compile(train_step, backend="aot_eager") if compiled else train_step
            for x in xs:
                f(x)
            out.append([p.detach().clone() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*out))
        assert not torch.equal(out[1][0], mlp()[0].weight)  # the Muon weights did move


# -- 8. empty matrices --------------------------------------------------------------------------

class WithEmpty(nn.Module):
    """An MLP with (optionally) a layer of 0 outputs and one of 0 inputs hanging off it."""

    def __init__(self, empty: bool, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.to_none = nn.Linear(16, 0, bias=False) if empty else None
        self.from_none = nn.Linear(0, 4, bias=False) if empty else None
        self.out = nn.Linear(4, 4)  # the output layer (AdamW) in both: b is a hidden matrix either way

    def forward(self, x):
        h = torch.tanh(self.a(x))
        y = self.b(h)
        if self.to_none is not None:
            y = y + self.to_none(h).sum(-1, keepdim=True) + self.from_none(h[:, :0])
        return self.out(torch.tanh(y))


def empty_run(empty: bool, steps=3):
    model = WithEmpty(empty)
    groups = ds_muon.muon_param_groups(model, adam_lr=1e-2, example_inputs=torch.zeros(4, 8))  # h[:, :0] wants 2-D
    opt = ds_muon.Muon(groups, ns_dtype=torch.float32)
    train(model, opt, steps)
    return model, opt


def test_empty_matrices_step_as_no_ops():
    ref, _ = empty_run(False)
    model, opt = empty_run(True)
    for n, p in ref.named_parameters():
        assert torch.equal(p, model.get_parameter(n)), n
    for p in (model.to_none.weight, model.from_none.weight):
        assert opt.state[p]["momentum_buffer"].shape == p.shape


# -- 9. channels_last ----------------------------------------------------------------------------

class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3)
        self.c2 = nn.Conv2d(8, 6, 3, bias=False)
        self.head = nn.Linear(6 * 4 * 4, 5)

    def forward(self, x):
        return self.head(self.c2(nn.functional.gelu(self.c1(x))).flatten(1))


def convnet(seed=0, channels_last=False):
    torch.manual_seed(seed)
    m = ConvNet()
    return m.to(memory_format=torch.channels_last) if channels_last else m


def conv_batches(n=3):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2, 3, 8, 8, generator=g) for _ in range(n)]


def conv_train(model, opt, data, grad_layout=None):
    for x in data:
        opt.zero_grad()
        model(x).square().mean().backward()
        if grad_layout is not None:
            for p in model.parameters():
                p.grad = p.grad.contiguous(memory_format=grad_layout)
        opt.step()


def conv_opt(model):
    return ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=1e-2, weight_decay=0.1), ns_dtype=torch.float32)


def test_channels_last_matches_contiguous_up_to_rounding_and_writes_in_place():
    data = conv_batches()
    ref = convnet()
    conv_train(ref, conv_opt(ref), data)
    model = convnet(channels_last=True)
    w = model.c1.weight
    assert not w.is_contiguous() and w.is_contiguous(memory_format=torch.channels_last)
    ptrs = [p.data_ptr() for p in model.parameters()]
    opt = conv_opt(model)
    conv_train(model, opt, data)
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # updates written into the parameters
    assert w.is_contiguous(memory_format=torch.channels_last)
    buf = opt.state[w]["momentum_buffer"]
    assert buf.is_contiguous(memory_format=torch.channels_last) and buf.abs().sum() > 0
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-6, msg=n)
    # contiguous gradients (a flat read copies) give the same bits
    other = convnet(channels_last=True)
    conv_train(other, conv_opt(other), data, grad_layout=torch.contiguous_format)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_channels_last_loads_contiguous_state():
    data = conv_batches(4)
    ref = convnet()
    ref_opt = conv_opt(ref)
    conv_train(ref, ref_opt, data[:2])
    sd = copy.deepcopy(ref_opt.state_dict())
    model = convnet(channels_last=True)
    with torch.no_grad():
        for a, b in zip(model.parameters(), ref.parameters()):
            a.copy_(b)
    opt = conv_opt(model)
    opt.load_state_dict(sd)  # momentum buffers saved contiguous
    conv_train(model, opt, data[2:])
    conv_train(ref, ref_opt, data[2:])
    buf = opt.state[model.c1.weight]["momentum_buffer"]
    assert buf.is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-6)


def test_dense_permutations_generalise_and_others_step_through_copies():
    from ds_muon.integrations.local import bind_replicated

    p = nn.Parameter(torch.randn(4, 5, 3).permute(0, 2, 1))  # shape [4, 3, 5], stored [4, 5, 3]
    b = bind_replicated(p, "w")
    assert b.matrices[0].shape == (4, 5, 3) and b.matrices[0].matrix_shape == (4, 15)
    assert b.flat(p).data_ptr() == p.data_ptr() and b.flat(p)._base is not None
    opt = ds_muon.Muon([p], ns_dtype=torch.float32)
    ref = nn.Parameter(p.detach().contiguous())
    ref_opt = ds_muon.Muon([ref], ns_dtype=torch.float32)
    g = torch.randn(4, 3, 5)
    p.grad, ref.grad = g.clone(), g.clone()
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(p, ref, rtol=0, atol=2e-6)
    # dim 0 not outermost (a transpose) or no dense layout at all (a strided slice): no flat view, so
    # the step reads a copy and writes the result back: bitwise the contiguous tensor's (issue 25)
    for t in (nn.Parameter(torch.randn(6, 4).t()), nn.Parameter(torch.randn(4, 8)[:, ::2])):
        assert bind_replicated(t, "w").copied
        ref = nn.Parameter(t.detach().contiguous())
        opt, ref_opt = ds_muon.Muon([t], ns_dtype=torch.float32), ds_muon.Muon([ref], ns_dtype=torch.float32)
        t.grad = torch.randn(t.shape)
        ref.grad = t.grad.clone()
        opt.step()
        ref_opt.step()
        assert torch.equal(t, ref) and not t.is_contiguous()


# -- spawned runs (W=2): replicated/DDP and FSDP2 ------------------------------------------------

def _replicated_worker(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    model = convnet(channels_last=True)
    ddp = DDP(model)
    opt = conv_opt(model)
    conv_train(ddp, opt, conv_batches())
    out["channels_last"] = [p.detach().clone() for p in model.parameters()]
    model, _ = empty_run(True)
    out["empty"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    # a copy of an optimizer built with a process_group must be given one again (on every rank alike)
    model = mlp()
    group = torch.distributed.new_group([0, 1])
    opt = build(model, process_group=group)
    train(model, opt, steps=1)
    dup = copy.deepcopy(opt)
    for b in (p for g in dup.param_groups for p in g["params"]):
        b.grad = torch.ones_like(b)
    try:
        dup.step()
        out["copy_without_group"] = "stepped"
    except RuntimeError as e:
        out["copy_without_group"] = str(e)
    dup.process_group = group
    dup.step()
    return out


def test_replicated_w2_channels_last_and_empty_equal_single_process():
    with dist_harness.one_thread():
        ref = convnet(channels_last=True)
        conv_train(ref, conv_opt(ref), conv_batches())
        empty_ref, _ = empty_run(True)
    for res in dist_harness.run(_replicated_worker, 2):
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), res["channels_last"]))
        for n, p in empty_ref.named_parameters():
            assert torch.equal(p, res["empty"][n]), n
        assert "process groups are not copied" in res["copy_without_group"]


def _fsdp2_worker(rank, world):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from models import batches, lm_loss, make_gpt

    mesh = init_device_mesh("cpu", (world,))
    data = batches(4, batch=2, seq=8, vocab=64, seed=1)

    def build_gpt():
        model = make_gpt(seed=0, gate=True)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=1e-2), ns_dtype=torch.float32)

    def run(model, opt, batch):
        lm_loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def local(model):
        return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}

    out = {}
    model, opt = build_gpt()
    for idx in data[:2]:
        run(model, opt, idx)
    saved_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    options = {"full": StateDictOptions(full_state_dict=True),
               "full_cpu_offload": StateDictOptions(full_state_dict=True, cpu_offload=True),
               "sharded": StateDictOptions()}
    saved = {k: copy.deepcopy(get_optimizer_state_dict(model, opt, options=o)) for k, o in options.items()}
    for idx in data[2:]:
        run(model, opt, idx)
    straight = local(model)
    out["resumed"] = {}
    for k, sd in saved.items():
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved_params[n])
        fresh = ds_muon.Muon(ds_muon.muon_param_groups(model, adam_lr=1e-2), ns_dtype=torch.float32)
        load_opts = (StateDictOptions(full_state_dict=True, broadcast_from_rank0=True) if k == "full_cpu_offload"
                     else options[k])
        set_optimizer_state_dict(model, fresh, sd, options=load_opts)
        for idx in data[2:]:
            run(model, fresh, idx)
        now = local(model)
        out["resumed"][k] = sorted(n for n in straight if not torch.equal(straight[n], now[n]))
    return out


def test_fsdp2_dcp_state_dicts_resume_bitwise():
    """Full (accelerate's FULL_STATE_DICT), cpu-offloaded full and sharded DCP optimizer state
    dicts: taken after 2 steps, loaded into a fresh optimizer, 2 more steps equal training on.
    (An empty matrix under FSDP2 is not tested: FSDP2 itself cannot reduce-scatter its grad.)"""
    for res in dist_harness.run(_fsdp2_worker, 2):
        assert res["resumed"] == {"full": [], "full_cpu_offload": [], "sharded": []}
