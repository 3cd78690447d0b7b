"""DeepSpeed integration: ds_muon under ZeRO 0/1/2/3 against the single-process optimizer.

W=2 gloo ranks, identical batches on every rank (the averaged gradient is then
exact), gradient_clipping 0.0: after 3 steps the fp32 master parameters are
bitwise equal to ``ds_muon.Muon`` run in one process on the same model.
"""

import json
import os

import pytest
import torch
from torch import nn

import dist_harness

pytest.importorskip("deepspeed")

import ds_muon  # noqa: E402
from ds_muon import deepspeed as ds_muon_deepspeed  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(REPO, "configs", "deepspeed")
VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 24, 40, 4, 8
STEPS = 3
ENV = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1"}


class TinyLM(nn.Module):
    """Embedding, Linear layers of different shapes (one straddles the ZeRO-2 cut), LayerNorm, head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.mix = nn.Linear(DIM, DIM)
        self.gate = nn.Linear(DIM, 12, bias=False)
        self.proj = nn.Linear(12, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        h = h + self.proj(torch.tanh(self.gate(self.mix(h))))
        logits = self.lm_head(self.norm(h)).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_model():
    torch.manual_seed(0)
    return TinyLM()


def batch(step, micro=0, size=BATCH):
    g = torch.Generator().manual_seed(100 * step + micro)
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


PARAMS = {"lr": 0.02, "momentum": 0.95, "adam_lr": 3e-3, "weight_decay": 0.01}


def ds_config(stage, bf16=False, gas=1, params=None, clip=0.0):
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "DsMuon", "params": dict(params or PARAMS)},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def reference(params, steps=STEPS, double=False):
    """Single-process ds_muon on the full model, one thread (like each rank)."""
    with dist_harness.one_thread():
        model = make_model()
        opt = ds_muon_deepspeed.build_optimizer(model, params)
        for t in range(steps):
            if double:  # one batch of 2·BATCH = two accumulated micro-batches
                a, b = batch(t, 0), batch(t, 1)
                tokens, targets = torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])
            else:
                tokens, targets = batch(t)
            model(tokens, targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def full_fp32(engine):
    """Every parameter's fp32 master value, whole (a collective under ZeRO)."""
    from deepspeed.utils import safe_get_full_fp32_param

    masters = {}
    w = engine.optimizer
    if hasattr(w, "fp32_groups") and hasattr(w, "fp16_groups"):  # stage 0 fp16/bf16: per-parameter fp32 copies
        masters = {id(lp): fp for lps, fps in zip(w.fp16_groups, w.fp32_groups) for lp, fp in zip(lps, fps)}
    out = {}
    for n, p in engine.module.named_parameters():
        v = masters.get(id(p)) if id(p) in masters else safe_get_full_fp32_param(p)
        out[n] = (p.detach() if v is None else v).float().clone()
    return out


def train(engine, steps, start=0, gas=1):
    for t in range(start, start + steps):
        for micro in range(gas):
            tokens, targets = batch(t, micro)
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()


def _engine_worker(rank, world, stage, bf16, gas, params):
    engine, opt, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=ds_config(stage, bf16, gas, params))
    train(engine, STEPS, gas=gas)
    muon = engine.basic_optimizer
    info = {
        "wrapper": type(engine.optimizer).__name__,
        "returned": type(opt).__name__,
        "exchanges": len(muon.exchanges()),
        "holders": {m.key: len(m.holders()) for lay in _all_layouts(muon) for m in lay.matrices},
    }
    return full_fp32(engine), info


def _all_layouts(muon):
    return [lay for _, layouts in muon.runtime.resolved.values() for lay in layouts]


WRAPPERS = {0: "Muon", 1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}
MUON_NAMES = ["up.weight", "down.weight", "mix.weight", "gate.weight", "proj.weight"]


