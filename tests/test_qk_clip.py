"""QK-clip (MuonClip, arXiv 2507.20534): ``ds_muon.QKClip`` on a transformers Llama from a tiny config whose
q/k weights are inflated so some heads' logits exceed tau.

* single process: S_max per head is recorded before the step; the weights after the step equal a
  reference written here from the paper's formula (gamma = min(1, tau / S_max), q rows by gamma^alpha,
  k rows by gamma^(1-alpha); GQA: a kv head by its query heads' smallest gamma) applied to the same run
  without the clip (rtol 1e-6); at lr=0 the next forward on the same batch has every head <= tau(1+1e-5);
  with every head below tau nothing changes at all (torch.equal);
* FSDP2 W=2 and DeepSpeed ZeRO-3 W=2 (fp32 and bf16 NS, one spawned job per stack) give the single
  process's weights bitwise, and the same reduced S_max.

S_max is recorded by ``ds_muon.models.attention_logits.LogitRecorder`` (its own tests: test_attention_logits.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

import dist_harness

pytest.importorskip("transformers")

import ds_muon  # noqa: E402
from hf_models import hf_batches, hf_loss, tiny_llama  # noqa: E402
from ds_muon.models.attention_logits import LogitRecorder  # noqa: E402

TAU, STEPS, LR = 1.0, 2, 0.02
HD = 8  # tiny_llama: hidden 32, 4 query heads, 2 kv heads


def inflated_llama(**over):
    """Layer 0: query head 1 inflated; layer 1: kv head 0 inflated (query heads 0 and 1 share it)."""
    model = tiny_llama(**over)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[HD:2 * HD] *= 40
        model.model.layers[1].self_attn.k_proj.weight[0:HD] *= 40
    return model


def train(model, clip_tau=None, lr=LR, steps=STEPS, ns_dtype=torch.float32, alpha=0.5, **muon):
    """(model, optimizer, clip, [S_max per step from the recorder, before each step]) after ``steps``."""
    recorder = LogitRecorder(model)  # (the run without the clip records too: the same attention path)
    clip = ds_muon.QKClip(model, tau=clip_tau, alpha=alpha, recorder=recorder) if clip_tau is not None else None
    groups = ds_muon.muon_param_groups(model, lr=lr, **({"adam_lr": 0.0} if lr == 0 else {}))  # lr=0: nothing moves
    opt = ds_muon.Muon(groups, ns_dtype=ns_dtype, qk_clip=clip, log_summary=False, **muon)
    seen = []
    for idx in hf_batches(steps):
        hf_loss(model, idx).backward()
        seen.append(recorder.maxima())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, clip, seen


def paper_clip(weights: dict, s_max: dict, tau: float, alpha: float, nkv: int) -> dict:
    """The paper's formula on every layer's q_proj/k_proj, with the GQA policy (documented in rules/qk_clip)."""
    out = {n: w.clone() for n, w in weights.items()}
    for name, s in s_max.items():
        gam = [min(1.0, tau / float(x)) for x in s]
        q, k = out[f"{name}.q_proj.weight"], out[f"{name}.k_proj.weight"]
        group = len(gam) // nkv
        for h, g in enumerate(gam):
            q[h * HD:(h + 1) * HD] *= g ** alpha
        for j in range(nkv):
            k[j * HD:(j + 1) * HD] *= min(gam[j * group:(j + 1) * group]) ** (1 - alpha)
        qb, kb = out.get(f"{name}.q_proj.bias"), out.get(f"{name}.k_proj.bias")  # q = W x + b: b with W's rows
        if qb is not None:
            for h, g in enumerate(gam):
                qb[h * HD:(h + 1) * HD] *= g ** alpha
            for j in range(nkv):
                kb[j * HD:(j + 1) * HD] *= min(gam[j * group:(j + 1) * group]) ** (1 - alpha)
    return out


def weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def head_maxima(clip, model, idx) -> dict:
    rec = clip.recorder
    rec.reset()
    with torch.no_grad():
        model(input_ids=idx)
    return rec.maxima()


@pytest.mark.parametrize("alpha,bias,variant", [(0.5, False, "muon"), (0.25, False, "muon"), (0.5, True, "muon"),
                                                (0.5, False, "normuon")])
def test_single_process_equals_the_papers_formula(alpha, bias, variant):
    """With ``attention_bias=True`` the q/k biases scale with their rows (q = W x + b); with NorMuon the clip
    follows NorMuon's update the same way."""
    over = {"attention_bias": True} if bias else {}
    with dist_harness.one_thread():
        clipped, _, clip, seen = train(inflated_llama(**over), TAU, steps=1, alpha=alpha, variant=variant)
        plain, _, _, _ = train(inflated_llama(**over), None, steps=1, variant=variant)
    before = seen[0]
    assert float(before["model.layers.0.self_attn"][1]) > 1.3 * TAU  # the inflated heads exceed tau ...
    assert float(before["model.layers.1.self_attn"][:2].min()) > 1.3 * TAU
    assert float(before["model.layers.0.self_attn"][[0, 2, 3]].max()) < 0.2 * TAU  # ... the others do not
    assert clip.clipped_heads == 3 and clip.steps == 1
    assert all(torch.equal(clip.last_s_max[n], before[n]) for n in before)  # one process: the reduce is the max
    want = paper_clip(weights(plain), before, TAU, alpha, nkv=2)
    got = weights(clipped)
    changed = [n for n in want if not torch.equal(want[n], weights(plain)[n])]
    assert sorted(changed) == sorted(f"model.layers.{i}.self_attn.{w}_proj.{t}" for i in (0, 1) for w in "qk"
                                     for t in (("weight", "bias") if bias else ("weight",)))
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=0, msg=n)
    assert clip.report()["s_max"] == {n: s.tolist() for n, s in before.items()}


