"""Every runnable snippet in README.md and docs/*.md runs verbatim on CPU.

The convention (also in docs/ARCHITECTURE.md): a fenced block whose info string is exactly ``python`` is
runnable: it runs as written, from the repository root, in a fresh namespace, on CPU, in one process. A
block that cannot run alone (a fragment that uses names defined elsewhere, a multi-process launch, an
import of a package that is not installed) is fenced ```` ```python fragment ````; shell lines are
```` ```bash ````, configs ```` ```json ````, tables and output plain ```` ``` ````, none of them run.
A block fenced ```` ```python torchrun ```` runs that way too, and again as written under
``torchrun --nproc_per_node 2`` on CPU (gloo): the multi-process habit the page shows.  Every
multi-process launch line in a ```` ```bash ```` block (``torchrun ...``, ``accelerate launch ...``) must be
one of :data:`DOC_COMMANDS`, each naming the test that runs it, so a page cannot show a launch no test runs.
All runnable blocks run in one child interpreter (the imports are paid once), each in its own namespace
and its own empty working directory, so files a snippet writes go nowhere.
"""

import glob
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)
RUNNER = r"""
import json, os, sys, tempfile, traceback
sys.path.insert(0, os.environ["REPO"])
snippets = json.load(open(sys.argv[1]))
failed = []
for where, code in snippets:
    cwd = tempfile.mkdtemp()
    for name in ("configs", "examples"):
        os.symlink(os.path.join(os.environ["REPO"], name), os.path.join(cwd, name))
    os.chdir(cwd)
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    except BaseException:
        failed.append((where, traceback.format_exc()))
print(json.dumps(failed))
"""


def pages():
    return [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def runnable_snippets():
    out = []
    for page in pages():
        text = open(page).read()
        for m in FENCE.finditer(text):
            if m.group(1).strip() in ("python", "python torchrun"):
                line = text[:m.start()].count("\n") + 2
                out.append((f"{os.path.relpath(page, REPO)}:{line}", m.group(2)))
    return out


def test_every_python_block_is_runnable_or_marked(tmp_path):
    snippets = runnable_snippets()
    assert len(snippets) >= 3, snippets  # the count run is printed below (pytest -s)
    path = tmp_path / "snippets.json"
    path.write_text(json.dumps(snippets))
    env = dict(os.environ, REPO=REPO, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(path)], env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"ran {len(snippets)} snippets from README.md and docs/*.md: {[w for w, _ in snippets]}")
    assert not failed, "\n\n".join(f"{where}:\n{tb}" for where, tb in failed)


def torchrun_snippets():
    out = []
    for page in pages():
        text = open(page).read()
        for m in FENCE.finditer(text):
            if m.group(1).strip() == "python torchrun":
                out.append((f"{os.path.relpath(page, REPO)}:{text[:m.start()].count(chr(10)) + 2}", m.group(2)))
    return out


# a page's stack table lines, added to its torchrun block's TrainingArguments(...) as the table says
STACK_LINES = {"docs/TRAINER.md": ['deepspeed="configs/deepspeed/zero3.json"']}
EVALUATES = {"docs/TRAINER.md"}  # blocks that evaluate during training: the log must show an eval_loss


def with_stack(code: str, line: str) -> str:
    assert code.count("TrainingArguments(") == 1, "the block builds TrainingArguments(...) once"
    head, _, tail = code.rpartition("TrainingArguments(")
    return f"{head}TrainingArguments({line}, {tail}"


ENDS = ("torch.distributed.destroy_process_group()", "trainer.end()", "accelerator.end_training()")


def test_torchrun_blocks_destroy_their_process_group():
    """A rank that exits with its gloo group up can abort at interpreter shutdown (SIGABRT, "terminate called
    without an active exception": docs/TRAINER.md's block did, 1 of 4 runs of the test below); torch's rule
    is to destroy the group before exit, and a page's multi-process block must show it."""
    for where, code in torchrun_snippets():
        last = [ln.split("#")[0].strip() for ln in code.strip().splitlines()][-1]
        assert last in ENDS, f"{where}: end the block with one of {ENDS}, which destroy the process group"


