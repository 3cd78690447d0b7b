"""PEFT (LoRA) with ds_muon: which tensors take Muon, and every stack bitwise against one process.

The model: a tiny transformers Llama sequence classifier with LoRA on q/v/gate projections and
``modules_to_save=["score"]`` (a trainable copy of the classifier head), base frozen.

* ``lora_param_groups``: every ``lora_A``/``lora_B`` takes Muon, the head copy AdamW, frozen tensors
  are in no group (and so hold no state) - checked against the model's own listing, as a census over
  LoRA targets and ranks (``CENSUS``), and for a LoRA on the embedding.
* One spawned pair of ranks (W=2, gloo, the same batches on both) runs DDP, FSDP2 (each decoder layer,
  then the root), FSDP1 (``use_orig_params=True``, the groups built before wrapping), ZeRO-2
  (``ds_muon.deepspeed.initialize`` with the Muon; ZeRO-3 only on request, see ``STACKS``), and the QLoRA-style frozen bf16 base under DDP and FSDP2; after K steps the
  optimizer's ``state_dict`` is loaded into a new Muon (ZeRO: the engine's checkpoint, saved and
  loaded), K more steps.  Every trainable weight must be ``torch.equal`` to the one-process run, and
  every frozen one unchanged.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

import dist_harness  # noqa: E402

ENV = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
K = 2
SETTINGS = dict(lr=0.02, adam_lr=3e-3)
MUON_KW = dict(ns_dtype=torch.float32, log_summary=False)
TARGETS = ["q_proj", "v_proj", "gate_proj"]


def make_peft(seed: int = 0, bf16_base: bool = False, targets=TARGETS, r: int = 4, save=("score",)):
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, num_labels=3,
                         pad_token_id=0)
    config._attn_implementation = "eager"
    base = LlamaForSequenceClassification(config)
    if bf16_base:
        base = base.to(torch.bfloat16)  # the frozen base in bf16: PEFT makes the LoRA factors fp32, the head copy stays bf16
    lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), modules_to_save=list(save) or None,
                      task_type="SEQ_CLS", init_lora_weights="gaussian")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base, lora)
    return model


def batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(1, 64, (4, 12), generator=g), torch.randint(0, 3, (4,), generator=g)


def loss_of(model, step):
    ids, labels = batch(step)
    return model(input_ids=ids, labels=labels).loss


def _clean(name: str) -> str:
    for part in ("_fsdp_wrapped_module.", "module.", "_checkpoint_wrapped_module."):
        name = name.replace(part, "")
    return name


def reference(bf16_base: bool = False) -> dict:
    import ds_muon
    from ds_muon.peft import lora_param_groups

    with dist_harness.one_thread():
        model = make_peft(bf16_base=bf16_base)
        opt = ds_muon.Muon(lora_param_groups(model, **SETTINGS), **MUON_KW)
        for s in range(2 * K):
            loss_of(model, s).backward()
            opt.step()
            opt.zero_grad()
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


# -- which tensor takes what -------------------------------------------------------------------------
CENSUS = [(targets, r) for targets in (["q_proj"], ["q_proj", "v_proj"], TARGETS, ["o_proj", "down_proj", "up_proj"])
          for r in (1, 2, 8)]


def _check_against_bare(model, bare, groups):
    """Each trainable tensor of ``model`` (a PEFT model of ``bare``'s architecture) sits in the optimizer the
    bare model gives the layer it stands for, and says why."""
    import ds_muon

    bare_groups = ds_muon.muon_param_groups(bare, **SETTINGS)
    bare_muon = {n: g["use_muon"] for g in bare_groups for n in g["param_names"]}
    placed_muon = {n: g["use_muon"] for g in groups for n in g["param_names"]}
    checked = 0
    for n, p in model.named_parameters():
        short = n.removeprefix("base_model.model.")
        if not p.requires_grad:
            continue
        for marker in (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B."):
            if marker in short:
                stands_for = short.split(marker)[0] + ".weight"
                break
        else:
            stands_for = short.replace(".modules_to_save.default.", ".")
        assert stands_for in bare_muon, (n, stands_for)
        assert placed_muon[n] is bare_muon[stands_for], (n, placed_muon[n], stands_for, bare_muon[stands_for])
        checked += 1
    return checked


def _reasons(model) -> dict:
    from ds_muon.models.reading import model_map

    return {n: d for n, d in model_map(model).items() if model.get_parameter(n).requires_grad}


@pytest.mark.parametrize("door", ["muon_param_groups", "lora_param_groups"])
@pytest.mark.parametrize("targets,r", CENSUS, ids=[f"{'+'.join(t)}-r{r}" for t, r in CENSUS])
def test_lora_groups(targets, r, door):
    """Every LoRA factor of a hidden projection takes Muon at every rank (rank 1 too: a factor is no input
    layer), the head copy AdamW, frozen tensors no group; the plain door and the PEFT alias alike, and each
    tensor where the bare model puts the layer it stands for."""
    import ds_muon
    import ds_muon.peft

    model = make_peft(targets=targets, r=r)
    groups = getattr(ds_muon.peft if door == "lora_param_groups" else ds_muon, door)(model, **SETTINGS)
    placed = {id(p): g["use_muon"] for g in groups for p in g["params"]}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert id(p) not in placed, f"frozen {n} is in a group"
        elif ".lora_A." in n or ".lora_B." in n:
            assert placed[id(p)] is True, f"{n} (a rank-{r} factor of a hidden map) should take Muon"
        else:
            assert "modules_to_save" in n and placed[id(p)] is False, f"{n} (the head copy) should take AdamW"
    assert sum(len(g["params"]) for g in groups) == sum(p.requires_grad for p in model.parameters())
    for n, d in _reasons(model).items():
        if ".lora_" in n:
            assert "LoRA lora_" in d.reason and "base_layer" in d.reason, (n, d.reason)
    assert _check_against_bare(model, make_base(), groups) == sum(p.requires_grad for p in model.parameters())
    opt = ds_muon.Muon(groups, **MUON_KW)
    loss_of(model, 0).backward()
    opt.step()
    assert all(len(opt.state[p]) == 0 for p in model.parameters() if not p.requires_grad)  # a frozen base holds nothing


def make_base(seed: int = 0):
    """The bare model make_peft wraps (same config and seed), for the decisions it should match."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, num_labels=3,
                         pad_token_id=0)
    config._attn_implementation = "eager"
    return LlamaForSequenceClassification(config)