def test_every_head_ends_at_most_tau():
    """lr=0: the step changes nothing but the clip.  The first layer's input is then unchanged, so its heads'
    logits at the next forward on the step's batch are scaled by exactly their q and k factors (rtol 1e-4):
    the clipped head at tau, the head sharing its kv head shrunk by that kv factor, the others as they
    were.  Later layers see the clipped layers' new outputs, so theirs are bounded by tau(1+eps), eps=0.02
    (measured here: 0.4%)."""
    with dist_harness.one_thread():
        model, _, clip, seen = train(inflated_llama(), TAU, lr=0.0, steps=1)
        after = head_maxima(clip, model, hf_batches(1)[0])
    for name, s in after.items():
        assert float(s.max()) <= TAU * 1.02, (name, s)
    first = "model.layers.0.self_attn"
    before = seen[0][first]
    gam = [min(1.0, TAU / float(x)) for x in before]
    want = [float(before[h]) * gam[h] ** 0.5 * min(gam[h // 2 * 2:h // 2 * 2 + 2]) ** 0.5 for h in range(4)]
    torch.testing.assert_close(after[first].tolist(), want, rtol=1e-4, atol=0)
    assert abs(float(after[first].max()) - TAU) < 1e-4 * TAU


def test_no_change_when_every_head_is_below_tau():
    with dist_harness.one_thread():
        clipped, _, clip, seen = train(inflated_llama(), 1e4)
        plain, _, _, _ = train(inflated_llama(), None)
    assert clip.clipped_heads == 0 and clip.clipped_total == 0 and clip.steps == STEPS
    assert max(float(s.max()) for step in seen for s in step.values()) > TAU  # would have clipped at TAU
    a, b = weights(clipped), weights(plain)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_each_step_reads_its_own_window():
    """The step that reads the maxima starts the next window: right after it every head reads -inf, and the
    next step's S_max is the max over that step's forwards only (two micro-batches, one called below the root)."""
    with dist_harness.one_thread():
        model, opt, clip, seen = train(inflated_llama(), TAU, steps=1)
        assert all(bool((s == float("-inf")).all()) for s in clip.recorder.maxima().values())
        a, b = hf_batches(3)[1:]
        hf_loss(model, a).backward()
        first = clip.recorder.maxima()
        h = model.model(input_ids=b).last_hidden_state  # a micro-batch through the inner model, not the root
        model.lm_head(h).float().logsumexp(-1).mean().backward()
        both = clip.recorder.maxima()
        opt.step()
    assert any(not torch.equal(first[n], both[n]) for n in both)  # the second micro-batch raised some maxima
    assert all(torch.equal(clip.last_s_max[n], both[n]) for n in both) and clip.steps == 2
    assert clip.clipped_heads > 0


def test_bad_settings_are_refused():
    model = tiny_llama()
    rec = LogitRecorder(model)
    for kw, match in [({"tau": 0.0}, "tau"), ({"tau": float("nan")}, "tau"), ({"alpha": 1.5}, "alpha"),
                      ({"tau": True}, "tau")]:
        with pytest.raises(ValueError, match=match):
            ds_muon.QKClip(model, recorder=rec, **kw)
    clip = ds_muon.QKClip(model, tau=5.0, recorder=rec)
    with pytest.raises(ValueError, match="apply_in_forward"):
        ds_muon.Muon(ds_muon.muon_param_groups(model), model=model, overlap=True, apply_in_forward=True,
                     qk_clip=clip)
    with pytest.raises(ValueError, match="qk_clip"):
        ds_muon.Muon(ds_muon.muon_param_groups(model), qk_clip={"tau": 5.0})
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model), qk_clip=clip)
    twin = copy.deepcopy(opt)  # the clip holds the model: not carried, and a copy must not step silently unclipped
    with pytest.raises(RuntimeError, match="qk_clip"):
        twin.step()


def test_qk_weights_outside_muon_are_refused():
    model = inflated_llama()
    clip = ds_muon.QKClip(model, tau=TAU)
    groups = ds_muon.muon_param_groups(model, exclude=["*.q_proj.weight"])
    opt = ds_muon.Muon(groups, qk_clip=clip, log_summary=False)
    hf_loss(model, hf_batches(1)[0]).backward()
    before = weights(model)
    with pytest.raises(ValueError, match=r"q_proj\.weight.*no\s+Muon param group"):
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in weights(model).items())  # refused before anything changed


