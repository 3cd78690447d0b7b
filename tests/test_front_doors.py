"""Each front door at W=2 with a transformers Llama (tests/hf_models.py): the loss goes down, the
hidden matrices (and only they) take Muon, and a checkpoint written mid-run resumes bitwise.

* ``ds_muon.accelerate.prepare`` under the shipped accelerate configs (DDP, FSDP2, DeepSpeed
  ZeRO-2 and ZeRO-3, and ZeRO-1 through zero1.json): ``accelerator.save_state`` after K steps, K more steps; a fresh model
  (other seed) + ``accelerator.load_state`` + the same K steps ends on the same fp32 weights.
* ``ds_muon.trainer.MuonTrainer`` (DDP, FSDP2, DeepSpeed ZeRO-2/3): ``save_steps=K`` and
  ``resume_from_checkpoint`` against the straight run.

The launch configs are read the way ``accelerate launch`` reads them (its own parser and env
builders), so the environment each rank sees is the one the config files produce.  All
set-ups of one front door share one spawned pair of ranks (DeepSpeed inits are slow).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import dist_harness  # noqa: E402
from door_matrix import TokenRows  # noqa: E402
from hf_models import FAMILIES, hf_batches  # noqa: E402
from test_real_models import expected_muon  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
K = 3  # steps before and after the checkpoint
SETTINGS = dict(lr=0.02, adam_lr=3e-3)
DOORS = tuple(os.environ.get("H17_DOORS", "ddp,fsdp2,deepspeed_zero1,deepspeed_zero2,deepspeed_zero3").split(","))


def launch_env(config: str) -> dict:
    """The ACCELERATE_* / FSDP_* environment ``accelerate launch --config_file`` gives each rank."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    if config == "ddp":
        return {}
    if config == "deepspeed_zero1":  # no YAML of its own: the ZeRO-2 launch with zero1.json
        return {**launch_env("deepspeed_zero2"),
                "ACCELERATE_DEEPSPEED_CONFIG_FILE": os.path.join(REPO, "configs", "deepspeed", "zero1.json")}
    path = os.path.join(REPO, "configs", "accelerate", f"{config}.yaml")
    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", path, "x.py"]))
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config) if defaults else ""
        env = prepare_deepspeed_cmd_env(args)[1]
        # relative to the repository root, like the commands in docs/ACCELERATE.md
        env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = os.path.join(REPO, env["ACCELERATE_DEEPSPEED_CONFIG_FILE"])
    else:
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


def _fresh_accelerate(env: dict):
    """A new accelerate world for the next set-up inside the same ranks (accelerate keeps singletons)."""
    from accelerate.state import AcceleratorState, GradientState

    for k in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        del os.environ[k]
    os.environ.update(env)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _full_fp32(model) -> dict:
    """Every trained weight, whole, in fp32 (DeepSpeed: its fp32 masters; FSDP2: the full DTensor)."""
    out = {}
    for n, p in model.named_parameters():
        if hasattr(p, "ds_id") or hasattr(model, "optimizer"):
            from deepspeed.utils import safe_get_full_fp32_param

            t = safe_get_full_fp32_param(p)
        elif hasattr(p, "full_tensor"):
            t = p.full_tensor()
        else:
            t = p
        out[n.removeprefix("module.")] = t.detach().float().clone()
    return out


def _layers_sharded(model) -> bool:
    """Each decoder layer is its own FSDP2 unit (the wrap policy matched), not only the root."""
    from torch.distributed.fsdp import FSDPModule

    layers = getattr(getattr(model, "model", None), "layers", [])
    return len(layers) > 0 and all(isinstance(layer, FSDPModule) for layer in layers)


def _rows(n_rows: int, seed: int):
    return torch.cat(hf_batches(n_rows, batch=1, seed=seed))


def muon_names(muon) -> set:
    return {n for g in muon.param_groups if g["use_muon"] for n in g["param_names"]}


