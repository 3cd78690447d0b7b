"""After ``step()`` returns, every read of a parameter sees the update: one invariant, every read path, every stack.

Each (stack, read path) pair is one case: a model trained with ``overlap=True`` is read
right after ``step()`` along that path and compared (``torch.equal``) with the same read
of an ``overlap=False`` run.  The paths are the ways users read weights: ``parameters()``
(EMA/SWA, weight norms, clipping by weight norm, ``torch.save``), gathered full
tensors, the state_dict of the wrapper, of the wrapped model and of any submodule, the
next forward (a parent reading a child's weight, a tied weight whose second owner runs
first) and its backward, and an in-process rollback (``model.load_state_dict`` then
``opt.load_state_dict``).

``apply_in_forward=True`` (the opt-in deferral) is walked too, along its documented
contract: the forward through the owning modules, the state_dict of any module, the
rollback, and every direct read after ``opt.flush()``; and it must really defer.

Stacks: one process, DDP, FSDP1 (``use_orig_params=True``) and FSDP2 at W=2.  DeepSpeed
applies in ``step()`` (its adapter's ``applies_in_step``; tests/test_adapters.py).
"""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_muon

import dist_harness

STACKS = ["single", "ddp", "fsdp1", "fsdp2"]
DIRECT = ["parameters", "gathered", "ema", "weight_norms", "total_norm", "torch_save"]
CONTRACT = ["submodule_state_dict", "inner_state_dict", "state_dict", "forward", "backward", "rollback"]
PATHS = DIRECT + CONTRACT
MODES = {"overlap": dict(overlap=True, waves=3), "apply_in_forward": dict(overlap=True, waves=3, apply_in_forward=True)}


class Net(nn.Module):
    """``dec``'s weight is read by the parent (``read_child``); ``tie`` shares ``mid``'s weight and
    runs before it (``mid`` comes first in module order)."""

    def __init__(self, read_child: bool):
        super().__init__()
        self.read_child = read_child
        self.enc = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 32, bias=False)
        self.dec = nn.Linear(32, 32, bias=False)
        self.out = nn.Linear(32, 8)
        self.tie = nn.Linear(32, 32, bias=False)
        self.tie.weight = self.mid.weight

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        h = torch.tanh(F.linear(h, self.dec.weight) if self.read_child else self.dec(h))
        h = torch.tanh(self.tie(h))
        h = torch.tanh(self.mid(h))
        return self.out(h)


def _batch(t):
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(6, 16, generator=g), torch.randn(6, 8, generator=g)


def _local(t):
    t = t.detach()
    return (t.to_local() if hasattr(t, "to_local") else t).clone()