def test_lora_on_the_ends_takes_the_ends_decision():
    """LoRA on the embedding: its factors take AdamW, as the embedding does, through the plain door; the head
    copy (PEFT saves ``score`` for a SEQ_CLS task) AdamW; the hidden q_proj's factors Muon."""
    import ds_muon

    model = make_peft(targets=["embed_tokens", "q_proj"], save=())
    groups = ds_muon.muon_param_groups(model, **SETTINGS)
    kinds = {n: (g["use_muon"], k) for g in groups for n, k in zip(g["param_names"], g["param_kinds"])}
    ends = {n: v for n, v in kinds.items() if "embed_tokens" in n or ".score." in n}
    assert len(ends) == 3 and all(v[0] is False for v in ends.values()), ends  # the ends' LoRA: AdamW
    assert {v[1] for n, v in ends.items() if "embed_tokens" in n} == {"embedding"}, ends
    assert {v[1] for n, v in ends.items() if ".score." in n} == {"output head"}, ends
    assert all(v[0] for n, v in kinds.items() if "q_proj" in n)
    assert _check_against_bare(model, make_base(), groups) == len(kinds)


def test_lora_vision_rank_of_num_channels():
    """A ViT (3 input channels) with LoRA of rank 1 and 3 on its attention: no lora_B is read as an input layer
    (``[out, 3]`` has the pixels' width); the patch embedding's LoRA, and the classifier's (rank 3) or its
    saved copy (rank 1), take AdamW."""
    import warnings

    import ds_muon
    from peft import LoraConfig, get_peft_model
    from transformers import ViTConfig, ViTForImageClassification

    def vit():
        torch.manual_seed(0)
        return ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                   intermediate_size=48, image_size=16, patch_size=8,
                                                   num_channels=3, num_labels=5))

    for r in (1, 3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            head = dict(modules_to_save=["classifier"]) if r == 1 else {}
            targets = ["q_proj", "v_proj", "fc1", "fc2", "projection"] + ([] if r == 1 else ["classifier"])
            model = get_peft_model(vit(), LoraConfig(r=r, target_modules=targets, **head))
        groups = ds_muon.muon_param_groups(model, **SETTINGS)
        placed = {n: g["use_muon"] for g in groups for n in g["param_names"]}
        lora = {n: m for n, m in placed.items() if ".lora_" in n and "projection" not in n and "classifier" not in n}
        assert lora and all(lora.values()), (r, lora)
        stem = [m for n, m in placed.items() if ".lora_" in n and "projection" in n]
        assert stem == [False, False], (r, placed)  # LoRA of the patch embedding (a stem conv): AdamW
        assert [m for n, m in placed.items() if "classifier" in n] == [False, False], (r, placed)
        assert _check_against_bare(model, vit(), groups) == len(placed)


def test_peft_alias_refuses_other_models():
    from ds_muon.peft import lora_param_groups

    with pytest.raises(TypeError, match="no PEFT model"):
        lora_param_groups(torch.nn.Linear(4, 4))


# -- every stack, bitwise ----------------------------------------------------------------------------
def _full(model, names) -> dict:
    deepspeed = any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in model.parameters())
    if type(model).__name__ == "FullyShardedDataParallel":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            sd = {_clean(k): v for k, v in model.state_dict().items()}
        return {n: sd[n].detach().float().clone() for n in names if n in sd}
    out = {}
    for n, p in model.named_parameters():
        if deepspeed and p.requires_grad:
            from deepspeed.utils import safe_get_full_fp32_param

            t = safe_get_full_fp32_param(p)
        elif deepspeed and hasattr(p, "ds_id"):
            continue  # a frozen ZeRO-3 partition: not gathered here
        elif hasattr(p, "full_tensor"):
            t = p.full_tensor()
        else:
            t = p
        out[_clean(n)] = t.detach().float().clone()
    return out


