"""Does a matrix get the same NS bits whichever stack it is in?  Counted at each thread count (issue 51).

Draws small stacks (2-6 matrices, sides 2-40 × 2-120, bf16 and fp32, standard and Gram) and compares each run
of consecutive matrices, each matrix cloned alone and each chunking with the whole stack, bit for bit.  A
sharded step stacks a matrix with other neighbours, at another offset, than one process does, so this is the
bitwise promise's footing at the kernel level.

    python benchmarks/ns_neighbours.py [--draws 60] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import random

import torch

from common import header, table

from ds_muon.rules.newton_schulz import newton_schulz


def count(draws: int, threads: int):
    torch.set_num_threads(threads)
    rng = random.Random(0)
    torch.manual_seed(0)
    total = differ = 0
    for _ in range(draws):
        b, m, n = rng.randint(2, 6), rng.randint(2, 40), rng.randint(2, 120)
        for dt in (torch.float32, torch.bfloat16):
            for method in ("standard", "gram"):
                G = torch.randn(b, m, n)
                whole = newton_schulz(G, dtype=dt, method=method)
                pairs = [(newton_schulz(G[i:j], dtype=dt, method=method), whole[i:j])
                         for i in range(b) for j in range(i + 1, b + 1)]
                pairs += [(newton_schulz(G[i].clone(), dtype=dt, method=method), whole[i]) for i in range(b)]
                pairs += [(newton_schulz(G, dtype=dt, method=method, max_chunk=c), whole) for c in (1, 2, 3)]
                total += len(pairs)
                differ += sum(not torch.equal(a, w) for a, w in pairs)
    return total, differ


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=60)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    header("NS bits of a matrix in any stack, at any offset")
    rows = []
    for t in args.threads:
        total, differ = count(args.draws, t)
        rows.append((t, total, differ))
    table(["threads", "comparisons", "differ"], rows)


if __name__ == "__main__":
    main()