# -- ds_muon.accelerate ------------------------------------------------------------------------------
def _accelerate_run(env, seed, ckpt, resume: bool):
    """K steps (then save_state) and K more; or load_state and the same K more."""
    from torch.utils.data import DataLoader, TensorDataset

    import ds_muon
    from ds_muon.accelerate import Accelerator, find_muon, prepare

    _fresh_accelerate(env)
    accelerator = Accelerator()
    model = FAMILIES["llama"](seed=seed)
    rows = _rows(2 * K * 4 * accelerator.num_processes, seed=5)
    loader = DataLoader(TensorDataset(rows), batch_size=4, shuffle=False)
    model, opt, loader = prepare(accelerator, model, loader, **SETTINGS)
    muon = find_muon(opt)
    batches = [b[0] for b in loader]
    assert len(batches) == 2 * K, len(batches)
    losses = []

    def step(idx):
        loss = model(input_ids=idx, labels=idx).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())

    if resume:
        accelerator.load_state(ckpt)
    else:
        for idx in batches[:K]:
            step(idx)
        accelerator.save_state(ckpt)
    for idx in batches[K:]:
        step(idx)
    out = dict(losses=losses, weights=_full_fp32(model), muon=muon_names(muon),
               kind=type(muon.adapter).__name__, binding=getattr(muon.adapter, "kind", None),
               distributed_type=str(accelerator.distributed_type).split(".")[-1],
               homes=sorted({h for ex in muon.exchanges() for hs in ex.homes.values() for h in hs}),
               dtensors=all(type(p).__name__ == "DTensor" for g in muon.param_groups for p in g["params"]),
               layers_sharded=_layers_sharded(model),
               zero_stage=model.zero_optimization_stage() if hasattr(model, "zero_optimization_stage") else None)
    accelerator.wait_for_everyone()
    assert isinstance(muon, ds_muon.Muon)
    return out


def _accelerate_refusals() -> list:
    """Bad input to prepare: each a clear error, on every rank, before anything is built."""
    import accelerate

    import ds_muon
    from ds_muon.accelerate import prepare

    _fresh_accelerate({})
    plain = accelerate.Accelerator()  # on CPU without cpu=True: one process per rank, not distributed
    model = FAMILIES["llama"]()
    calls = [lambda: prepare(plain, model),
             lambda: prepare(plain, model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)),
             lambda: prepare(plain, model, optimizer=ds_muon.Muon(ds_muon.muon_param_groups(model)), lr=0.1)]
    out = []
    for call in calls:
        try:
            call()
            out.append("accepted")
        except (RuntimeError, TypeError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def _accelerate_worker(rank, world, doors, tmp):
    out = {"refusals": _accelerate_refusals()}
    for door in doors:
        env = launch_env(door)
        ckpt = os.path.join(tmp, f"acc_{door}")
        straight = _accelerate_run(env, 0, ckpt, resume=False)
        resumed = _accelerate_run(env, 1, ckpt, resume=True)  # another init: everything comes from ckpt
        out[door] = straight, resumed
    return out


def check_door(results, door, resumed_losses):
    """One front door's straight and resumed runs: the loss falls, exactly the hidden matrices take
    Muon, NS is split over both ranks, and the resumed run ends bitwise where the straight one does
    (both ranks see the same whole weights)."""
    straight, resumed = results[0][door]
    losses = straight["losses"]
    assert len(losses) == 2 * K and sum(losses[-2:]) / 2 < losses[0] - 0.05, (door, losses)
    assert straight["muon"] == expected_muon("llama", FAMILIES["llama"]()), door
    assert straight["homes"] == [0, 1], (door, straight["homes"])  # Newton-Schulz split over both ranks
    assert resumed["losses"] == resumed_losses(losses), (door, resumed["losses"], losses)
    for r in results:
        for run in r[door]:
            for n, t in straight["weights"].items():
                assert torch.equal(run["weights"][n], t), (door, n)


def test_accelerate_front_door(tmp_path):
    pytest.importorskip("deepspeed")
    results = dist_harness.run(_accelerate_worker, 2, DOORS, str(tmp_path), timeout=400, env=ENV)
    for door in DOORS:  # accelerate's own loss log of a resumed run holds only its K steps
        check_door(results, door, resumed_losses=lambda losses: losses[K:])
    assert results[0]["fsdp2"][0]["dtensors"] and results[0]["fsdp2"][0]["distributed_type"] == "FSDP"
    assert results[0]["fsdp2"][0]["layers_sharded"]
    assert results[0]["deepspeed_zero1"][0]["binding"] == results[0]["deepspeed_zero2"][0]["binding"] == "zero12"
    assert [results[0][f"deepspeed_zero{s}"][0]["zero_stage"] for s in (1, 2, 3)] == [1, 2, 3]
    assert results[0]["deepspeed_zero3"][0]["binding"] == "zero3"
    assert results[0]["ddp"][0]["distributed_type"] == "MULTI_CPU"
    for r in results:
        not_distributed, not_muon, both = r["refusals"]
        assert not_distributed.startswith("RuntimeError") and "ds_muon.accelerate.Accelerator" in not_distributed
        assert not_muon.startswith("TypeError") and "SGD" in not_muon
        assert both.startswith("TypeError") and "['lr']" in both


# -- ds_muon.trainer.MuonTrainer ---------------------------------------------------------------------
TRAINER_DOORS = tuple(os.environ.get("H17_TRAINER_DOORS", "ddp,fsdp2,zero2,zero3").split(","))


def _trainer_args(door, out_dir, **kw):
    from transformers import TrainingArguments

    stack = {}
    if door == "fsdp2":
        stack = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "reshard_after_forward": True})
    elif door.startswith("zero"):
        stack = dict(deepspeed=os.path.join(REPO, "configs", "deepspeed", f"{door}.json"))
    return TrainingArguments(output_dir=out_dir, max_steps=2 * K, per_device_train_batch_size=8, logging_steps=1,
                             save_steps=K, save_strategy="steps", report_to="none", use_cpu=True, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True, **stack, **kw)