# -- sharded: the same weights as one process ------------------------------------------------------------------
NS_DTYPES = (torch.float32, torch.bfloat16)
ZERO_ENV = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1"}


def _layers_of(model):
    if hasattr(model, "transformer"):
        return model.transformer.h
    inner = getattr(model, "model", None) or model.gpt_neox
    return inner.layers


def _torch_stack(stack: str, model, world: int, ns_dtype, tau=TAU):
    """(model to call, Muon with QK-clip, clip, full parameters()) under DDP, FSDP2 or FSDP1."""
    if stack == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        clip = ds_muon.QKClip(model, tau=tau)
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=LR), ns_dtype=ns_dtype, qk_clip=clip,
                           log_summary=False)
        return DDP(model), opt, clip, lambda: weights(model)
    if stack in ("fsdp2", "fsdp2 overlap"):  # overlap: waves, gathers sent from backward (updates land in step)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in _layers_of(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        clip = ds_muon.QKClip(model, tau=tau)
        overlap = dict(overlap=True, waves=2, model=model) if stack == "fsdp2 overlap" else {}
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=LR), ns_dtype=ns_dtype, qk_clip=clip,
                           log_summary=False, **overlap)
        return model, opt, clip, lambda: {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    fsdp = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({type(_layers_of(model)[0])}),
                use_orig_params=stack == "fsdp1 orig")
    clip = ds_muon.QKClip(fsdp, tau=tau)
    opt = ds_muon.Muon(ds_muon.muon_param_groups(fsdp, lr=LR), model=fsdp, ns_dtype=ns_dtype, qk_clip=clip,
                       log_summary=False)

    def full():
        with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT):
            return {n: t.detach().clone() for n, t in fsdp.state_dict().items()}
    return fsdp, opt, clip, full


def _build(family):
    if family == "llama_bias":
        return inflated_llama(attention_bias=True)
    return inflated_llama() if family == "llama" else build_layout(family)


def _tau(family):
    return TAU if family.startswith("llama") else 0.5  # below every inflated head's S_max in both steps


def _torch_worker(rank, world, cases):
    out = {}
    for stack, family, ns_dtype in cases:
        model, opt, clip, full = _torch_stack(stack, _build(family), world, ns_dtype, _tau(family))
        s_max, clipped = [], []
        for idx in hf_batches(STEPS):  # the same batch on every rank: the average is exact
            hf_loss(model, idx).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s_max.append({ds_muon.qk_clip.clean_name(n): s for n, s in clip.last_s_max.items()})
            clipped.append(clip.clipped_heads)
        out[stack, family, ns_dtype] = full(), s_max, clipped
    # each rank its own batches: S_max is the max over the ranks (one all_reduce), so the replicas clip alike
    import torch.distributed as dist

    model, opt, clip, full = _torch_stack("ddp", inflated_llama(), world, torch.float32)
    steps = []
    for idx in hf_batches(STEPS, seed=1 + rank):
        hf_loss(model, idx).backward()
        everyone = [None] * world
        dist.all_gather_object(everyone, clip.recorder.maxima())
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append((everyone, dict(clip.last_s_max)))
    out["own batches"] = steps, full()
    # a setting that differs between ranks is refused on every rank, before anything changes
    model, opt, clip, full = _torch_stack("ddp", inflated_llama(), world, torch.float32, tau=TAU + rank)
    hf_loss(model, hf_batches(1)[0]).backward()
    before = full()
    try:
        opt.step()
        out["differing tau"] = "stepped"
    except Exception as e:  # noqa: BLE001 - the message is checked
        out["differing tau"] = f"{type(e).__name__}: {e}"
    out["unchanged"] = all(torch.equal(before[n], t) for n, t in full().items())
    return out


