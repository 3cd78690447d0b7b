"""Smoke tests of every launcher path: the examples train a small GPT for ~20 steps, sharded.

Each test runs a launcher (python, ``torchrun``, ``accelerate launch``) in a subprocess
with a hard timeout on 2 gloo CPU ranks (CUDA hidden, one thread per rank) and checks
from the printed JSON summary / metrics file that the loss went down, that the stack
sharded what it promises, and that ds_muon's plan put Newton-Schulz homes on both ranks
(``muon_home_ranks == [0, 1]``: the optimizer itself ran sharded, not duplicated).
About 2.7 minutes on 2 cores (2:41 measured).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
TIMEOUT = 300
LN_VOCAB = math.log(256)  # the loss of a uniform guess over bytes
# small model, 20 steps
TRAIN_GPT_FLAGS = ["--width", "64", "--layers", "2", "--seq-len", "32", "--batch", "8", "--eval-every", "10", "--eval-batches", "2"]
ACCEL_FLAGS = ["--steps", "20", "--micro-batch", "4", "--seq-len", "32", "--width", "64", "--layers", "2"]


def _env():
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd, cwd=REPO):
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")[-3000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-3000:]
        pytest.fail(f"timed out after {TIMEOUT}s: {' '.join(cmd)}\n{out}")
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}: {' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-3000:]}\n"
                    f"--- stderr ---\n{proc.stderr[-5000:]}")
    summaries = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{\"")]
    assert len(summaries) == 1, f"expected one JSON summary line (rank 0), got {len(summaries)}:\n{proc.stdout[-3000:]}"
    return summaries[0]


def _torchrun(script, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            os.path.join(EXAMPLES, script), *args]


def _accelerate(config, *args):
    return [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(_free_port()),
            "--config_file", os.path.join(REPO, "configs", "accelerate", config),
            os.path.join(EXAMPLES, "accelerate_train.py"), *args]


def _assert_learns(train_losses, final_eval, initial_eval=None):
    assert len(train_losses) == 20, train_losses
    assert all(math.isfinite(x) for x in train_losses), train_losses
    first, last = sum(train_losses[:3]) / 3, sum(train_losses[-5:]) / 5
    assert last < first - 0.5, f"train loss did not go down: first 3 {first:.3f}, last 5 {last:.3f}"
    assert final_eval < LN_VOCAB - 1.0, f"final eval loss {final_eval:.3f} is no better than guessing bytes"
    if initial_eval is not None:
        assert final_eval < initial_eval - 1.0, f"eval loss {initial_eval:.3f} -> {final_eval:.3f}"


def _train_gpt(stack, out, *extra):
    args = ["--stack", stack, "--out", str(out), *TRAIN_GPT_FLAGS, *extra]
    if stack == "single":
        return _run([sys.executable, os.path.join(EXAMPLES, "train_gpt.py"), *args])
    return _run(_torchrun("train_gpt.py", *args))


def _metrics(out, run_name):
    with open(os.path.join(out, f"{run_name}.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


# -- examples/train_gpt.py under every stack ----------------------------------------------------
@pytest.mark.parametrize("stack", ["single", "ddp", "fsdp1", "fsdp2", "deepspeed"])
def test_train_gpt_stack(stack, tmp_path):
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    if stack == "deepspeed":
        pytest.importorskip("deepspeed")
    s = _train_gpt(stack, tmp_path, "--steps", "20")
    assert (s["stack"], s["optimizer"], s["steps"]) == (stack, "ds_muon", 20)
    assert s["world"] == (1 if stack == "single" else 2)
    rows = _metrics(tmp_path, s["run"])
    assert [r["step"] for r in rows] == list(range(1, 21))
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) == 2 and evals[-1] == s["final_eval_loss"]
    _assert_learns([r["train_loss"] for r in rows], s["final_eval_loss"])
    # the optimizer's plan gave Newton-Schulz work to every rank
    assert s["muon_home_ranks"] == ([0] if stack == "single" else [0, 1])
    assert s.get("dtensor_params") is (True if stack == "fsdp2" else None)
    assert os.path.getsize(s["plot"]) > 0


def test_train_gpt_fsdp2_resume(tmp_path):
    """--save at 10 steps, --resume to 20 == 20 straight (bitwise: same final eval loss); the
    checkpoint is really sharded (each rank wrote its own half)."""
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    straight = _train_gpt("fsdp2", tmp_path / "straight", "--steps", "20")
    ckpt = tmp_path / "ckpt"
    first = _train_gpt("fsdp2", tmp_path / "split", "--steps", "10", "--save", str(ckpt))
    assert first["steps"] == 10
    resumed = _train_gpt("fsdp2", tmp_path / "split", "--steps", "20", "--resume", str(ckpt))
    assert resumed["final_eval_loss"] == straight["final_eval_loss"], (resumed, straight)
    assert resumed["muon_home_ranks"] == [0, 1]
    assert [r["step"] for r in _metrics(tmp_path / "split", resumed["run"])] == list(range(1, 21))
    shards = {f: os.path.getsize(ckpt / f) for f in os.listdir(ckpt) if f.endswith(".distcp")}
    assert len(shards) == 2, shards
    total = sum(shards.values())
    assert all(size > 0.3 * total for size in shards.values()), f"one rank holds most of the state: {shards}"


def test_train_gpt_fsdp2_overlap_is_bitwise(tmp_path):
    """--overlap (gathers from backward, waves pipelined in step()) ends on the very same eval
    loss as the plain run, evaluations in between included."""
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    plain = _train_gpt("fsdp2", tmp_path, "--steps", "12", "--eval-every", "5", "--run-name", "plain")
    ovl = _train_gpt("fsdp2", tmp_path, "--steps", "12", "--eval-every", "5", "--run-name", "overlap", "--overlap")
    assert ovl["muon_exchanges"] > plain["muon_exchanges"]  # the waves were really on
    assert ovl["final_eval_loss"] == plain["final_eval_loss"]
    assert [r.get("eval_loss") for r in _metrics(tmp_path, "overlap")] == \
        [r.get("eval_loss") for r in _metrics(tmp_path, "plain")]


# -- examples/accelerate_train.py under the three accelerate configs -------------------------------
def test_accelerate_fsdp2(tmp_path):
    pytest.importorskip("accelerate")
    s = _run(_accelerate("fsdp2.yaml", *ACCEL_FLAGS))
    assert s["world"] == 2 and s["steps"] == 20
    assert s["fsdp2"] is True and s["dtensor_params"] is True
    assert s["distributed_type"] in ("FSDP", "MULTI_CPU")  # MULTI_CPU: the CPU workaround sharded it
    _assert_learns(s["train_losses"], s["final_eval_loss"], s["initial_eval_loss"])
    assert s["muon_home_ranks"] == [0, 1]


# accelerate's own FSDP2 prepare() (what GPUs run), which ds_muon.accelerate.prepare also runs on CPU: see
# tests/test_front_doors.py (sharded per decoder layer, the Muon's parameters swapped for DTensors, save/load).


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_deepspeed(stage, tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")  # accelerate's DeepSpeed path imports it
    s = _run(_accelerate(f"deepspeed_zero{stage}.yaml", *ACCEL_FLAGS))
    assert s["distributed_type"] == "DEEPSPEED" and s["world"] == 2 and s["steps"] == 20
    assert s["zero_stage"] == stage
    # bind() read ZeRO's flat partitions (not the replicated fallback)
    assert s["deepspeed_binding"] == ("zero12" if stage == 2 else "zero3")
    _assert_learns(s["train_losses"], s["final_eval_loss"], s["initial_eval_loss"])
    assert s["muon_home_ranks"] == [0, 1]


# -- examples/hf_trainer.py: transformers.Trainer, DDP over 2 ranks ---------------------------------
@pytest.mark.parametrize("stack", ["ddp", "fsdp2", "zero3"])
def test_hf_trainer(stack, tmp_path):
    """MuonTrainer under torchrun (no test harness: the Trainer starts the process group itself); each of
    docs/TRAINER.md's launch lines (tests/test_doc_snippets.py::DOC_COMMANDS)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    extra = ["--fsdp2"] if stack == "fsdp2" else []
    if stack == "zero3":
        pytest.importorskip("deepspeed")
        extra = ["--deepspeed", os.path.join(REPO, "configs", "deepspeed", "zero3.json")]
    s = _run(_torchrun("hf_trainer.py", "--steps", "20", "--seq-len", "32", "--output-dir", str(tmp_path), *extra))
    assert s["world"] == 2 and s["steps"] == 20
    # DDP: ranks average their gradients; ZeRO-3: the engine the Trainer built steps ds_muon
    assert s["wrapped_in"] == {"ddp": "DistributedDataParallel", "zero3": "DeepSpeedEngine"}.get(stack, s["wrapped_in"])
    if stack == "fsdp2":
        assert s["wrapped_in"].startswith("FSDP"), s["wrapped_in"]
    _assert_learns(s["train_losses"], s["final_eval_loss"], s["initial_eval_loss"])
    assert s["muon_home_ranks"] == [0, 1]
    # GPT-2 Conv1D weights are stored [in, out]; the scale factor is that of [out, in]
    scales = s["muon_scale_factors"]
    assert len(scales) == 8  # c_attn, attn.c_proj, c_fc, mlp.c_proj in 2 blocks; no embedding / head
    assert scales["transformer.h.0.attn.c_attn.weight"] == pytest.approx(math.sqrt(3))  # 64 -> 192
    assert scales["transformer.h.0.mlp.c_fc.weight"] == pytest.approx(2.0)  # 64 -> 256
    assert scales["transformer.h.0.mlp.c_proj.weight"] == pytest.approx(1.0)  # 256 -> 64