def _wrap(stack, read_child, world):
    """(what training calls, the wrapped nn.Module, param groups)."""
    torch.manual_seed(0)
    net = Net(read_child)
    if stack == "single":
        return net, net, ds_muon.muon_param_groups(net, adam_lr=1e-2)
    if stack == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(net), net, ds_muon.muon_param_groups(net, adam_lr=1e-2)
    if stack == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        groups = ds_muon.muon_param_groups(net, adam_lr=1e-2)
        kw = dict(device_id=torch.device("cpu"), use_orig_params=True)
        net.enc, net.out = FSDP(net.enc, **kw), FSDP(net.out, **kw)
        return FSDP(net, **kw), net, groups
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    fully_shard(net.enc, mesh=mesh)
    fully_shard(net.out, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, net, ds_muon.muon_param_groups(net, adam_lr=1e-2)


def _gathered(stack, wrapper, net):
    if stack == "fsdp2":
        return [p.full_tensor().detach().clone() for p in net.parameters()]
    if stack == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(wrapper):
            return [p.detach().clone() for p in net.parameters()]
    return [p.detach().clone() for p in net.parameters()]


def _states(sd):
    return [_local(v) for v in sd.values()]


def _train_step(wrapper, opt, t):
    x, y = _batch(t)
    opt.zero_grad()
    F.mse_loss(wrapper(x), y).backward()
    opt.step()


class Run:
    """A model trained two steps (a checkpoint taken after the first); read right after the second."""

    def __init__(self, stack, mode, overlap_kw, world):
        self.stack = stack
        self.wrapper, self.net, groups = _wrap(stack, mode == "overlap", world)
        self.opt = ds_muon.Muon(groups, ns_dtype=torch.float32, model=self.wrapper, log_summary=False, **overlap_kw)
        self.params = list(self.net.parameters())
        self.ema = [_local(p) for p in self.params]
        _train_step(self.wrapper, self.opt, 0)
        self.ck = copy.deepcopy(self.wrapper.state_dict()), copy.deepcopy(self.opt.state_dict())
        _train_step(self.wrapper, self.opt, 1)
        deferred = self.opt.runtime.deferred
        self.pending = deferred.pending if deferred is not None else 0


def _read_parameters(r):
    return {"parameters": [_local(p) for p in r.params]}


def _read_gathered(r):
    return {"gathered": _gathered(r.stack, r.wrapper, r.net)}


def _read_ema(r):  # EMA / SWA over parameters()
    torch._foreach_lerp_(r.ema, [_local(p) for p in r.params], 0.1)
    return {"ema": r.ema}


def _read_weight_norms(r):  # logging weight norms
    return {"weight_norms": [torch.linalg.vector_norm(_local(p)) for p in r.params]}


def _read_total_norm(r):  # clipping by weight norm
    return {"total_norm": [torch.nn.utils.get_total_norm([_local(p) for p in r.params])]}


def _read_torch_save(r):
    buf = io.BytesIO()
    torch.save([p.detach() for p in r.params], buf)
    buf.seek(0)
    return {"torch_save": [_local(p) for p in torch.load(buf, weights_only=False)]}


def _read_submodule_state_dict(r):
    return {"submodule_state_dict": _states(r.net.dec.state_dict()) + _states(r.net.mid.state_dict())}


def _read_inner_state_dict(r):  # ddp.module / fsdp.module
    return {"inner_state_dict": _states(r.net.state_dict())}


def _read_state_dict(r):
    return {"state_dict": _states(r.wrapper.state_dict())}


def _read_forward(r):
    """The next forward, and its backward (a tied weight updated in place between them raises)."""
    x, y = _batch(2)
    r.opt.zero_grad()
    try:
        y_hat = r.wrapper(x)
        out = {"forward": [y_hat.detach().clone()]}
        F.mse_loss(y_hat, y).backward()
        out["backward"] = [_local(p.grad) for p in r.params if p.grad is not None]
    except RuntimeError as e:
        out = {"forward": [], "backward": f"raised: {str(e)[:200]}"}
    r.opt.zero_grad()
    return out


def _read_rollback(r):
    """Right after a step, back to the checkpoint taken after the first (model, then optimizer),
    and one more step."""
    _train_step(r.wrapper, r.opt, 2)
    r.wrapper.load_state_dict(r.ck[0])
    r.opt.load_state_dict(r.ck[1])
    _train_step(r.wrapper, r.opt, 3)
    r.opt.flush()
    return {"rollback": [_local(p) for p in r.params]}


READERS = [_read_parameters, _read_gathered, _read_ema, _read_weight_norms, _read_total_norm, _read_torch_save,
           _read_submodule_state_dict, _read_inner_state_dict, _read_state_dict, _read_forward, _read_rollback]


def walk(stack, mode, world=1):
    """(the overlap=False reads, the reads with ``MODES[mode]``, updates pending after step()).

    The reference reads every path in one run (nothing is deferred there); with overlap each
    path is read in a run of its own, right after step(), so no read can land an update for
    another.  Under ``apply_in_forward`` the direct reads come after ``opt.flush()`` (its contract)."""
    ref, ovl, pending = {}, {}, []
    r = Run(stack, mode, {}, world)
    for read in READERS:
        ref.update(read(r))
    kw = MODES[mode]
    for read in READERS:
        r = Run(stack, mode, kw, world)
        pending.append(r.pending)
        if kw.get("apply_in_forward") and read.__name__[len("_read_"):] in DIRECT:
            r.opt.flush()
        ovl.update(read(r))
    return ref, ovl, min(pending)


def _all_modes(stack, world=1):
    return {mode: walk(stack, mode, world) for mode in MODES}


def _dist_worker(rank, world):
    return {stack: _all_modes(stack, world) for stack in STACKS[1:]}


@pytest.fixture(scope="module")
def walks():
    with dist_harness.one_thread():
        out = {"single": _all_modes("single")}
    per_rank = dist_harness.run(_dist_worker, 2, timeout=240)
    for stack in STACKS[1:]:
        out[stack] = [r[stack] for r in per_rank]
    out["single"] = [out["single"]]
    return out


def _same(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("stack", STACKS)
def test_every_read_sees_the_update(walks, stack, mode, path):
    for rank, per_mode in enumerate(walks[stack]):
        ref, ovl, _ = per_mode[mode]
        assert not isinstance(ref[path], str), ref[path]
        assert _same(ref[path], ovl[path]), (
            f"{stack} rank {rank}, {mode}: reading {path} right after step() differs from overlap=False"
            + (f" ({ovl[path]})" if isinstance(ovl[path], str) else ""))


@pytest.mark.parametrize("stack", STACKS)
def test_overlap_defers_nothing_and_the_opt_in_does(walks, stack):
    for per_mode in walks[stack]:
        assert per_mode["overlap"][2] == 0
        assert per_mode["apply_in_forward"][2] > 0  # else the opt-in's walk proves nothing


def test_apply_in_forward_needs_overlap_and_a_model():
    p = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="overlap=True"):
        ds_muon.Muon([p], apply_in_forward=True, model=nn.Linear(4, 4))
    with pytest.raises(ValueError, match="model="):
        ds_muon.Muon([p], overlap=True, apply_in_forward=True)
    with pytest.raises(ValueError, match="apply_in_forward"):
        ds_muon.Muon([p], overlap=True, apply_in_forward="false", model=nn.Linear(4, 4))