def _zero_worker(rank, world, cases):
    import deepspeed  # noqa: F401
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from ds_muon import deepspeed as ds_muon_deepspeed

    out = {}
    for stage, family, ns_dtype in cases:
        model = _build(family)
        params = {"lr": LR, "ns_dtype": str(ns_dtype).split(".")[1], "log_summary": False,
                  "qk_clip": {"tau": _tau(family)}}
        cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
               "optimizer": {"type": "DsMuon", "params": params},  # QK-clip from the JSON entry
               "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
        engine, _, _, _ = ds_muon_deepspeed.initialize(model=model, config=cfg)
        clip = ds_muon.find_muon(engine).qk_clip
        assert isinstance(clip, ds_muon.QKClip) and clip.settings() == (_tau(family), 0.5) and clip.model is model
        s_max, clipped, grads = [], [], []
        for idx in hf_batches(STEPS):
            engine.backward(engine(input_ids=idx, labels=idx).loss)
            grads.append({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()})
            engine.step()
            s_max.append(dict(clip.last_s_max))
            clipped.append(clip.clipped_heads)
        assert engine.skipped_steps == 0
        final = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
        out[stage, family, ns_dtype] = final, s_max, clipped, grads
    # q_proj in the AdamW group: ZeRO-3 hands Muon one partition per call, so the refusal comes at the next step
    params = {"lr": LR, "log_summary": False, "exclude": ["*.q_proj.weight"], "qk_clip": {"tau": TAU}}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "steps_per_print": 10**9,
           "optimizer": {"type": "DsMuon", "params": params}, "zero_optimization": {"stage": 3}}
    engine, _, _, _ = ds_muon_deepspeed.initialize(model=inflated_llama(), config=cfg)
    try:
        for idx in hf_batches(2):
            engine.backward(engine(input_ids=idx, labels=idx).loss)
            engine.step()
        out["adamw q_proj"] = "stepped"
    except ValueError as e:
        out["adamw q_proj"] = str(e)
    return out


def _reference(ns_dtype, grads=None, family="llama"):
    """One process, one thread: the same model, batches and clip (stepping on ``grads`` when given: ZeRO-3's
    backward sums a shared input's gradient in another order, see test_real_models_zero)."""
    with dist_harness.one_thread():
        model = _build(family)
        clip = ds_muon.QKClip(model, tau=_tau(family))
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=LR), ns_dtype=ns_dtype, qk_clip=clip,
                           log_summary=False)
        s_max, clipped = [], []
        for k, idx in enumerate(hf_batches(STEPS)):
            hf_loss(model, idx).backward()
            if grads is not None:
                for n, p in model.named_parameters():
                    p.grad.copy_(grads[k][n])
            opt.step()
            opt.zero_grad(set_to_none=True)
            s_max.append(dict(clip.last_s_max))
            clipped.append(clip.clipped_heads)
        return weights(model), s_max, clipped


def _check(where, got, want):
    (w_got, s_got, c_got), (w_want, s_want, c_want) = got, want
    assert c_got == c_want and min(c_want) > 0, (where, c_got, c_want)  # every step clipped some heads
    for a, b in zip(s_got, s_want):
        assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in b), where
    for n, t in w_want.items():
        assert torch.equal(w_got[n], t), f"{where}: {n} differs (max {float((w_got[n] - t).abs().max()):.3g})"


TORCH_CASES = [(stack, "llama", ns) for stack in ("ddp", "fsdp2", "fsdp1") for ns in NS_DTYPES] + [
    ("fsdp2 overlap", "llama", torch.float32), ("fsdp1 orig", "llama", torch.float32),
    ("fsdp2", "phi3", torch.float32), ("fsdp2", "gpt_neox", torch.float32), ("fsdp2", "mla", torch.float32),
    ("fsdp1", "phi3", torch.float32), ("fsdp1", "gpt_neox", torch.float32)] + [
    (stack, family, torch.float32) for stack in ("ddp", "fsdp2", "fsdp1") for family in ("llama_bias", "gpt2")]


def test_ddp_fsdp2_fsdp1_equal_one_process_bitwise():
    """Llama on DDP, FSDP2, FSDP1 (fp32, bf16 NS); Phi-3's [q|k|v] row blocks, GPT-NeoX's per-head interleaved
    blocks and MLA's q_b/kv_b rows cut by FSDP2's shards, and the fused blocks in FSDP1's flat parameters."""
    results = dist_harness.run(_torch_worker, 2, TORCH_CASES, timeout=300)
    for stack, family, ns_dtype in TORCH_CASES:
        want = _reference(ns_dtype, family=family)
        for rank, out in enumerate(results):
            _check(f"{stack} {family} ns={ns_dtype} rank {rank}", out[stack, family, ns_dtype], want)
    (steps, w0), (_, w1) = results[0]["own batches"], results[1]["own batches"]
    for everyone, reduced in steps:
        assert any(not torch.equal(everyone[0][n], everyone[1][n]) for n in reduced)  # the ranks saw different maxima
        for n, s in reduced.items():
            assert torch.equal(s, torch.maximum(everyone[0][n], everyone[1][n])), n
        assert all(torch.equal(results[1]["own batches"][0][0][1][n], results[0]["own batches"][0][0][1][n])
                   for n in reduced)
    assert all(torch.equal(w0[n], w1[n]) for n in w0)  # the replicas stayed equal
    for out in results:
        assert "qk_clip" in out["differing tau"] and "(1.0, 0.5)" in out["differing tau"], out["differing tau"]
        assert out["unchanged"]


