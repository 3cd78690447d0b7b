"""Every runnable snippet in README.md and docs/*.md runs verbatim on CPU.

The convention (also in docs/ARCHITECTURE.md): a fenced block whose info string is exactly ``python`` is
runnable: it runs as written, from the repository root, in a fresh namespace, on CPU, in one process. A
block that cannot run alone (a fragment that uses names defined elsewhere, a multi-process launch, an
import of a package that is not installed) is fenced ```` ```python fragment ````; shell lines are
```` ```bash ````, configs ```` ```json ````, tables and output plain ```` ``` ````, none of them run.
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
            if m.group(1).strip() == "python":
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
