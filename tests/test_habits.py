"""A training script's habits on every stack, against the same script in one process.

One spawn at W=2 runs the same short script on DDP, FSDP2, FSDP1 (``use_orig_params=True``),
DeepSpeed ZeRO-2 and ZeRO-3 (through ``ds_muon.deepspeed.initialize``), one stack after another;
this process runs each stack's script alone as the reference.  The habits:

* ``if rank == 0: print(opt.summary())`` before the first step and after it (rank 0 alone: no
  collective joined, nothing raised, the other rank goes on);
* ``torch.save(opt.state_dict(), ...)`` on rank 0 only (``state_dict()`` is no collective);
* an LR scheduler on the Muon (``LambdaLR``; ``CosineAnnealingLR`` on FSDP2 and ZeRO-3);
* ``param_groups[i]["lr"]`` edited by hand between steps;
* ``zero_grad(set_to_none=False)`` (not under DeepSpeed, which owns the gradients);
* ``add_param_group`` after construction: a Muon tensor held back and added after the first step
  (under DeepSpeed, before ``initialize``, the last moment a group can join);
* gradient clipping before the last step (``clip_grad_norm_``; FSDP1's own; DeepSpeed's
  ``gradient_clipping``).

Every step but the clipped one is ``torch.equal`` to the reference; after clipping, whose norm is a
sum over shards in another order, within 1e-6 (bitwise on DDP, where every rank holds the whole
gradient).  The same spawn checks that a state dict whose NorMuon ``v`` has the wrong length is
refused by ``load_state_dict`` on every rank with the same message, before anything changes.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ds_muon
import dist_harness

STACKS = ("ddp", "fsdp2", "fsdp1", "zero2", "zero3")
STEPS = 4  # the last one clipped
MAX_NORM = 0.05  # below the gradients' norm: clipping scales them
HELD = "4.weight"  # the Muon tensor added with add_param_group


def model_for(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh(),
                         nn.Linear(4, 4))  # 6: the output layer (AdamW); 4.weight a hidden matrix


def batch(t):
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(3, 6, generator=g)  # the same on every rank: averaged gradients are exact


def _bare(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("module.", "", 1) if name.startswith(
        ("module.", "_fsdp")) else name.replace("_fsdp_wrapped_module.", "")


def split_held(groups):
    """(groups without the held-back tensor, the group that adds it later)."""
    muon = groups[0]
    n = len(muon["params"])
    k = next(i for i, name in enumerate(muon["param_names"]) if _bare(name) == HELD)
    keep = {key: (v[:k] + v[k + 1:] if isinstance(v, list) and len(v) == n else v) for key, v in muon.items()}
    held = {key: ([v[k]] if isinstance(v, list) and len(v) == n else v) for key, v in muon.items()}
    return [keep] + groups[1:], held


def scheduler_for(stack, opt):
    if stack in ("fsdp2", "zero3"):
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def muon(groups, model=None):
    # the standard iteration: the clipped step's bound (a norm summed over shards rounds 1 ulp apart) is the
    # standard NS's; fp32 Gram (what auto takes on the wide 4x8 matrix) carries that ulp further (2e-6)
    return ds_muon.Muon(groups, ns_dtype=torch.float32, ns_method="standard", team_ns=False, log_summary=False,
                        model=model)


class Script:
    """One stack's model, optimizer and steps; ``stack="single:<stack>"`` is that stack's script in one process."""

    def __init__(self, stack):
        self.single = stack.startswith("single:")
        self.stack = stack.split(":")[-1]
        self.zero = self.stack.startswith("zero")
        model = model_for()
        self.plain = model
        if self.single:
            wrapped = model
        elif self.stack == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            wrapped = DDP(model)
        elif self.stack == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            wrapped = fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        elif self.stack == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
            wrapped = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                           use_orig_params=True)
        else:
            wrapped = model
        self.model = wrapped
        groups, self.held = split_held(ds_muon.muon_param_groups(wrapped))
        self.opt = muon(groups, wrapped if self.stack == "fsdp1" and not self.single else None)
        if self.zero:
            self.opt.add_param_group(self.held)  # before initialize: DeepSpeed flattens the groups there
            self.held = None
        self.sched = scheduler_for(self.stack, self.opt)
        self.engine = None
        if self.zero and not self.single:
            from ds_muon import deepspeed as ds_muon_deepspeed
            config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                      "gradient_clipping": 0.0, "steps_per_print": 10**9, "wall_clock_breakdown": False,
                      "zero_optimization": {"stage": int(self.stack[-1])}}
            self.engine, _, _, _ = ds_muon_deepspeed.initialize(model=model, optimizer=self.opt, config=config,
                                                               lr_scheduler=self.sched)

    def groups(self):
        """The param groups a script edits: DeepSpeed's optimizer's (the Muon's own) under ZeRO."""
        return self.engine.optimizer.param_groups if self.engine is not None else self.opt.param_groups

    def step(self, t):
        clip = t == STEPS - 1
        if self.engine is not None:
            if clip:
                self.engine.optimizer.clip_grad = MAX_NORM  # what "gradient_clipping" sets, for this step only
            loss = self.engine(batch(t)).square().mean()
            self.engine.backward(loss)
            self.engine.step()
            return
        self.model(batch(t)).square().mean().backward()
        if clip:
            if self.stack == "fsdp1" and not self.single:
                self.model.clip_grad_norm_(MAX_NORM)
            else:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=False)

    def full(self):
        if self.engine is not None:
            from deepspeed.utils import safe_get_full_fp32_param
            return {_bare(n): safe_get_full_fp32_param(p).detach().clone().float()
                    for n, p in self.engine.module.named_parameters()}
        if self.stack == "fsdp1" and not self.single:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            with FSDP.summon_full_params(self.model):
                return {_bare(n): p.detach().clone() for n, p in self.model.named_parameters()}
        return {_bare(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in self.model.named_parameters()}


def _attempt(fn):
    """What rank 0's habit gave, or the error it raised (so one broken habit does not hide the others)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported by the test of that habit
        return f"raised {type(e).__name__}: {e}"


def _save(s):
    buf = io.BytesIO()
    torch.save((s.engine.optimizer if s.engine is not None else s.opt).state_dict(), buf)
    return len(buf.getvalue())


def habits(stack, rank=0):
    """The script; returns the parameters after each step and what rank 0's habits gave."""
    s = Script(stack)
    out = {"params": [], "summaries": [], "saved": None, "muon_state_dict": None}
    for t in range(STEPS):
        if t == 0 and rank == 0:
            out["summaries"].append(_attempt(lambda: str(s.opt.summary())))  # before the first step, rank 0 alone
        if t == 1:
            if rank == 0:
                out["summaries"].append(_attempt(lambda: str(s.opt.summary())))  # after it, rank 0 alone
                out["saved"] = _attempt(lambda: _save(s))  # torch.save(optimizer.state_dict()) on rank 0 only
                if s.engine is not None and s.stack == "zero3":  # the Muon itself holds no groups outside step()
                    out["muon_state_dict"] = _attempt(lambda: s.opt.state_dict() and "returned")
            for g in s.groups():
                g["lr"] = g["lr"] * 0.5  # by hand, on top of the scheduler
            if s.held is not None:
                s.opt.add_param_group(s.held)  # a tensor joins after the first step ...
                s.sched = scheduler_for(s.stack, s.opt)  # ... and the schedule restarts (torch's zips the groups)
        s.step(t)
        out["params"].append(s.full())
    return out


def refused_moment(rank, world):
    """A DDP NorMuon run's state dict with a ``v`` one entry short: refused at load, state unchanged."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(model_for(1))
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model), variant="normuon", ns_dtype=torch.float32, log_summary=False)
    model(batch(0)).square().mean().backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    i = next(i for i, st in sd["state"].items() if "normuon_v" in st)
    sd["state"][i]["normuon_v"] = sd["state"][i]["normuon_v"][:-1]
    before = copy.deepcopy(opt.state_dict())
    try:
        opt.load_state_dict(sd)
        message = None
    except ValueError as e:
        message = str(e)
    after = opt.state_dict()
    unchanged = all(torch.equal(before["state"][k][n], after["state"][k][n]) for k in before["state"]
                    for n in before["state"][k]) and before["param_groups"] == after["param_groups"]
    return {"message": message, "unchanged": unchanged}


def worker(rank, world):
    out = {}
    for stack in STACKS:
        out[stack] = _attempt(lambda: habits(stack, rank))
        dist.barrier()
    out["refused"] = refused_moment(rank, world)
    return out


def _compare(got, want, exact):
    bad = []
    for name in want:
        a, b = got[name], want[name]
        if not (torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-6, atol=1e-7)):
            bad.append(f"{name}: {(a - b).abs().max().item():.3g}")
    return bad


@pytest.fixture(scope="module")
def spawned():
    """The one W=2 spawn (every stack's script), and the one-process references."""
    from fuzz_stacks import ZERO_ENV

    out = dist_harness.run(worker, 2, timeout=400, env=ZERO_ENV)
    with dist_harness.one_thread():
        refs = {stack: habits("single:" + stack) for stack in STACKS}
    return out, refs


def _run(spawned, stack, rank):
    got = spawned[0][rank][stack]
    assert isinstance(got, dict), f"{stack} rank {rank}: {got}"
    return got


@pytest.mark.parametrize("stack", STACKS)
def test_rank0_alone_prints_summary_before_the_first_step(spawned, stack):
    before = _run(spawned, stack, 0)["summaries"][0]
    assert "ds_muon.Muon summary" in before and "planned at the first step" in before, before


@pytest.mark.parametrize("stack", STACKS)
def test_rank0_alone_prints_summary_after_the_first_step(spawned, stack):
    after = _run(spawned, stack, 0)["summaries"][1]
    assert "ds_muon.Muon summary" in after and "planned at the first step" not in after, after


@pytest.mark.parametrize("stack", STACKS)
def test_rank0_alone_saves_the_optimizer_state_dict(spawned, stack):
    got = _run(spawned, stack, 0)
    assert isinstance(got["saved"], int) and got["saved"] > 0, got["saved"]
    if stack == "zero3":  # the Muon itself, outside step(): a clear refusal naming what to call
        assert "engine.optimizer.state_dict()" in got["muon_state_dict"], got["muon_state_dict"]


@pytest.mark.parametrize("stack", STACKS)
def test_lr_edits_scheduler_zero_grad_and_add_param_group_match_one_process(spawned, stack):
    """Steps 1-3 (summary and save on rank 0 alone, lr edits, the scheduler, zero_grad(set_to_none=False),
    add_param_group after the first step): every rank torch.equal to the one-process script."""
    ref = spawned[1][stack]
    for rank in range(2):
        got = _run(spawned, stack, rank)
        for t in range(STEPS - 1):
            bad = _compare(got["params"][t], ref["params"][t], exact=True)
            assert not bad, f"{stack} rank {rank} step {t + 1}: {bad}"


@pytest.mark.parametrize("stack", STACKS)
def test_clipped_step_matches_one_process(spawned, stack):
    """Clipping before the last step: bitwise on DDP (whole gradients), else within 1e-6 (a norm summed
    over shards; DeepSpeed's own formula)."""
    ref = spawned[1][stack]
    for rank in range(2):
        bad = _compare(_run(spawned, stack, rank)["params"][-1], ref["params"][-1], exact=stack == "ddp")
        assert not bad, f"{stack} rank {rank} clipped step: {bad}"


def test_wrong_length_moment_refused_at_load_on_every_rank(spawned):
    refused = [spawned[0][r]["refused"] for r in range(2)]
    assert refused[0]["message"] and "normuon_v" in refused[0]["message"], refused
    assert refused[0]["message"] == refused[1]["message"], refused
    assert all(r["unchanged"] for r in refused), refused