def test_torchrun_blocks_run_at_two_cpu_processes(tmp_path):
    """docs/TRAINER.md's first block (TrainingArguments as written, evaluation on) under torchrun at W=2 on CPU,
    and with the table's ZeRO-3 line: it failed in gloo's allgather until the page gave use_cpu=... for
    machines without a GPU (and MuonTrainer refuses the run without it)."""
    snippets = torchrun_snippets()
    assert snippets, "no ```python torchrun block: docs/TRAINER.md's first block should be one"
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs = [(where, "as written", code) for where, code in snippets]
    runs += [(where, line, with_stack(code, line)) for where, code in snippets
             for line in STACK_LINES.get(where.split(":")[0], ())]
    assert len(runs) > len(snippets), "docs/TRAINER.md's block also runs with its ZeRO-3 line"
    for k, (where, how, code) in enumerate(runs):
        cwd = tmp_path / f"run{k}"
        cwd.mkdir()
        for name in ("configs", "examples"):
            os.symlink(os.path.join(REPO, name), cwd / name)
        (cwd / "snippet.py").write_text(code)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               "snippet.py"], cwd=cwd, env=env, capture_output=True, text=True, timeout=280)
        assert proc.returncode == 0, f"{where} ({how}) under torchrun --nproc_per_node 2:\n{proc.stderr[-4000:]}"
        if where.split(":")[0] in EVALUATES:
            assert "eval_loss" in proc.stdout + proc.stderr, f"{where} ({how}): no evaluation ran"


# every multi-process launch line of a ```bash block -> the test (file::function[param]) that runs it
DOC_COMMANDS = {
    "accelerate launch --config_file configs/accelerate/fsdp2.yaml train.py":
        "tests/test_examples.py::test_accelerate_fsdp2",
    "accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml train.py":
        "tests/test_examples.py::test_accelerate_deepspeed[2]",
    "accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml train.py":
        "tests/test_examples.py::test_accelerate_deepspeed[3]",
    "torchrun --nproc_per_node 2 examples/hf_trainer.py": "tests/test_examples.py::test_hf_trainer[ddp]",
    "torchrun --nproc_per_node 2 examples/hf_trainer.py --fsdp2": "tests/test_examples.py::test_hf_trainer[fsdp2]",
    "torchrun --nproc_per_node 2 examples/hf_trainer.py --deepspeed configs/deepspeed/zero3.json":
        "tests/test_examples.py::test_hf_trainer[zero3]",
    "torchrun --nproc_per_node 2 examples/peft_lora.py --stack fsdp2 --bf16-base":
        "tests/test_peft.py::test_example_peft_lora_fsdp2_bf16_base",
}
# launch lines no test runs as written yet, each with why (the lead's list to close; a new one fails the test)
UNTESTED = {
    "torchrun --nproc_per_node 2 examples/lightning_train.py --strategy ddp":
        "tests/test_lightning.py runs the example with --strategy deepspeed only",
    "torchrun --nproc_per_node 2 examples/torchtitan_train.py --dp 2 --tp 1":
        "tests/test_torchtitan.py runs the example at --dp 1 --tp 2 only",
    "torchrun --nproc_per_node 4 examples/torchtitan_train.py --dp 2 --tp 2":
        "4 processes: beyond the 2-core CI; tests/test_torchtitan.py runs --dp 1 --tp 2",
}
LAUNCH = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(torchrun|accelerate launch|deepspeed|python -m torch\.distributed\.run)\b")


def launch_lines():
    out = []
    for page in pages():
        text = open(page).read()
        for m in FENCE.finditer(text):
            if m.group(1).strip() in ("bash", "sh", "shell"):
                for line in m.group(2).splitlines():
                    cmd = " ".join(line.split("#")[0].split())
                    if LAUNCH.match(cmd):
                        out.append((os.path.relpath(page, REPO), re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", cmd)))
    return out


def test_every_doc_launch_command_is_run_by_a_test():
    lines = launch_lines()
    assert len(lines) >= 6, lines
    for page, cmd in lines:
        assert cmd in DOC_COMMANDS or cmd in UNTESTED, \
            f"{page}: `{cmd}` is run by no test; add it to DOC_COMMANDS with the test that runs it"
    print("doc launch lines no test runs yet:", UNTESTED)
    for cmd, node in DOC_COMMANDS.items():
        path, _, name = node.partition("::")
        fn, _, param = name.partition("[")
        src = open(os.path.join(REPO, path)).read()
        assert re.search(rf"^def {fn}\(", src, re.M), f"{node} (for `{cmd}`) does not exist"
        if param:
            assert repr(param.rstrip("]")) in src or f'"{param.rstrip("]")}"' in src or param.rstrip("]").isdigit(), node
