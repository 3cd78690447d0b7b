"""Loss parity on a real model, with a noise control.

The same training run three ways:
  1. ds_muon sharded under FSDP2 at W=2 (torchrun, 2 processes),
  2. ds_muon in a single process on the same global batches,
  3. the single-process run again with only the data-order seed changed.
(3) measures run-to-run noise; the gap between (1) and (2) must sit inside it.
Writes the three curves into one plot and prints the largest gaps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def eval_curve(path):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--out", default="runs/loss_parity")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train_gpt.py flags")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = ["--steps", str(args.steps), "--eval-every", str(args.eval_every), "--out", args.out, *args.extra]
    train = os.path.join(HERE, "train_gpt.py")
    runs = {
        "sharded-fsdp2-w2": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             train, "--stack", "fsdp2", *common],
        "single": [sys.executable, train, "--stack", "single", *common],
        "single-other-data-seed": [sys.executable, train, "--stack", "single", "--data-seed", "1", *common],
    }
    for name, cmd in runs.items():
        print(f"running {name} ...", flush=True)
        subprocess.run(cmd + ["--run-name", name], env=env, check=True, stdout=subprocess.DEVNULL)
    curves = {name: eval_curve(os.path.join(args.out, f"{name}.jsonl")) for name in runs}
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    shard, single, other = (curves[n] for n in runs)
    gap = max(abs(shard[s] - single[s]) for s in steps)
    noise = max(abs(other[s] - single[s]) for s in steps)
    from train_gpt import plot

    png = plot(args.out)
    print(f"\n{'step':>6}{'sharded':>10}{'single':>10}{'other seed':>12}")
    for s in steps:
        print(f"{s:>6}{shard[s]:>10.4f}{single[s]:>10.4f}{other[s]:>12.4f}")
    verdict = "inside" if gap <= noise else "OUTSIDE"
    print(f"\nlargest |sharded - single| eval-loss gap: {gap:.4f}; noise band (data seed): {noise:.4f} -> {verdict}")
    print(f"plot: {os.path.abspath(png)}")
    print(json.dumps({"gap": gap, "noise": noise, "inside": gap <= noise, "plot": png}))
    return 0 if gap <= noise else 1


if __name__ == "__main__":
    sys.exit(main())
