"""Does exploiting the symmetry of X·Xᵀ and A·A pay on this hardware?

torch has no batched SYRK/SYMM, so the only way to skip the redundant half of a
symmetric product from Python is blocking: with X = [X1; X2], compute X1·X1ᵀ,
X1·X2ᵀ and X2·X2ᵀ (3/4 of the FLOPs) and mirror the off-diagonal block.  This
times that against the plain product for the NS shapes, in both dtypes, one
thread (as a rank runs), and prints the ratio; ds_muon keeps only what wins.
"""

from __future__ import annotations

import argparse

import torch

from common import header, median_seconds, table


def plain(X):
    return torch.bmm(X, X.mT)


def blocked(X):
    h = X.size(1) // 2
    X1, X2 = X[:, :h], X[:, h:]
    top = torch.cat([torch.bmm(X1, X1.mT), torch.bmm(X1, X2.mT)], dim=2)
    bottom_right = torch.bmm(X2, X2.mT)
    bottom = torch.cat([top[:, :, h:].mT, bottom_right], dim=2)
    return torch.cat([top, bottom], dim=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    header("Symmetric products by blocking vs plain bmm (X·Xᵀ for X of m×n, and A·A for A = X·Xᵀ), 1 thread")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for m, n in [(512, 2048), (768, 3072), (1024, 1024)]:
            X = torch.randn(4, m, n).to(dtype)
            A = plain(X)
            assert torch.allclose(blocked(X).float(), A.float(), rtol=1e-2, atol=1e-1)
            t_p = median_seconds(lambda: plain(X), args.repeats, 1)
            t_b = median_seconds(lambda: blocked(X), args.repeats, 1)
            t_pa = median_seconds(lambda: plain(A), args.repeats, 1)
            t_ba = median_seconds(lambda: blocked(A), args.repeats, 1)
            rows.append([str(dtype).replace("torch.", ""), f"4x{m}x{n}", t_p * 1e3, t_b * 1e3, t_b / t_p,
                         t_pa * 1e3, t_ba * 1e3, t_ba / t_pa])
    table(["dtype", "X", "X·Xᵀ plain ms", "X·Xᵀ blocked ms", "blocked/plain", "A·A plain ms", "A·A blocked ms",
           "blocked/plain"], rows)
    print("blocked/plain below 1 means the symmetric version wins (3/4 of the FLOPs is the ideal 0.75).")


if __name__ == "__main__":
    main()