def _trainer_run(door, out_dir, seed, resume=None):
    from ds_muon.trainer import MuonTrainer

    _fresh_accelerate({})
    trainer = MuonTrainer(model=FAMILIES["llama"](seed=seed), args=_trainer_args(door, out_dir),
                          train_dataset=TokenRows(_rows(2 * K * 8 * 2, seed=5)), muon_settings=SETTINGS)
    trainer.train(resume_from_checkpoint=resume)
    muon = trainer.muon
    return dict(losses=[r["loss"] for r in trainer.state.log_history if "loss" in r],
                weights=_full_fp32(trainer.model_wrapped), muon=muon_names(muon),
                binding=getattr(muon.adapter, "kind", None), wrapped=type(trainer.model_wrapped).__name__,
                layers_sharded=_layers_sharded(trainer.model),
                homes=sorted({h for ex in muon.exchanges() for hs in ex.homes.values() for h in hs}))


def _evaluate_first_refused(tmp) -> str:
    """evaluate() before train() at W=2: refused with the advice, on every rank."""
    from ds_muon.trainer import MuonTrainer

    _fresh_accelerate({})
    rows = _rows(8, seed=5)
    trainer = MuonTrainer(model=FAMILIES["llama"](), args=_trainer_args("ddp", tmp), train_dataset=TokenRows(rows),
                          eval_dataset=TokenRows(rows), muon_settings=SETTINGS)
    try:
        trainer.evaluate()
    except RuntimeError as e:
        return str(e)
    return "evaluate() ran"


def _trainer_worker(rank, world, doors, tmp):
    out = {"evaluate_first": _evaluate_first_refused(os.path.join(tmp, "eval_first"))}
    for door in doors:
        run_dir = os.path.join(tmp, f"trainer_{door}")
        straight = _trainer_run(door, run_dir, 0)
        resumed = _trainer_run(door, os.path.join(tmp, f"trainer_{door}_resumed"), 1,
                               resume=os.path.join(run_dir, f"checkpoint-{K}"))
        out[door] = straight, resumed
    return out