@pytest.mark.parametrize("stage,ns_dtype", [(0, "float32"), (1, "bfloat16"), (2, "float32"), (3, "bfloat16")])
def test_fp32_bitwise_with_single_process(stage, ns_dtype):
    params = dict(PARAMS, ns_dtype=ns_dtype)
    ref = reference(params)
    results = dist_harness.run(_engine_worker, 2, stage, False, 1, params, timeout=240, env=ENV)
    for rank, (got, info) in enumerate(results):
        assert info["exchanges"] >= 1, info
        assert info["wrapper"] == WRAPPERS[stage], info
        assert sorted(info["holders"]) == sorted(MUON_NAMES), info
        split = [k for k, h in info["holders"].items() if h == 2]
        if stage == 3:  # every matrix is partitioned across both ranks
            assert len(split) == len(MUON_NAMES), info
        elif stage in (1, 2):  # the flat partition cuts at least one matrix
            assert split and len(split) < len(MUON_NAMES), info
        else:  # replicated
            assert info["holders"] == dict.fromkeys(MUON_NAMES, 2), info
        for name, want in ref.items():
            assert torch.equal(got[name], want), f"stage {stage} rank {rank}: {name} differs " \
                f"(max {float((got[name] - want).abs().max()):.3g})"
        moved = {n: float((ref[n] - make_model().state_dict()[n]).abs().max()) for n in MUON_NAMES}
        assert all(v > 1e-3 for v in moved.values()), moved  # Muon really stepped every matrix


# -- bf16 -------------------------------------------------------------------------
BF16_WRAPPERS = {0: "FP16_UnfusedOptimizer", 1: "BF16_Optimizer", 2: "DeepSpeedZeroOptimizer",
                 3: "DeepSpeedZeroOptimizer_Stage3"}


def _bf16_worker(rank, world, stage):
    cfg = ds_config(stage, bf16=True, params=dict(PARAMS, ns_dtype="float32"))
    if stage == 1:  # bf16 params, fp32 gradient accumulation: DeepSpeed's BF16_Optimizer
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=cfg)
    train(engine, STEPS)
    momentum_dtypes = {str(s["momentum_buffer"].dtype) for s in engine.basic_optimizer.state.values()
                       if "momentum_buffer" in s}
    return full_fp32(engine), type(engine.optimizer).__name__, momentum_dtypes


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_close_to_single_process(stage):
    """bf16 forward/backward: fp32 masters within tolerance of the fp32 single-process run."""
    ref = reference(dict(PARAMS, ns_dtype="float32"))
    init = make_model().state_dict()
    results = dist_harness.run(_bf16_worker, 2, stage, timeout=240, env=ENV)
    (a, wrapper, dtypes), (b, _, _) = results
    assert wrapper == BF16_WRAPPERS[stage]
    assert dtypes == {"torch.float32"}
    errors = {}
    for name, want in ref.items():
        assert torch.equal(a[name], b[name]), f"ranks disagree on {name}"
        update = want - init[name]  # what 3 steps did, in fp32, in one process
        errors[name] = float((a[name] - want).norm() / update.norm())
    # bf16 forward/backward moves the 3-step update by a few % (Muon matrices: 2-12% measured; AdamW, sign-like
    # on tiny gradients, up to ~35%); a misplaced shard or an unremoved scale would be off by ~100%
    assert all(errors[n] < 0.2 for n in MUON_NAMES), errors
    assert all(e < 0.5 for e in errors.values()), errors


# -- gradient accumulation ------------------------------------------------------------
def test_accumulation_equals_double_batch():
    """gradient_accumulation_steps=2 at ZeRO-2: NS once per optimizer step, on the summed micro-batches."""
    params = dict(PARAMS, ns_dtype="float32")
    ref = reference(params, double=True)
    single = reference(params)
    results = dist_harness.run(_engine_worker, 2, 2, False, 2, params, timeout=240, env=ENV)
    for got, _ in results:
        for name, want in ref.items():
            err = float((got[name] - want).abs().max())
            assert err < 1e-4, f"{name}: {err:.3g}"
    # and the double batch really differs from one micro-batch per step
    assert max(float((ref[n] - single[n]).abs().max()) for n in MUON_NAMES) > 1e-3


def _counting_worker(rank, world):
    """NS (hence the exchange) runs once per optimizer step, never per micro-batch."""
    engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=ds_config(2, gas=3))
    muon = engine.basic_optimizer
    calls = []
    orig = muon.runtime.orthogonalize  # the step's NS stage
    muon.runtime.orthogonalize = lambda *a, **k: (calls.append(engine.global_steps), orig(*a, **k))[1]
    train(engine, 2, gas=3)
    return calls, engine.global_steps


