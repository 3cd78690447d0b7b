"""Newton–Schulz throughput: ds_muon.newton_schulz vs torch.optim.Muon's own iteration.

Same matrices, same run; one by one and batched (ds_muon stacks same-shape
matrices into one bmm chain).  Prints medians in ms and TFLOP/s, and the ratio
torch / ds_muon (above 1 means ds_muon is faster).
"""

from __future__ import annotations

import argparse

import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

from common import header, median_seconds, table

import ds_muon
from ds_muon.rules.newton_schulz import KELLER, ns_flops

SHAPES = [(768, 768), (768, 3072), (3072, 768), (1024, 4096)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4, help="matrices of each shape")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    header("Newton–Schulz throughput (5 steps, Keller coefficients)")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            G = torch.randn(args.batch, *shape, generator=torch.Generator().manual_seed(0))
            flops = args.batch * ns_flops(*shape, 5)

            def torch_one_by_one():
                for k in range(args.batch):
                    torch_ns(G[k], KELLER, 5, 1e-7)

            def ours_one_by_one():
                for k in range(args.batch):
                    ds_muon.newton_schulz(G[k], 5, "keller", dtype)

            def ours_batched():
                ds_muon.newton_schulz(G, 5, "keller", dtype)

            # torch's iteration always computes in bf16: it has no fp32 counterpart to time
            t_ref = median_seconds(torch_one_by_one, args.repeats, 1) if dtype == torch.bfloat16 else None
            t_one = median_seconds(ours_one_by_one, args.repeats, 1)
            t_bat = median_seconds(ours_batched, args.repeats, 1)
            na = "n/a (bf16 only)"
            rows.append([str(dtype).replace("torch.", ""), f"{args.batch}x{shape[0]}x{shape[1]}",
                         t_ref * 1e3 if t_ref else na, t_one * 1e3, t_bat * 1e3, flops / t_bat / 1e12,
                         t_ref / t_one if t_ref else "", t_ref / t_bat if t_ref else ""])
    table(["ns dtype", "matrices", "torch.optim.Muon ms", "ds_muon 1-by-1 ms", "ds_muon batched ms",
           "batched TFLOP/s", "torch/1-by-1", "torch/batched"], rows)


if __name__ == "__main__":
    main()
