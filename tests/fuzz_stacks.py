"""Run one fuzz case (``tests/fuzz_models.py``) under a stack, and the references it is held to.

``run_case(case)`` builds the case's model, wraps it in ``case.stack`` (one process, DDP, FSDP2,
FSDP1 or DeepSpeed ZeRO; the process group must exist for all but ``single``), trains it for
``case.steps`` steps on the drawn gradients with a ``state_dict`` round trip after
``case.roundtrip_after`` of them, and returns what every rank must agree on: each parameter
whole (by the unwrapped model's names), the optimizer's state keys and the round trip's
verdict.  ``run_reference(case)`` is the same model and maths in one process on one thread,
without the settings that must not change the result; ``run_torch(case)`` the same with
``torch.optim.Muon`` and ``torch.optim.AdamW``.
"""

from __future__ import annotations

import copy
import gc
from typing import Dict, Optional

import torch
import torch.distributed as dist

import ds_muon
import dist_harness
from fuzz_models import Case, FuzzUnit, build_model, tag_experts, usages

ZERO_ENV = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1"}


class _Run:
    """A wrapped model and its ds_muon optimizer: forward+backward, step, whole parameters."""

    def __init__(self, model, opt, full_params, backward=None, step=None, flat_state=False):
        self.model, self.opt, self.shapes = model, opt, None
        self._full, self._backward, self._step = full_params, backward, step
        self.flat_state = flat_state  # state keyed by flat shards (FSDP1 flat, ZeRO): compare key sets only

    def train_step(self, grads):
        loss = self.model(grads)
        (self._backward or (lambda l: l.backward()))(loss)
        if self._step is not None:
            self._step()
        else:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def full_params(self) -> Dict[str, torch.Tensor]:
        self.opt.flush()  # overlap: a deferred update is applied at the latest here (see module doc of test_fuzz)
        return self._full()


def _muon(case: Case, groups, model=None, reference=False) -> ds_muon.Muon:
    kw = case.settings.muon_kwargs(reference=reference)
    if kw.get("overlap") or case.stack.kind == "fsdp1":
        kw["model"] = model
    return ds_muon.Muon(groups, log_summary=False, **kw)


def _groups(case: Case, model):
    groups = ds_muon.muon_param_groups(model, **case.settings.group_kwargs())
    if not case.second_group:
        return groups
    muon = groups[0]
    n = len(muon["params"])
    second = {k: (v[1::2] if isinstance(v, list) and len(v) == n else v) for k, v in muon.items()}
    first = {k: (v[0::2] if isinstance(v, list) and len(v) == n else v) for k, v in muon.items()}
    second.update(case.second_group)
    return [first] + ([second] if second["params"] else []) + groups[1:]


def _strip(name: str) -> str:
    return name[len("module."):] if name.startswith("module.") else name


def _build(case: Case) -> _Run:
    kind = case.stack.kind
    model = build_model(case.model, case.model_seed)
    shapes = usages(model)  # read before a stack hides the shapes (FSDP1)
    run = _wrap(case, model)
    run.shapes = shapes
    return run


def _wrap(case: Case, model) -> _Run:
    kind = case.stack.kind
    if kind == "single":
        opt = _muon(case, _groups(case, model), model)
        return _Run(model, opt, lambda: {n: p.detach().clone() for n, p in model.named_parameters()})
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = _muon(case, _groups(case, ddp), ddp)
        return _Run(ddp, opt, lambda: {n: p.detach().clone() for n, p in model.named_parameters()})
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (case.stack.world,))
        raf = case.stack.option("reshard_after_forward", True)
        for i in case.stack.option("wrap_units", ()):
            fully_shard(model.units[i], mesh=mesh, reshard_after_forward=raf)
        fully_shard(model, mesh=mesh, reshard_after_forward=raf)
        tag_experts(model)  # fully_shard's new DTensor parameters carry no tags
        opt = _muon(case, _groups(case, model), model)
        return _Run(model, opt, lambda: {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()})
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({FuzzUnit}) if case.stack.option("nested") else None
        orig = bool(case.stack.option("use_orig_params"))
        names = [n for n, _ in model.named_parameters()]
        fsdp = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=policy, use_orig_params=orig)
        opt = _muon(case, _groups(case, fsdp), fsdp)

        def full():
            with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT):
                sd = fsdp.state_dict()
            return {n: sd[n].detach().clone() for n in names}
        return _Run(fsdp, opt, full, flat_state=not orig)
    if kind == "zero":
        from deepspeed.utils import safe_get_full_fp32_param

        from ds_muon import deepspeed as ds_muon_deepspeed

        opt = _muon(case, _groups(case, model), model)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                  "zero_optimization": {"stage": case.stack.option("stage", 2)}, "steps_per_print": 10**9,
                  "wall_clock_breakdown": False}
        engine, _, _, _ = ds_muon_deepspeed.initialize(model=model, optimizer=opt, config=config)

        def full():
            out = {}
            for n, p in engine.module.named_parameters():
                v = safe_get_full_fp32_param(p) if p.requires_grad else None
                out[n] = (p.detach() if v is None else v).float().clone()
            return out
        return _Run(engine, engine.basic_optimizer, full, backward=engine.backward, step=engine.step,
                    flat_state=True)
    raise ValueError(f"unknown stack {kind!r}")