def test_ns_once_per_optimizer_step():
    for calls, steps in dist_harness.run(_counting_worker, 2, timeout=240, env=ENV):
        assert steps == 2
        assert calls == [0, 1], calls  # one Muon group -> one NS pass per optimizer step


# -- checkpoints ------------------------------------------------------------------
def _checkpoint_worker(rank, world, stage, bf16, path):
    cfg = ds_config(stage, bf16=bf16, params=dict(PARAMS, ns_dtype="auto"))  # resume, not dtypes: the fast one
    engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=cfg)
    train(engine, 2)
    engine.save_checkpoint(path, tag="t2")
    train(engine, 2, start=2)
    want = full_fp32(engine)
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    other = TinyLM()
    engine2, _, _, _ = ds_muon_deepspeed.initialize(model=other, config=cfg)
    engine2.load_checkpoint(path, tag="t2")
    muon2 = engine2.basic_optimizer
    dtypes = {str(s["momentum_buffer"].dtype) for s in muon2.state.values() if "momentum_buffer" in s}
    train(engine2, 2, start=2)
    return want, full_fp32(engine2), dtypes, engine2.global_steps


@pytest.mark.parametrize("stage,bf16", [(2, False), (3, False), (1, True)], ids=["z2", "z3", "z1-bf16"])
def test_checkpoint_resume_bitwise(stage, bf16, tmp_path):
    results = dist_harness.run(_checkpoint_worker, 2, stage, bf16, str(tmp_path), timeout=240, env=ENV)
    for want, got, dtypes, steps in results:
        assert steps == 4
        assert dtypes == {"torch.float32"}, dtypes  # momentum restored, in its dtype
        for name in want:
            assert torch.equal(want[name], got[name]), f"stage {stage}: {name} differs after resume"


# -- passing ds_muon.Muon to deepspeed.initialize directly (as accelerate does) ---------
def _direct_worker(rank, world, stage, do_bind):
    import deepspeed

    from ds_muon.deepspeed import bind

    model = make_model()
    params = dict(PARAMS, ns_dtype="float32")
    muon = ds_muon_deepspeed.build_optimizer(model, params)
    cfg = ds_config(stage)
    del cfg["optimizer"]
    cfg["zero_allow_untested_optimizer"] = True
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=muon, config=cfg)
    if do_bind:
        bind(engine)
    try:
        train(engine, STEPS)
    except RuntimeError as e:
        return str(e), None
    return None, full_fp32(engine)


@pytest.mark.parametrize("stage", [2, 3])
def test_direct_unbound_raises_with_instructions(stage):
    for msg, _ in dist_harness.run(_direct_worker, 2, stage, False, timeout=240, env=ENV):
        assert msg is not None, "an unbound ds_muon.Muon under ZeRO must not step"
        assert "ds_muon.deepspeed.bind(engine)" in msg and "ds_muon.deepspeed.initialize" in msg


@pytest.mark.parametrize("stage,bind", [(2, True), (0, False)], ids=["zero2_bound", "zero0_fp32_unbound"])
def test_direct_optimizer_is_bitwise(stage, bind):
    """ZeRO-2 after bind(engine); stage 0 fp32 steps the model's own replicated tensors, so the
    default binding is right without bind."""
    ref = reference(dict(PARAMS, ns_dtype="float32"))
    for msg, got in dist_harness.run(_direct_worker, 2, stage, bind, timeout=240, env=ENV):
        assert msg is None, msg
        for name, want in ref.items():
            assert torch.equal(got[name], want), name


# -- fp16: loss scale removed before NS, overflow skips without touching momentum ---------
def _fp16_worker(rank, world):
    cfg = ds_config(2, params=dict(PARAMS, ns_dtype="float32"))
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 40, "loss_scale_window": 1000, "hysteresis": 1}
    engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=cfg)
    muon = engine.basic_optimizer
    before = full_fp32(engine)
    tokens, targets = batch(0)
    skipped, t = 0, 0
    while True:  # the same batch until the scale has come down far enough
        engine.backward(engine(tokens, targets))
        engine.step()
        t += 1
        if engine.skipped_steps == t:
            skipped += 1
            untouched = all(float(s["momentum_buffer"].abs().max()) == 0.0 for s in muon.state.values()
                            if "momentum_buffer" in s)
            assert untouched and all(torch.equal(v, before[k]) for k, v in full_fp32(engine).items())
            assert t < 40
            continue
        break
    sq = sum(float(s["momentum_buffer"].double().pow(2).sum()) for s in muon.state.values() if "momentum_buffer" in s)
    total = torch.tensor([sq], dtype=torch.float64)
    torch.distributed.all_reduce(total)
    return skipped, float(total.sqrt()), engine.optimizer.loss_scale


