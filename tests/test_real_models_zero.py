"""transformers models (Llama; GPT-2 with its [in, out] Conv1D weights; Qwen2-MoE with fused experts) under
DeepSpeed ZeRO-2 and ZeRO-3.

ZeRO-3 builds the model inside ``deepspeed.zero.Init`` (as HF ``from_pretrained``
and accelerate's ``zero3_init_flag`` do): parameters are ``(0,)``-shaped with the
real shape in ``ds_shape``.  Checked: the DsMuon entry puts exactly the hidden
weight matrices on Muon (the same split as the model built without zero.Init),
and after a few steps the fp32 masters are bitwise equal to ``ds_muon.Muon`` run
in one process on the same model and batches (W=2 gloo, the same batch on both
ranks so the averaged gradient is exact, gradient_clipping 0, fp32 and bf16 NS).

The single-process run steps on the gradients DeepSpeed handed its optimizer.
Under ZeRO-2 they are bitwise the single-process backward's (asserted).  Under
ZeRO-3 Llama's differ in the last bits (3e-7 of a tensor's largest gradient, measured;
GPT-2's are equal): DeepSpeed's ZeRO-3 module
hooks put autograd nodes between layers, which changes the order in which a
tensor read by several layers (q/k/v's shared input) sums its gradients.  That
is DeepSpeed's backward, not the optimizer, so it is bounded, not compared bitwise.
"""

import pytest
import torch
from torch import nn

import dist_harness

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import ds_muon  # noqa: E402
from ds_muon import deepspeed as ds_muon_deepspeed  # noqa: E402
from hf_models import hf_batches, tiny_gpt2, tiny_llama, tiny_qwen2_moe  # noqa: E402

ENV = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1"}
STEPS, BATCH = 3, 4
PARAMS = {"lr": 0.02, "momentum": 0.95, "adam_lr": 3e-3, "weight_decay": 0.01}
NS_DTYPES = ("float32", "bfloat16")


def build(family: str) -> nn.Module:
    if family == "gpt2":  # no dropout: the sharded and the single-process runs must compute the same thing
        return tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if family == "qwen2_moe":
        return tiny_qwen2_moe()
    return tiny_llama()


def ds_config(stage: int, ns_dtype: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "DsMuon", "params": dict(PARAMS, ns_dtype=ns_dtype)},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def muon_names(groups) -> list:
    return sorted(n for g in groups if g["use_muon"] for n in g["param_names"])