def state_keys(opt, flat: bool):
    """Per tensor name, its sorted state keys; for flat shards (no names to match) the set of keys."""
    if flat:
        return sorted({k for st in opt.state.values() for k in st})
    out = {}
    for g in opt.param_groups:
        for name, p in zip(g["param_names"], g["params"]):
            out[_strip(name)] = sorted(opt.state[p]) if p in opt.state else []
    return dict(sorted(out.items()))


def _same_state(a: dict, b: dict) -> Optional[str]:
    """Where two optimizer state dicts differ (tensors compared with torch.equal), or None."""
    if sorted(a["state"]) != sorted(b["state"]):
        return f"state indices {sorted(a['state'])} != {sorted(b['state'])}"
    for i in a["state"]:
        sa, sb = a["state"][i], b["state"][i]
        if sorted(sa) != sorted(sb):
            return f"state[{i}] keys {sorted(sa)} != {sorted(sb)}"
        for k in sa:
            x, y = sa[k], sb[k]
            if torch.is_tensor(x):
                x, y = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (x, y))
                if not (x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)):
                    return f"state[{i}][{k!r}] differs after load"
            elif x != y:
                return f"state[{i}][{k!r}] {x!r} != {y!r}"
    return None


def run_case(case: Case, extra=None) -> dict:
    """Train ``case`` on its stack (this rank's part of it); see the module doc.  ``extra(opt, flat_state)``:
    more results (a dict) read off the optimizer at the end."""
    run = _build(case)
    roundtrip = None
    for t in range(case.steps):
        run.train_step(case.grads(run.shapes, t))
        if t + 1 == case.roundtrip_after:
            saved = copy.deepcopy(run.opt.state_dict())
            run.opt.load_state_dict(copy.deepcopy(saved))
            roundtrip = _same_state(saved, run.opt.state_dict())
    out = {"params": run.full_params(), "keys": state_keys(run.opt, run.flat_state), "roundtrip": roundtrip,
           **(extra(run.opt, run.flat_state) if extra else {})}
    del run
    gc.collect()
    return out


def run_reference(case: Case, extra=None) -> dict:
    """One process, one thread, the case's maths without its equivalent settings (no overlap,
    sharded mode, the default planner).  ``extra(opt)``: more results (a dict) read off the optimizer."""
    with dist_harness.one_thread():
        model = build_model(case.model, case.model_seed)
        opt = _muon(case, _groups(case, model), model, reference=True)
        shapes = usages(model)
        for t in range(case.steps):
            model(case.grads(shapes, t)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "keys": state_keys(opt, False), "flat_keys": state_keys(opt, True), **(extra(opt) if extra else {})}


def run_torch(case: Case):
    """torch.optim.Muon on the Muon group's 2-D matrices, torch.optim.AdamW on the AdamW group
    (the caller checks :func:`fuzz_models.torch_comparable` first).  Conv weights and expert
    stacks (which torch's Muon refuses) and empty matrices (torch 2.13's Muon divides by their
    zero width in ``_adjust_lr``) are left out of the result.  Returns (parameters by name, the
    names torch's Muon stepped)."""
    kw = case.settings.muon_kwargs(reference=True)
    with dist_harness.one_thread():
        model = build_model(case.model, case.model_seed)
        muon_group, *adam_group = _groups(case, model)
        mats = [p for p in muon_group["params"] if p.ndim == 2 and p.numel()]
        coeff = kw["ns_coefficients"]
        opts = [torch.optim.Muon(mats, lr=case.settings.lr, weight_decay=case.settings.weight_decay,
                                 momentum=kw["momentum"], nesterov=kw["nesterov"],
                                 ns_coefficients=(3.4445, -4.7750, 2.0315) if coeff == "keller" else coeff,
                                 ns_steps=kw["ns_steps"], adjust_lr_fn="original")]
        if adam_group:
            opts.append(torch.optim.AdamW(adam_group[0]["params"], lr=case.settings.adam_lr, betas=kw["adam_betas"],
                                          eps=kw["adam_eps"], weight_decay=case.settings.adam_weight_decay))
        shapes = usages(model)
        for t in range(case.steps):
            model(case.grads(shapes, t)).backward()
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
        left_out = {id(p) for p in muon_group["params"] if p.ndim != 2 or not p.numel()}
        stepped = {id(p) for p in mats}
        params = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in left_out}
        return params, {n for n, p in model.named_parameters() if id(p) in stepped}


def rank_worker(rank, world, seed, indices, kinds, progress_dir):
    """Each spawned rank: regenerate and run every case; errors are returned, not raised, so one
    case's failure (raised alike on every rank) does not hide the others."""
    import os
    import time
    import traceback

    from fuzz_models import draw_case

    results = []
    for index, kind in zip(indices, kinds):
        case = draw_case(seed, index, kind, world)
        with open(os.path.join(progress_dir, f"rank{rank}"), "w") as f:
            f.write(case.describe())
        start, cpu = time.perf_counter(), time.process_time()
        try:
            out = run_case(case)
        except Exception:  # noqa: BLE001 - reported per case by the parent
            out = {"error": traceback.format_exc(limit=8)}
        dist.barrier()
        out["seconds"] = (time.perf_counter() - start, time.process_time() - cpu)
        results.append((index, kind, out))
    return results