def _fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


@pytest.mark.skipif(not _fp16_supported(), reason="DeepSpeed's accelerator here does not support fp16 (its CPU "
                    "accelerator needs avx512_fp16); the fp16 path runs where it is supported")
def test_fp16_overflow_skips_and_scale_is_removed():
    model = make_model()
    tokens, targets = batch(0)
    model(tokens, targets).backward()
    beta = PARAMS["momentum"]
    want = sum(float(((1 - beta) * p.grad.double()).pow(2).sum()) for n, p in model.named_parameters()
               if n in MUON_NAMES) ** 0.5
    for skipped, norm, scale in dist_harness.run(_fp16_worker, 2, timeout=240, env=ENV):
        assert skipped >= 1 and scale < 2.0 ** 40
        assert abs(norm - want) < 0.02 * want, (norm, want)  # momentum holds the unscaled gradient


# -- the config entry ---------------------------------------------------------------
def test_unknown_param_lists_accepted_keys():
    with pytest.raises(ValueError) as e:
        ds_muon_deepspeed.parse_params({"lr": 0.02, "betas": [0.9, 0.95]})
    msg = str(e.value)
    assert "'betas'" in msg and "adam_betas" in msg and "adam_lr" in msg and "ns_dtype" in msg


def test_params_accept_every_muon_keyword_from_json():
    import inspect

    muon_kw = set(inspect.signature(ds_muon.Muon.__init__).parameters) - {"self", "params", "process_group", "model",
                                                                          "dispatch_in_backward", "apply_in_forward",
                                                                          "adapter"}
    assert muon_kw <= set(ds_muon_deepspeed.accepted_params())
    with pytest.raises(ValueError, match="no gather can leave from backward"):
        ds_muon_deepspeed.parse_params({"overlap": True, "dispatch_in_backward": True})
    with pytest.raises(ValueError, match="applied inside step"):
        ds_muon_deepspeed.parse_params({"overlap": True, "apply_in_forward": True})
    kw, group_kw = ds_muon_deepspeed.parse_params(json.loads(json.dumps({
        "lr": 0.01, "adam_lr": 1e-3, "ns_dtype": "bfloat16", "comm_dtype": "float32", "adam_betas": [0.8, 0.9],
        "ns_coefficients": [[3.4445, -4.775, 2.0315]], "cost_model": {"flops_per_s": 1e12, "bytes_per_s": 1e9},
        "mode": "duplicated", "nesterov": False, "scale_mode": "spectral"})))
    opt = ds_muon.Muon(ds_muon.muon_param_groups(make_model(), **group_kw), **kw)
    assert opt.adam_betas == (0.8, 0.9) and opt.comm_dtype == torch.float32 and opt.mode == "duplicated"
    assert opt.param_groups[0]["ns_dtype"] == "bfloat16" and opt.param_groups[0]["lr"] == 0.01
    assert opt.param_groups[1]["lr"] == 1e-3 and opt.param_groups[1]["betas"] == (0.8, 0.9)
    assert opt.cost_model.flops_per_s == 1e12
    with pytest.raises(ValueError, match="ns_dtype"):
        ds_muon_deepspeed.build_optimizer(make_model(), {"ns_dtype": "int8"})