def hidden_linear_weights(model: nn.Module) -> list:
    """What must take Muon: the weight of every Linear / transformers Conv1D except the output head and
    MoE gates, and the fused expert stacks (orthogonalized per expert: see ``stepped_matrices``)."""
    linear = [f"{name}.weight" for name, mod in model.named_modules()
              if (isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D") and not name.endswith("lm_head")
              and not name.endswith("_gate")]
    stacks = [n for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    return sorted(linear + stacks)


def stepped_matrices(keys: list) -> list:
    """The tensors behind the matrices Muon's layouts hold; a fused expert stack must appear as one
    matrix per expert (and gate/up half), never as itself."""
    experts = [k for k in keys if "experts." in k]
    assert all(k.endswith(("][gate]", "][up]")) or "down_proj[" in k for k in experts), experts
    return sorted({k.split("[")[0] for k in keys})


def _whole(model: nn.Module) -> dict:
    """Every parameter, whole (ZeRO-3: gathered; a collective)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fp32_masters(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def _full_grads(engine) -> dict:
    """The averaged gradients the optimizer is about to step on, whole (a collective)."""
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}


def _train_one(family: str, stage: int, ns_dtype: str) -> dict:
    import deepspeed

    cfg = ds_config(stage, ns_dtype)
    if stage == 3:
        import transformers.masking_utils  # noqa: F401  (imports torch._dynamo, which fails under zero.Init's
        # patched tensor constructors when transformers first loads it lazily inside the context)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = build(family)
        assert all(p.numel() == 0 and hasattr(p, "ds_shape") for p in model.parameters())
        # Called directly under zero.Init (not through from_config/from_pretrained), the model's own
        # weight init runs on the already partitioned (0,) tensors and leaves fused expert stacks,
        # created with torch.empty, uninitialised (garbage, sometimes non-finite: DeepSpeed then skips
        # every step). Initialise them whole, as from_pretrained's gathered init would.
        stacks = [p for n, p in model.named_parameters() if ".experts." in n]
        if stacks:
            with deepspeed.zero.GatheredParameters(stacks, modifier_rank=0):
                gen = torch.Generator().manual_seed(1)
                for p in stacks:
                    p.data.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    else:
        model = build(family)
    grouped = muon_names(ds_muon.muon_param_groups(model))
    init = _whole(model)
    engine, _, _, _ = ds_muon_deepspeed.initialize(model=model, config=cfg)
    grads = []
    for idx in hf_batches(STEPS, batch=BATCH):
        engine.backward(engine(input_ids=idx, labels=idx).loss)
        grads.append(_full_grads(engine))
        engine.step()
    assert engine.skipped_steps == 0, f"{family}: DeepSpeed skipped {engine.skipped_steps} step(s)"
    muon = engine.basic_optimizer
    stepped = sorted(m.key for _, layouts in muon.runtime.resolved.values() for lay in layouts for m in lay.matrices)
    return {"grouped": grouped, "stepped": stepped, "init": init, "grads": grads, "final": _fp32_masters(engine),
            "wrapper": type(engine.optimizer).__name__}


def _zero_worker(rank, world, stage, runs):
    return {run: _train_one(*run[:1], stage, run[1]) for run in runs}


def reference(family: str, init: dict, ns_dtype: str, sharded_grads: list):
    """ds_muon.Muon in one process, one thread, from the same initial weights and batches, stepping on
    the gradients the sharded run used.  Returns (final parameters, per step the largest difference
    between those gradients and this process's own backward)."""
    with dist_harness.one_thread():
        model = build(family)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(init[n])
        opt = ds_muon_deepspeed.build_optimizer(model, dict(PARAMS, ns_dtype=ns_dtype))
        grad_gaps = []
        for idx, grads in zip(hf_batches(STEPS, batch=BATCH), sharded_grads):
            model(input_ids=idx, labels=idx).loss.backward()
            grad_gaps.append(max(float((grads[n] - p.grad).abs().max() / p.grad.abs().max())
                                 for n, p in model.named_parameters()))
            for n, p in model.named_parameters():
                p.grad.copy_(grads[n])
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {n: p.detach().clone() for n, p in model.named_parameters()}, grad_gaps


RUNS = [("llama", "float32"), ("llama", "bfloat16"), ("gpt2", "float32"), ("gpt2", "bfloat16"),
        ("qwen2_moe", "float32")]
WRAPPERS = {2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3_zero_init"])
def test_hf_models_muon_split_and_bitwise_parity(stage):
    results = dist_harness.run(_zero_worker, 2, stage, RUNS, timeout=300, env=ENV)
    for family, ns_dtype in RUNS:
        plain = build(family)
        want_names = muon_names(ds_muon.muon_param_groups(plain))
        assert want_names == hidden_linear_weights(plain), family  # embeddings, head, norms, biases: AdamW
        ref = None
        for rank, by_run in enumerate(results):
            got = by_run[(family, ns_dtype)]
            where = f"ZeRO-{stage} {family} ns={ns_dtype} rank {rank}"
            assert got["wrapper"] == WRAPPERS[stage], where
            assert got["grouped"] == want_names, where
            assert stepped_matrices(got["stepped"]) == want_names, where  # what Muon's layouts actually hold
            if ref is None:
                ref, grad_gaps = reference(family, got["init"], ns_dtype, got["grads"])
                if stage == 2:
                    assert grad_gaps == [0.0] * STEPS, (where, grad_gaps)
                else:  # DeepSpeed's ZeRO-3 backward sums in another order (module docstring)
                    assert max(grad_gaps) < 1e-5, (where, grad_gaps)
            else:
                assert all(torch.equal(a[n], b[n]) for a, b in zip(got["grads"], results[0][(family, ns_dtype)]["grads"])
                           for n in a), where
            for name, want in ref.items():
                assert torch.equal(got["final"][name], want), \
                    f"{where}: {name} differs (max {float((got['final'][name] - want).abs().max()):.3g})"
            moved = {n: float((ref[n] - got["init"][n]).abs().max()) for n in want_names}
            assert min(moved.values()) > 1e-3, moved  # Muon really stepped every matrix


# -- shapes ds_muon cannot judge ---------------------------------------------------------
def test_empty_parameter_without_ds_shape_is_refused():
    """Parameters a stack partitioned away without recording their shapes would land in AdamW unseen;
    one genuinely empty tensor (the bias of ``nn.Linear(8, 0)``) is a real shape and is fine."""
    model = tiny_llama()
    for mod in model.modules():
        for pname, _ in list(mod.named_parameters(recurse=False)):
            setattr(mod, pname, nn.Parameter(torch.empty(0)))
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight.*no elements"):
        ds_muon.muon_param_groups(model)
    empty_bias = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(4, 0))
    names = {n for g in ds_muon.muon_param_groups(empty_bias) if g["use_muon"] for n in g["param_names"]}
    assert names == {"1.weight"}  # 0: the input layer; 2.weight: the output layer (AdamW), empty and accepted


def test_model_without_hidden_matrices_is_refused():
    model = nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8))
    with pytest.raises(ValueError, match="no hidden weight matrix.*AdamW"):
        ds_muon.muon_param_groups(model)
