"""What reading a model costs (``muon_param_groups``: the traced forward and the decision), this tree against
another checkout, interleaved: ``python benchmarks/reading_time.py --against ../base [--rounds 3]``.

Each round runs one fresh process per tree (after, before, after, ...), one thread; each process reads every
model once to warm up, then 5 times, and reports the median process CPU time.  The ratio is the median of the
per-round ratios, so the machine's swings between minutes cancel.  Without ``--against`` it prints this
tree's times alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("llama (tiny)", "qwen2_moe (tiny)", "gpt2 (tiny)", "demo GPT", "einsum LM")


def _measure(root: str) -> dict:
    """Run inside one tree (``root`` first on the path): median CPU seconds of 5 reads per model."""
    for sub in ("", "tests", "examples"):
        sys.path.insert(0, os.path.join(root, sub))
    import torch

    torch.set_num_threads(1)
    import ds_muon
    import hf_models
    import map_models
    from gpt import GPT

    builds = {"llama (tiny)": hf_models.tiny_llama, "qwen2_moe (tiny)": hf_models.tiny_qwen2_moe,
              "gpt2 (tiny)": hf_models.tiny_gpt2, "demo GPT": GPT, "einsum LM": lambda: map_models.build("einsum_lm")}
    warnings.simplefilter("ignore")
    out = {}
    for name in MODELS:
        model = builds[name]()
        kw = {"example_inputs": map_models.example_inputs("einsum_lm")} if name == "einsum LM" else {}
        ds_muon.muon_param_groups(model, **kw)
        times = []
        for _ in range(5):
            c0 = time.process_time()
            ds_muon.muon_param_groups(model, **kw)
            times.append(time.process_time() - c0)
        out[name] = statistics.median(times)
    return out


def _run(root: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", root], env=env, check=True,
                          capture_output=True, text=True, cwd=root)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="another checkout of ds_muon (the 'before')")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(_measure(args.measure)))
        return
    trees = {"after": ROOT} | ({"before": os.path.abspath(args.against)} if args.against else {})
    rounds = []
    for _ in range(args.rounds):
        rounds.append({label: _run(root) for label, root in trees.items()})
    cols = ["model"] + [f"{t}, CPU ms" for t in trees] + (["after / before"] if args.against else [])
    print("| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols))
    for name in MODELS:
        row = [name] + [f"{1e3 * statistics.median(r[t][name] for r in rounds):.1f}" for t in trees]
        if args.against:
            row.append(f"{statistics.median(r['after'][name] / r['before'][name] for r in rounds):.2f}")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