def test_initialize_config_errors(tmp_path):
    model = make_model()
    bad = ds_config(2, params={"lr": 0.02, "learning_rate": 1.0})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['learning_rate'\].*accepted"):
        ds_muon_deepspeed.initialize(model=model, config=bad)
    with pytest.raises(ValueError, match="optimizer was passed too"):
        ds_muon_deepspeed.initialize(model=model, config=ds_config(2), optimizer=torch.optim.SGD(model.parameters()))
    with pytest.raises(ValueError, match="model_parameters"):
        ds_muon_deepspeed.initialize(model=model, config=ds_config(2), model_parameters=list(model.parameters()))
    with pytest.raises(ValueError, match="does not exist"):
        ds_muon_deepspeed.initialize(model=model, config=str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        ds_muon_deepspeed.initialize(model=model, config=str(tmp_path / "broken.json"))
    model.up.weight.use_muon = True  # DeepSpeed's own tag would make ZeRO-1/2 run its Muon too
    with pytest.raises(ValueError, match="up.weight.*use_muon"):
        ds_muon_deepspeed.initialize(model=model, config=ds_config(2))


def test_refused_settings_fail_before_deepspeed():
    """NVMe/partial optimizer offload and stage-0 fp16 fail with ds_muon's message, from both front
    doors, before DeepSpeed builds anything (host offload works: tests/test_offload.py)."""
    offload = dict(ds_config(2), zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}})
    nvme = dict(ds_config(3), zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme"}})
    fp16_stage0 = dict(ds_config(0), fp16={"enabled": True})
    fp16_default_stage = {k: v for k, v in fp16_stage0.items() if k != "zero_optimization"}
    cases = [(offload, r'"ratio": 0.5.*not supported'), (nvme, r'"nvme".*not supported'),
             (fp16_stage0, r'"fp16".*stage 0.*"bf16".*"stage": 1'), (fp16_default_stage, r'"fp16".*stage 0')]
    for cfg, pattern in cases:
        with pytest.raises(NotImplementedError, match=pattern):
            ds_muon_deepspeed.initialize(model=make_model(), config=cfg)
        with pytest.raises(NotImplementedError, match=pattern):
            ds_muon_deepspeed.optimizer_from_config(make_model(), cfg)
        direct = {k: v for k, v in cfg.items() if k != "optimizer"}
        with pytest.raises(NotImplementedError, match=pattern):
            ds_muon_deepspeed.initialize(model=(m := make_model()), config=direct,
                                         optimizer=ds_muon_deepspeed.build_optimizer(m, PARAMS))
    ds_muon_deepspeed.optimizer_from_config(make_model(), dict(ds_config(1), fp16={"enabled": True}))  # stage >= 1


def _refused_by_bind_worker(rank, world):
    """Engines built by plain deepspeed.initialize (as accelerate does): bind() refuses them."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from ds_muon.deepspeed import bind

    # CPU torch computes in fp16; only DeepSpeed's capability check says no on CPUs without avx512_fp16
    get_accelerator().is_fp16_supported = lambda: True
    fp16_stage0 = dict(ds_config(0), fp16={"enabled": True})
    offload = dict(ds_config(2), zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                   zero_force_ds_cpu_optimizer=False)  # gets past DeepSpeed's own CPUAdam check: bound fine
    messages = []
    for cfg in (fp16_stage0, offload):
        model = make_model()
        cfg = dict({k: v for k, v in cfg.items() if k != "optimizer"}, zero_allow_untested_optimizer=True)
        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg,
                                               optimizer=ds_muon_deepspeed.build_optimizer(model, PARAMS))
        try:
            bind(engine)
            messages.append((type(engine.optimizer).__name__, None))
        except NotImplementedError as e:
            messages.append((type(engine.optimizer).__name__, str(e)))
    return messages


def test_bind_refuses_stage0_fp16_accepts_offload():
    for messages in dist_harness.run(_refused_by_bind_worker, 1, timeout=240, env=ENV):
        (wrapper0, fp16_msg), (wrapper2, offload_msg) = messages
        assert wrapper0 == "FP16_UnfusedOptimizer" and fp16_msg and '"bf16"' in fp16_msg, messages
        assert wrapper2 == "DeepSpeedZeroOptimizer" and offload_msg is None, messages  # host offload: supported


SHIPPED = ["zero1.json", "zero2.json", "zero3.json", "zero1_bf16.json", "zero2_bf16.json", "zero3_bf16.json"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs(name):
    path = os.path.join(CONFIG_DIR, name)
    cfg = ds_muon_deepspeed.load_config(path)
    assert ds_muon_deepspeed.is_dsmuon_entry(cfg)
    assert cfg["zero_optimization"]["stage"] == int(name[4])
    assert bool(cfg.get("bf16", {}).get("enabled")) == ("bf16" in name)
    opt = ds_muon_deepspeed.build_optimizer(make_model(), cfg["optimizer"].get("params"))
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
