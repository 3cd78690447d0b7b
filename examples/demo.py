"""The main job: the GPT of examples/gpt.py trained under FSDP2 on 2 CPU processes,
with ds_muon and with AdamW at the same budget, final eval losses side by side.

``make demo`` runs this.  Each run is ``torchrun --standalone --nproc_per_node 2
examples/train_gpt.py --stack fsdp2 ...``: the model's weights are DTensor shards,
ds_muon plans a home rank for every matrix, gathers with one all_to_all, runs
Newton–Schulz once per matrix and scatters back with one more.  Learning rates
are the tuned ones recorded in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

RUNS = {  # name: extra train_gpt flags (tuned learning rates)
    "ds_muon": ["--optimizer", "ds_muon", "--lr", "0.02", "--adam-lr", "0.003"],
    "AdamW": ["--optimizer", "adamw", "--adam-lr", "0.0015"],
}


def median_step_seconds(path: str) -> float:
    """The median time of one training step in a train_gpt metrics file (``time`` is cumulative): the
    first step (warm-up) and each step right after an evaluation (whose time it includes) left out."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    gaps = [b["time"] - a["time"] for a, b in zip(records, records[1:]) if "eval_loss" not in a]
    return statistics.median(gaps) if gaps else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default="runs/demo")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    print(f"ds_muon demo: byte-level GPT on the Python stdlib's source, FSDP2 on {args.nproc} processes, "
          f"{args.steps} steps per optimizer\n", flush=True)
    results = {}
    for name, flags in RUNS.items():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               os.path.join(HERE, "train_gpt.py"), "--stack", "fsdp2", "--steps", str(args.steps),
               "--eval-every", "50", "--out", args.out, "--run-name", f"fsdp2-{name}", *flags]
        print("$ torchrun", " ".join(cmd[3:]), flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        summary = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not summary:
            print(proc.stdout)
            raise SystemExit(f"{name} run failed (exit code {proc.returncode})")
        results[name] = summary[-1] | {"wall": time.perf_counter() - t0}
    print(f"\n{'optimizer':<10}{'final eval loss':>16}{'train time':>12}")
    for name, r in results.items():
        print(f"{name:<10}{r['final_eval_loss']:>16.4f}{r['seconds']:>11.1f}s")
    steps = {name: median_step_seconds(os.path.join(args.out, f"fsdp2-{name}.jsonl")) for name in RUNS}
    print("\nmedian step (from the metrics files): " + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in steps.items())
          + f"; ds_muon / AdamW {steps['ds_muon'] / steps['AdamW']:.2f}x")
    ratio = results["ds_muon"]["final_eval_loss"] / results["AdamW"]["final_eval_loss"]
    print(f"\nds_muon / AdamW eval loss: {ratio:.3f}; ds_muon's matrices were orthogonalized at home ranks "
          f"{results['ds_muon'].get('muon_home_ranks')}")
    print(f"loss curves: {os.path.abspath(results['ds_muon']['plot'])}")


if __name__ == "__main__":
    main()