# -- in-process checks of the examples' helpers (no launcher) ----------------------------------------
def _load_example(name):
    spec = importlib.util.spec_from_file_location(f"_example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_accelerate_train_rejects_bad_input():
    pytest.importorskip("accelerate")
    ex = _load_example("accelerate_train")
    for argv in (["--steps", "0"], ["--width", "30", "--heads", "4"], ["--lr", "-1"]):
        with pytest.raises(SystemExit):
            ex.parse_args(argv)
    # (the DsMuon-entry handling the script used to do itself: tests/test_front_doors.py)


def test_hf_trainer_conv1d_groups():
    """muon_param_groups tags GPT-2's [in, out] Conv1D weights; Muon then scales each update by
    its [out, in] shape: one step with momentum 0 moves c_fc by exactly -lr * 2 * NS(G)."""
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    import ds_muon
    from ds_muon.tensors.tag_keys import is_transposed

    ex = _load_example("hf_trainer")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64,
                                                                 n_positions=16, bos_token_id=0, eos_token_id=0))
    groups = ds_muon.muon_param_groups(model, lr=0.1)
    conv = sorted(n + ".weight" for n, m in model.named_modules() if isinstance(m, Conv1D))
    muon_names = [n for g in groups if g["use_muon"] for n in g["param_names"]]
    assert sorted(muon_names) == conv
    assert all(is_transposed(p) for g in groups if g["use_muon"] for p in g["params"])
    shapes = {n: (p.shape[0], p[0].numel()) for n, p in model.named_parameters() if p.ndim >= 2}
    scales = ex.muon_scale_factors(model, groups, shapes)
    assert scales["transformer.h.0.mlp.c_fc.weight"] == pytest.approx(2.0)
    assert scales["transformer.h.0.mlp.c_proj.weight"] == pytest.approx(1.0)
    assert scales["transformer.h.0.attn.c_attn.weight"] == pytest.approx(math.sqrt(3))
    fc = model.transformer.h[0].mlp.c_fc.weight  # [32, 128]: in 32, out 128
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    before = fc.detach().clone()
    ds_muon.Muon(groups, momentum=0.0, nesterov=False, ns_dtype=torch.float32).step()
    want = before - 0.1 * 2.0 * ds_muon.newton_schulz(fc.grad, dtype=torch.float32, method="auto")
    torch.testing.assert_close(fc.detach(), want, rtol=0, atol=1e-6)
    with pytest.raises(NotImplementedError, match="transposed"):
        ds_muon.split_rows(fc, [16, 16])