ZERO_CASES = [(stage, "llama", ns) for stage in (2, 3) for ns in NS_DTYPES] + [
    (3, "phi3", torch.float32), (3, "gpt_neox", torch.float32), (3, "mla", torch.float32),
    (2, "llama_bias", torch.float32), (3, "llama_bias", torch.float32), (3, "gpt2", torch.float32)]


def test_zero2_zero3_equal_one_process_bitwise():
    """The DsMuon JSON entry's ``"qk_clip": {"tau": ...}`` under ZeRO-2 and ZeRO-3 (fp32 partitions scaled
    before DeepSpeed copies them into the model; ZeRO-3 steps one sub-group per Muon.step call); the fused
    and MLA layouts through ZeRO-3's partitions of the tagged tensors."""
    pytest.importorskip("deepspeed")
    results = dist_harness.run(_zero_worker, 2, ZERO_CASES, timeout=400, env=ZERO_ENV)
    for case in ZERO_CASES:
        stage, family, ns_dtype = case
        final, s_max, clipped, grads = results[0][case]
        want = _reference(ns_dtype, grads, family)
        for rank, out in enumerate(results):
            _check(f"ZeRO-{stage} {family} ns={ns_dtype} rank {rank}", out[case][:3], want)
    for out in results:
        assert "q_proj.weight" in out["adamw q_proj"] and "no Muon param group" in out["adamw q_proj"]


