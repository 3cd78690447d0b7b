"""Each front door at W=2 with a transformers Llama (tests/hf_models.py): the loss goes down, the
hidden matrices (and only they) take Muon, and a checkpoint written mid-run resumes bitwise.

* ``ds_muon.accelerate.prepare`` under the shipped accelerate configs (DDP, FSDP2, DeepSpeed
  ZeRO-2 and ZeRO-3): ``accelerator.save_state`` after K steps, K more steps; a fresh model
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
from hf_models import FAMILIES, VOCAB, hf_batches  # noqa: E402
from test_real_models import expected_muon  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
K = 3  # steps before and after the checkpoint
SETTINGS = dict(lr=0.02, adam_lr=3e-3)
DOORS = tuple(os.environ.get("H17_DOORS", "ddp,fsdp2,deepspeed_zero2,deepspeed_zero3").split(","))


def launch_env(config: str) -> dict:
    """The ACCELERATE_* / FSDP_* environment ``accelerate launch --config_file`` gives each rank."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    if config == "ddp":
        return {}
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
               dtensors=all(type(p).__name__ == "DTensor" for g in muon.param_groups for p in g["params"]))
    accelerator.wait_for_everyone()
    assert isinstance(muon, ds_muon.Muon)
    return out


def _accelerate_worker(rank, world, doors, tmp):
    out = {}
    for door in doors:
        env = launch_env(door)
        ckpt = os.path.join(tmp, f"acc_{door}")
        straight = _accelerate_run(env, 0, ckpt, resume=False)
        resumed = _accelerate_run(env, 1, ckpt, resume=True)  # another init: everything comes from ckpt
        out[door] = straight, resumed
    return out


def test_accelerate_front_door(tmp_path):
    pytest.importorskip("deepspeed")
    results = dist_harness.run(_accelerate_worker, 2, DOORS, str(tmp_path), timeout=400, env=ENV)
    want_muon = expected_muon("llama", FAMILIES["llama"]())
    for door in DOORS:
        straight, resumed = results[0][door]
        losses = straight["losses"]
        assert len(losses) == 2 * K and sum(losses[-2:]) / 2 < losses[0] - 0.05, (door, losses)
        assert straight["muon"] == want_muon, door
        assert straight["homes"] == [0, 1], (door, straight["homes"])  # Newton-Schulz split over both ranks
        assert resumed["losses"] == losses[K:], door
        for n, t in straight["weights"].items():
            assert torch.equal(resumed["weights"][n], t), (door, n)
        for r in results:  # both ranks see the same whole weights
            assert all(torch.equal(r[door][0]["weights"][n], t) for n, t in straight["weights"].items()), door
    assert results[0]["fsdp2"][0]["dtensors"] and results[0]["fsdp2"][0]["distributed_type"] == "FSDP"
    assert results[0]["deepspeed_zero2"][0]["binding"] == "zero12"
    assert results[0]["deepspeed_zero3"][0]["binding"] == "zero3"
    assert results[0]["ddp"][0]["distributed_type"] == "MULTI_CPU"
