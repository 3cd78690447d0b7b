"""One process, one device: ds_muon.Muon's step() against torch.optim.Muon's on the same matrices.

The matrices of a transformer block stack (``--layers`` × (d², d², 4d·d, d·4d)), fp32
parameters with fresh gradients each step, bf16 NS, 5 Keller steps for both.  The two
optimizers step alternately (A, B, A, B, …) and the figure is the median of each pair's
ratio; time is synchronized wall time (on a GPU the device's), with process CPU time
beside it (on a GPU: the host's work to queue the step).  ``--device cuda`` on a GPU;
the CPU default is for trying the script.

    python benchmarks/gpu_step.py --device cuda [--d 2048] [--layers 4] [--steps 12]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import header, table

import ds_muon
from ds_muon.rules.newton_schulz import ns_flops


def shapes(d: int, layers: int):
    return [s for _ in range(layers) for s in ((d, d), (d, d), (4 * d, d), (d, 4 * d))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--d", type=int, default=None, help="model width (default 2048 on cuda, 256 on cpu)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_step.py --device cuda: no CUDA device here")
    dev = torch.device(args.device)
    d = args.d or (2048 if dev.type == "cuda" else 256)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    header(f"step() on one {dev.type} device: ds_muon.Muon vs torch.optim.Muon, {args.layers} blocks of width {d}, "
           "bf16 NS, 5 Keller steps, interleaved")
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) * 0.02 for s in shapes(d, args.layers)]
    grads = [[torch.randn(s, generator=g).to(dev) for s in shapes(d, args.layers)] for _ in range(2)]
    runs = {}
    for name in ("ds_muon", "torch.optim.Muon"):
        ps = [torch.nn.Parameter(t.clone().to(dev)) for t in init]
        opt = (ds_muon.Muon(ps, lr=0.02, log_summary=False) if name == "ds_muon"
               else torch.optim.Muon(ps, lr=0.02))
        runs[name] = (ps, opt)
    rec = {k: [] for k in runs}
    for s in range(args.warmup + args.steps):
        for name, (ps, opt) in runs.items():
            for p, gr in zip(ps, grads[s % 2]):
                p.grad = gr
            sync()
            w, c = time.perf_counter(), time.process_time()
            opt.step()
            sync()
            if s >= args.warmup:
                rec[name].append((time.perf_counter() - w, time.process_time() - c))
    flops = sum(ns_flops(r, c, 5) for r, c in shapes(d, args.layers))
    rows = []
    for name, times in rec.items():
        wall = statistics.median(t for t, _ in times)
        rows.append([name, wall * 1e3, statistics.median(c for _, c in times) * 1e3, flops / wall / 1e12])
    ratio = statistics.median(b[0] / a[0] for a, b in zip(rec["ds_muon"], rec["torch.optim.Muon"]))
    table(["optimizer", "step ms", "step CPU ms", "NS TFLOP/s (step-bound)"], rows)
    print(f"torch.optim.Muon step / ds_muon step: {ratio:.2f} (median of {args.steps} interleaved pairs; "
          "above 1: ds_muon faster)")


if __name__ == "__main__":
    main()