# -- the other head layouts: fused q|k|v (Phi-3 contiguous, GPT-NeoX interleaved per head) and MLA ---------------
def tiny_mla(seed: int = 0):
    """DeepSeek-V3 attention (MLA: q_a/q_b, kv_a_proj_with_mqa, kv_b_proj), dense MLPs."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                              first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                              topk_group=1, max_position_embeddings=32, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return DeepseekV3ForCausalLM(config)


NOPE, ROPE, V = 8, 4, 8
# family -> (builder, {parameter: rows to inflate})
LAYOUTS = {
    "phi3": (lambda: __import__("hf_models").tiny_phi3(), {"model.layers.0.self_attn.qkv_proj.weight": (8, 16),
                                                          "model.layers.1.self_attn.qkv_proj.weight": (32, 40)}),
    "gpt_neox": (lambda: __import__("hf_models").tiny_gpt_neox(attention_bias=False),
                 {"gpt_neox.layers.0.attention.query_key_value.weight": (24, 32),  # head 1's q
                  "gpt_neox.layers.1.attention.query_key_value.weight": (8, 16)}),  # head 0's k
    "mla": (tiny_mla, {"model.layers.0.self_attn.q_b_proj.weight": (12, 24),  # head 1's q (nope and rope)
                       "model.layers.1.self_attn.kv_b_proj.weight": (0, 8)}),  # head 0's k nope
    # GPT-2's c_attn is a Conv1D stored [in, out] with a bias: q, k, v are column blocks
    "gpt2": (lambda: __import__("hf_models").tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             {"transformer.h.0.attn.c_attn.weight": ("cols", 8, 16),  # head 1's q
              "transformer.h.1.attn.c_attn.weight": ("cols", 32, 40)}),  # head 0's k
}


def build_layout(family):
    builder, inflate = LAYOUTS[family]
    model = builder()
    with torch.no_grad():
        for name, run in inflate.items():
            if run[0] == "cols":
                model.get_parameter(name)[:, run[1]:run[2]] *= 40
            else:
                model.get_parameter(name)[run[0]:run[1]] *= 40
    return model


def expected_factors(family, s_max: dict, tau: float, alpha: float = 0.5) -> dict:
    """Per q/k weight, the factor of each row, from the paper's formula and each family's row layout."""
    out = {}
    for name, s in s_max.items():
        gam = [min(1.0, tau / float(x)) for x in s]
        nh = len(gam)
        if family == "phi3":  # rows [q heads | k heads | v heads], 4 q heads, 2 kv heads of 8
            f = [gam[h] ** alpha for h in range(nh) for _ in range(8)]
            f += [min(gam[2 * j:2 * j + 2]) ** (1 - alpha) for j in range(2) for _ in range(8)] + [1.0] * 16
            out[f"{name}.qkv_proj.weight"] = f
        elif family == "gpt2":  # columns (and bias elements) [q heads | k heads | v heads], 4 heads of 8
            f = [gam[h] ** alpha for h in range(nh) for _ in range(8)]
            f += [gam[h] ** (1 - alpha) for h in range(nh) for _ in range(8)] + [1.0] * 32
            out[f"{name}.c_attn.weight"] = out[f"{name}.c_attn.bias"] = f
        elif family == "gpt_neox":  # rows [head, (q, k, v), 8]
            out[f"{name}.query_key_value.weight"] = [
                x for h in range(nh) for x in [gam[h] ** alpha] * 8 + [gam[h] ** (1 - alpha)] * 8 + [1.0] * 8]
        else:  # MLA (the paper's MLA rule): q_C by gamma^alpha, q_R by gamma, k_C by gamma^(1-alpha), k_R and v not
            out[f"{name}.q_b_proj.weight"] = [x for h in range(nh) for x in [gam[h] ** alpha] * NOPE + [gam[h]] * ROPE]
            out[f"{name}.kv_b_proj.weight"] = [x for h in range(nh) for x in [gam[h] ** (1 - alpha)] * NOPE + [1.0] * V]
    return out


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_fused_and_mla_layouts_follow_the_formula(family):
    """Each layout's q/k rows scaled as the formula says (weights, rtol 1e-6), nothing else touched; at lr=0 the
    first layer's heads come back at exactly gamma times their S_max where each query head has its own kv head
    (GPT-NeoX, MLA; rtol 1e-4), and at most tau everywhere."""
    tau = _tau(family)
    with dist_harness.one_thread():
        clipped, _, clip, seen = train(build_layout(family), tau, steps=1)
        plain, _, _, _ = train(build_layout(family), None, steps=1)
        still, _, still_clip, seen0 = train(build_layout(family), tau, lr=0.0, steps=1)
        after = head_maxima(still_clip, still, hf_batches(1)[0])
    before = seen[0]
    assert clip.clipped_heads > 0 and any(bool((s < tau).any()) for s in before.values())
    factors = expected_factors(family, before, tau)
    got, base = weights(clipped), weights(plain)
    for n, t in base.items():
        if n in factors and factors[n] != [1.0] * len(factors[n]):
            f = torch.tensor(factors[n])
            want = t * (f if t.dim() == 1 else f[None, :] if family == "gpt2" else f[:, None])
            torch.testing.assert_close(got[n], want, rtol=1e-6, atol=0, msg=n)
        else:
            assert torch.equal(got[n], t), n
    first = sorted(before)[0]
    gam = torch.tensor([min(1.0, tau / float(x)) for x in seen0[0][first]])
    if family in ("gpt_neox", "mla", "gpt2"):  # one kv head per query head: each head exactly gamma * S_max
        torch.testing.assert_close(after[first], seen0[0][first] * gam, rtol=1e-4, atol=0)
    assert float(after[first].max()) <= tau * (1 + 1e-4)


# -- summary, resume, front doors -------------------------------------------------------------------------------
def test_summary_shows_each_heads_s_max_and_the_clipped_count(tmp_path):
    with dist_harness.one_thread():
        model, opt, clip, seen = train(inflated_llama(), TAU, steps=2)
    s = opt.summary()
    assert s.qk_clip["clipped_heads"] == clip.clipped_heads > 0 and s.qk_clip["steps"] == 2
    assert s.qk_clip["clipped_total"] == clip.clipped_total >= clip.clipped_heads
    assert s.qk_clip["s_max"] == {n: [float(x) for x in t] for n, t in clip.last_s_max.items()}
    assert s.qk_clip["s_max"] == {n: [float(x) for x in t] for n, t in seen[-1].items()}  # the last step's
    text = str(s)
    assert f"QK-clip (tau {TAU:g}, alpha 0.5): {clip.clipped_heads} head(s) clipped" in text
    assert "model.layers.1.self_attn" in text and f"{float(seen[-1]['model.layers.1.self_attn'][0]):.4g}" in text
    path = str(tmp_path / "summary.json")
    s.save(path)
    assert type(s).load(path).qk_clip == s.qk_clip
    plain = ds_muon.Muon(ds_muon.muon_param_groups(tiny_llama()), log_summary=False).summary()
    assert plain.qk_clip is None and "QK-clip" not in str(plain)


def test_resume_is_bitwise():
    """QK-clip keeps no state across steps (each step's window of maxima): a run saved after step 1 and resumed
    into a fresh model, optimizer and clip ends on the straight run's weights."""
    with dist_harness.one_thread():
        straight, _, _, _ = train(inflated_llama(), TAU, steps=2)
        first, opt1, _, _ = train(inflated_llama(), TAU, steps=1)
        saved, saved_weights = opt1.state_dict(), weights(first)
        model = inflated_llama()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved_weights[n])
        clip = ds_muon.QKClip(model, tau=TAU)
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=LR), qk_clip=clip, ns_dtype=torch.float32,
                           log_summary=False)
        opt.load_state_dict(saved)
        hf_loss(model, hf_batches(2)[1]).backward()
        opt.step()
        assert clip.clipped_heads > 0
    want = weights(straight)
    assert all(torch.equal(p.detach(), want[n]) for n, p in model.named_parameters())