def test_trainer_front_door(tmp_path):
    if any(d.startswith("zero") for d in TRAINER_DOORS):
        pytest.importorskip("deepspeed")
    results = dist_harness.run(_trainer_worker, 2, TRAINER_DOORS, str(tmp_path), timeout=400, env=ENV)
    for door in TRAINER_DOORS:  # the Trainer's log of a resumed run: the history K, then its own K
        check_door(results, door, resumed_losses=lambda losses: losses)
    wrapped = {d: (results[0][d][0]["wrapped"], results[0][d][0]["binding"]) for d in TRAINER_DOORS}
    want = {"ddp": ("DistributedDataParallel", None), "fsdp2": ("FSDPLlamaForCausalLM", None),
            "zero2": ("DeepSpeedEngine", "zero12"), "zero3": ("DeepSpeedEngine", "zero3")}
    assert wrapped == {d: want[d] for d in TRAINER_DOORS}
    if "fsdp2" in TRAINER_DOORS:
        assert results[0]["fsdp2"][0]["layers_sharded"]  # not only the root
    for r in results:
        assert "eval_on_start=True" in r["evaluate_first"], r["evaluate_first"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fsdp2_yaml_wraps_any_hf_model(family, monkeypatch):
    """configs/accelerate/fsdp2.yaml names no layer class: accelerate's FSDP2 wrap policy takes the
    model's own ``_no_split_modules`` (LlamaDecoderLayer, GPT2Block) and matches every decoder layer."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    for k, v in launch_env("fsdp2").items():
        monkeypatch.setenv(k, v)
    model = FAMILIES[family]()
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.transformer_cls_names_to_wrap is None
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    layers = model.transformer.h if family == "gpt2" else model.model.layers
    assert [m for m in model.modules() if policy(m)] == list(layers)


def test_dsmuon_entry_leaves_the_config():
    """What ``prepare`` / ``MuonTrainer`` do to the config dict accelerate and the Trainer keep."""
    from ds_muon.accelerate import build_deepspeed_muon, take_dsmuon_entry

    with pytest.raises(ValueError, match="DsMuon"):  # another optimizer: a clear error, not accelerate's
        take_dsmuon_entry({"optimizer": {"type": "AdamW", "params": {}}, "zero_optimization": {"stage": 2}}, {})
    cfg = {"optimizer": {"type": "DsMuon", "params": {"lr": 0.01, "adam_lr": 1e-3, "ns_steps": 4}},
           "zero_optimization": {"stage": 2}}
    params = take_dsmuon_entry(cfg, {"lr": 0.05})  # keyword settings win over the entry
    assert cfg == {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    assert params == {"lr": 0.05, "adam_lr": 1e-3, "ns_steps": 4}
    muon_group, adam_group = build_deepspeed_muon(FAMILIES["llama"](), params).param_groups
    assert muon_group["use_muon"] and muon_group["lr"] == 0.05 and muon_group["ns_steps"] == 4
    assert not adam_group["use_muon"] and adam_group["lr"] == 1e-3
    with pytest.raises(ValueError, match="unknown key"):
        take_dsmuon_entry({"optimizer": {"type": "DsMuon", "params": {"betas": [0.9, 0.9]}}}, {})
    # Python-only muon_param_groups keywords work as settings under DeepSpeed too
    llama = FAMILIES["llama"]()
    groups = build_deepspeed_muon(llama, take_dsmuon_entry({}, {"head_names": ("lm_head", "o_proj")})).param_groups
    assert not any(n.endswith("o_proj.weight") for g in groups if g["use_muon"] for n in g["param_names"])
    # host optimizer offload: DeepSpeed would refuse the client optimizer without the flag the entry sets
    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    take_dsmuon_entry(cfg, {})
    assert cfg["zero_force_ds_cpu_optimizer"] is False
    with pytest.raises(NotImplementedError, match="nvme"):
        take_dsmuon_entry({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, {})


def test_prepare_rejects_unknown_settings():
    from ds_muon.accelerate import split_settings

    with pytest.raises(TypeError, match="unknown setting.*'betas'.*accepted"):
        split_settings({"lr": 0.02, "betas": (0.9, 0.95)})
    assert split_settings({"lr": 0.02, "adam_lr": 1e-3, "ns_dtype": torch.float32}) == (
        {"lr": 0.02, "adam_lr": 1e-3}, {"ns_dtype": torch.float32})


def test_trainer_refuses_a_launch_it_would_run_alone(tmp_path, monkeypatch):
    """torchrun's environment on a machine without a GPU and TrainingArguments without use_cpu: accelerate
    runs each process alone (num_processes 1; with DeepSpeed training ran and evaluation failed in gloo's
    allgather). MuonTrainer refuses when it is built, naming use_cpu=True; with use_cpu=True it is built."""
    from accelerate.state import AcceleratorState
    from transformers import TrainingArguments

    from ds_muon.trainer import MuonTrainer

    if torch.cuda.is_available():
        pytest.skip("accelerate joins the processes on GPUs")
    monkeypatch.setenv("WORLD_SIZE", "2")  # the launcher's world; no process group is started (rank 1 never runs)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=False)
        with pytest.raises(RuntimeError, match=r"started 2 processes.*use_cpu=True"):
            MuonTrainer(model=FAMILIES["llama"](), args=args, train_dataset=TokenRows(_rows(8, seed=5)))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