def _deepspeed_config(stage):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True}


def _stack_run(stack: str, tmp: str) -> dict:
    import ds_muon
    import ds_muon.deepspeed
    from ds_muon.peft import lora_param_groups

    bf16 = stack.endswith("_bf16")
    model = make_peft(bf16_base=bf16)
    names = [n for n, _ in model.named_parameters()]
    kind = stack.removesuffix("_bf16")
    extra = {}
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for layer in model.get_base_model().model.layers:
            fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        pre = lora_param_groups(model, **SETTINGS)  # FSDP1: the groups before wrapping (it keeps the tensors)
        wrapped = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
        extra = dict(model=wrapped)
    if kind.startswith("zero"):
        muon = ds_muon.Muon(lora_param_groups(model, **SETTINGS), **MUON_KW)
        wrapped, _, _, _ = ds_muon.deepspeed.initialize(model=model, optimizer=muon,
                                                        config=_deepspeed_config(int(kind[-1])))
        for s in range(2 * K):
            wrapped.backward(loss_of(wrapped, s))
            wrapped.step()
            if s == K - 1:
                wrapped.save_checkpoint(os.path.join(tmp, stack))
                wrapped.load_checkpoint(os.path.join(tmp, stack))
        return dict(weights=_full(wrapped, names), kind=muon.adapter.kind)
    def groups():
        if kind == "fsdp1":
            return [dict(g, params=list(g["params"])) for g in pre]
        return lora_param_groups(wrapped, **SETTINGS)

    opt = ds_muon.Muon(groups(), **MUON_KW, **extra)
    for s in range(2 * K):
        loss_of(wrapped, s).backward()
        opt.step()
        opt.zero_grad()
        if s == K - 1:  # resume: the state into a new optimizer over the same tensors
            sd = opt.state_dict()
            opt = ds_muon.Muon(groups(), **MUON_KW, **extra)
            opt.load_state_dict(sd)
    dtensors = all(type(p).__name__ == "DTensor" for g in opt.param_groups for p in g["params"])
    return dict(weights=_full(wrapped, names), kind="dtensor" if dtensors else type(opt.adapter).__name__)


def _worker(rank, world, stacks, tmp):
    return {s: _stack_run(s, tmp) for s in stacks}


STACKS = tuple(s for s in os.environ.get("DS_MUON_PEFT_STACKS",
                                         "ddp,fsdp2,fsdp1,zero2,ddp_bf16,fsdp2_bf16").split(",") if s)
# ZeRO-3 is not in the default set: its backward rounds differently from one process (the plain transformers
# Llama too: gradients ~1e-10 off at the first step), which AdamW and Muon amplify (docs/PEFT.md); opt in with
# DS_MUON_PEFT_STACKS=zero3 to see it
KINDS = {"ddp": "DefaultAdapter", "fsdp2": "dtensor", "fsdp1": "DefaultAdapter", "zero2": "zero12", "zero3": "zero3"}


def test_lora_every_stack_bitwise_one_process(tmp_path):
    if any(s.startswith("zero") for s in STACKS):
        pytest.importorskip("deepspeed")
    refs = {False: reference(), True: reference(bf16_base=True)}
    base = {n: p.detach().float().clone() for n, p in make_peft().named_parameters()}
    results = dist_harness.run(_worker, 2, STACKS, str(tmp_path), timeout=500, env=ENV)
    trainable = {n for n, p in make_peft().named_parameters() if p.requires_grad}
    for stack in STACKS:
        bf16 = stack.endswith("_bf16")
        ref = refs[bf16]
        for rank, r in enumerate(results):
            got = r[stack]
            assert got["kind"] == KINDS[stack.removesuffix("_bf16")], (stack, got["kind"])
            for n in trainable:
                assert not torch.equal(ref[n], base[n]) or ".lora_B." in n, (n, "did not train")
                assert torch.equal(got["weights"][n], ref[n]), (stack, rank, n)
            for n, t in got["weights"].items():
                if n in base and n not in trainable and not bf16:
                    assert torch.equal(t, base[n]), (stack, n, "a frozen tensor changed")


def test_example_peft_lora_fsdp2_bf16_base():
    """examples/peft_lora.py under torchrun at W=2, FSDP2 over a bf16 frozen base: it learns the task and
    the tensors split as documented (12 LoRA factors on Muon, the head copy on AdamW)."""
    from test_examples import _run, _torchrun

    s = _run(_torchrun("peft_lora.py", "--stack", "fsdp2", "--bf16-base"))
    assert (s["stack"], s["world"], s["steps"]) == ("fsdp2", 2, 30), s
    assert s["tensors"]["muon"] == 12 and s["tensors"]["adamw"] == 1 and s["tensors"]["frozen"] > 12, s
    assert s["accuracy_after"] > s["accuracy_before"] + 0.1, s
    assert s["muon_home_ranks"] == [0, 1]