def test_front_doors_build_the_clip_on_the_model():
    from ds_muon import accelerate as ds_muon_accelerate
    from ds_muon import deepspeed as ds_muon_deepspeed

    model = inflated_llama()
    opt = ds_muon_deepspeed.build_optimizer(model, {"lr": LR, "qk_clip": {"tau": 2.0, "alpha": 0.25}})
    assert isinstance(opt.qk_clip, ds_muon.QKClip) and opt.qk_clip.settings() == (2.0, 0.25)
    assert opt.qk_clip.model is model
    assert "qk_clip" in ds_muon_deepspeed.accepted_params()
    for bad, match in [({"tau": 2.0, "beta": 1}, r"unknown key\(s\) \['beta'\]"), (5.0, "must be an object")]:
        with pytest.raises(ValueError, match=match):
            ds_muon_deepspeed.build_optimizer(model, {"qk_clip": bad})
    muon = ds_muon_accelerate.build_muon(model, {"lr": LR, "qk_clip": {"tau": 3.0}})
    assert muon.qk_clip.settings() == (3.0, 0.5) and muon.qk_clip.model is model


def test_trainer_and_accelerate_settings_clip(tmp_path):
    """``MuonTrainer(muon_settings={"qk_clip": {...}})`` and ``ds_muon.accelerate.prepare(..., qk_clip=...)``
    in one process: the clip runs after each step."""
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from ds_muon.accelerate import Accelerator, find_muon, prepare
    from ds_muon.trainer import MuonTrainer

    class Rows(torch.utils.data.Dataset):
        rows = torch.cat(hf_batches(2))

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to="none",
                             use_cpu=True, save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    trainer = MuonTrainer(model=inflated_llama(), args=args, train_dataset=Rows(),
                          muon_settings={"lr": LR, "qk_clip": {"tau": TAU}})
    trainer.train()
    clip = trainer.muon.qk_clip
    assert clip.steps == 2 and clip.clipped_total > 0 and clip.model is trainer.model

    model = inflated_llama()
    model, opt = prepare(Accelerator(cpu=True), model, lr=LR, qk_clip={"tau": TAU})
    hf_loss(model, hf_batches(1)[0]).backward()
    opt.step()
    assert find_muon(opt).qk_clip.steps == 1 and find_muon(opt).qk_clip.clipped_heads > 0
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate keeps singletons: leave none behind
    GradientState._reset_state()


# -- the maths and the row runs, over generated inputs ---------------------------------------------------------
def test_head_scales_keep_every_head_at_most_tau_generated():
    """Over seeded layouts (heads, kv groups, alpha, maxima around tau): no factor exceeds 1; each head's
    logit factor (its q scale times its kv head's k scale) is at most gamma_h, so it ends <= tau; the
    smallest-gamma head of each kv group gets exactly gamma; with one kv head per query head it is the
    paper's gamma^alpha, gamma^(1-alpha)."""
    from ds_muon.rules.qk_clip import clip_gammas, head_scales

    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        nkv = int(torch.randint(1, 5, (), generator=gen))
        nq = nkv * int(torch.randint(1, 5, (), generator=gen))
        alpha = float(torch.rand((), generator=gen))
        tau = float(torch.rand((), generator=gen)) * 50 + 1
        s = torch.rand(nq, generator=gen) * 3 * tau
        s[torch.rand(nq, generator=gen) < 0.1] = float("-inf")  # heads that saw no logit
        gam = clip_gammas(s, tau)
        assert torch.equal(gam == 1, ~(s > tau)) and bool(((gam > 0) & (gam <= 1)).all())
        q, k = head_scales(gam, nkv, alpha)
        assert bool((q <= 1).all()) and bool((k <= 1).all())
        logit = q * k.repeat_interleave(nq // nkv)
        assert bool((logit <= gam * (1 + 1e-6)).all())
        assert bool((torch.where(s > tau, s * logit, torch.zeros_like(s)) <= tau * (1 + 1e-5)).all())
        for g in range(nkv):
            grp = slice(g * (nq // nkv), (g + 1) * (nq // nkv))
            j = int(gam[grp].argmin())
            torch.testing.assert_close(logit[grp][j], gam[grp][j], rtol=1e-6, atol=0)
        if nkv == nq:
            torch.testing.assert_close(q, gam ** alpha, rtol=0, atol=0)
            torch.testing.assert_close(k, gam ** (1 - alpha), rtol=0, atol=0)
    assert torch.equal(clip_gammas(torch.tensor([float("nan"), 5.0]), 1.0), torch.tensor([1.0, 0.2]))


def test_the_rule_reads_head_layouts():
    """rules/qk_clip: a fused projection's q/k head runs from its reader's blocks (a block that is not one run of
    output features refused, naming it), every output feature's factor (v's keep 1), and a stored tensor whose
    output features are not the head layout's refused."""
    from ds_muon.rules.qk_clip import Projection, fused_heads, head_scales, out_factors, stored_columns

    blocks = {"q0": ((0, 4), None), "q1": ((4, 4), None), "k0": ((8, 4), None), "v0": ((12, 4), None)}
    heads = fused_heads(blocks, False, "attn (Phi3Attention)", "qkv_proj.weight")
    assert heads == {"q0": (0, 4), "q1": (4, 4), "k0": (8, 4)}
    assert fused_heads({"k1": (None, (8, 4))}, True, "attn (GPT2Attention)", "c_attn.weight") == {"k1": (8, 4)}
    with pytest.raises(NotImplementedError, match=r"attn \(X\): the v0 block of qkv_proj.weight is not a run"):
        fused_heads({"v0": ((0, 2, 4, 8), None)}, False, "attn (X)", "qkv_proj.weight")
    gammas = torch.tensor([0.25, 1.0])
    proj = Projection("qkv_proj.weight", "attn", "qkv", 16, False, heads)
    q, k = head_scales(gammas, 1, 0.3)
    want = torch.cat([q[0].repeat(4), q[1].repeat(4), k[0].repeat(4), torch.ones(4)])
    assert torch.equal(out_factors(proj, gammas, 0.3, 1, 4), want)
    assert stored_columns((16, 4, 8), proj, "qkv_proj.weight") == 32
    with pytest.raises(ValueError, match="qkv_proj.weight has 12 output features; the head layout of attn says 16"):
        stored_columns((12, 32), proj, "qkv_proj.weight")


def test_row_runs_equal_the_indexed_path_generated():
    """The row-by-row multiply of a contiguous piece (partial first row, whole rows, partial last row) and the
    general path (an index per element) give the same bits, over seeded shapes, offsets and lengths."""
    from ds_muon.engine.exchange.layout import MatrixSlot, ParamBinding, Piece
    from ds_muon.qk_clip import _multiply, _multiply_rows
    from ds_muon.rules.qk_clip import piece_factors

    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        rows, cols = (int(x) for x in torch.randint(1, 9, (2,), generator=gen))
        numel = rows * cols
        offset = int(torch.randint(0, numel, (), generator=gen))
        length = int(torch.randint(1, numel - offset + 1, (), generator=gen))
        local_offset = int(torch.randint(0, 4, (), generator=gen))
        factors = torch.rand(rows, generator=gen)
        data = torch.randn(local_offset + length + 3, generator=gen)
        slot = MatrixSlot("w", (rows, cols), Piece(offset, length), local_offset)
        a, b = data.clone(), data.clone()
        _multiply_rows(ParamBinding(a, lambda t: t, [slot]), slot, factors, cols)
        positions = offset + torch.arange(length)
        _multiply(ParamBinding(b, lambda t: t, [slot]), slot, piece_factors(factors, positions, cols, False))
        assert torch.equal(a, b), (rows, cols, offset, length)
        assert torch.equal(a[:local_offset], data[:local_offset]) and torch.equal(a[local_offset + length:],
                                                                                 data[local_offset + length:])


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2_moe", "mixtral", "phi3", "gpt_neox"])
def test_every_family_ends_at_tau(family):
    """The tiny models of tests/hf_models.py as they are (Qwen2-MoE's and GPT-NeoX's q/k biases, GPT-2's
    Conv1D, MoE layers), tau at half the first layer's smallest S_max so every head there is clipped: at lr=0
    the next forward's first-layer heads are all at most tau, and each kv group's largest at tau (rtol 1e-4;
    with one kv head per query head, every head), whatever the layout."""
    import hf_models

    builders = {**hf_models.FAMILIES, "phi3": hf_models.tiny_phi3, "gpt_neox": hf_models.tiny_gpt_neox}
    kw = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if family == "gpt2" else {}
    with dist_harness.one_thread():
        probe, _, _, seen = train(builders[family](**kw), None, lr=0.0, steps=1)
        first = min(seen[0])  # the first attention module by name (layer 0)
        tau = 0.5 * float(seen[0][first].min())
        model, _, clip, _ = train(builders[family](**kw), tau, lr=0.0, steps=1)
        after = head_maxima(clip, model, hf_batches(1)[0])
    assert clip.clipped_heads >= len(seen[0][first])
    nq, nkv, _ = clip.recorder.heads(first)
    groups = after[first].view(nkv, nq // nkv)  # GQA: each kv group's smallest-gamma head at tau, the rest below
    assert float(groups.max()) <= tau * (1 + 1e-4)
    torch.testing.assert_close(groups.amax(dim=1), torch.full((nkv,), tau), rtol=1e-4, atol=0)
