"""Newton–Schulz rounding error per method and dtype, against the same iteration in float64.

Each method is compared with itself run in float64 (same coefficients, same
polynomial), so the number is rounding error only: ``‖X_dtype − X_f64‖ / ‖X_f64‖``,
median over a few random gradient-like matrices per shape.  DeepSpeed 0.19.8's
Gram Newton–Schulz runs in fp16 (its ``ns_compute_dtype("gram")``); its own code is
timed in fp16 here too (forced, since its CPU accelerator may fall back to fp32).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from common import header, table  # noqa: E402

from ds_muon.rules.newton_schulz import compiled_newton_schulz, compute_dtype, newton_schulz  # noqa: E402

SHAPES = [(256, 1024), (128, 768), (384, 384), (1536, 512)]


def _deepspeed_gram(G: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    try:
        from deepspeed.runtime.zero.muon import original_muon
    except ImportError:
        return None
    saved = original_muon.ns_compute_dtype
    original_muon.ns_compute_dtype = lambda method="gram": dtype
    try:
        gram = original_muon.zeropower_via_gram_newtonschulz  # wrapped in torch.compile: run it eagerly
        return getattr(gram, "_torchdynamo_orig_callable", gram)(G, steps=5)
    finally:
        original_muon.ns_compute_dtype = saved


def _error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="skip the compile=True rows")
    args = ap.parse_args()
    torch.set_num_threads(1)
    header("Newton–Schulz rounding error vs float64 (5 Keller steps), median relative Frobenius error")
    variants = [("ds_muon standard", "standard", torch.bfloat16), ("ds_muon standard", "standard", torch.float16),
                ("ds_muon standard", "standard", torch.float32),
                ("ds_muon gram", "gram", torch.bfloat16), ("ds_muon gram", "gram", torch.float16),
                ("ds_muon gram", "gram", torch.float32), ("DeepSpeed gram", None, torch.float16)]
    if not args.no_compile:
        variants += [("ds_muon standard, compile=True", "compiled", torch.bfloat16),
                     ("ds_muon standard, compile=True", "compiled", torch.float32)]
    rows = []
    for shape in SHAPES:
        gen = torch.Generator().manual_seed(0)
        mats = [torch.randn(shape, generator=gen) * torch.logspace(0, -2, shape[1]) for _ in range(args.samples)]
        for name, method, dtype in variants:
            errs = []
            for G in mats:
                if method is None:
                    x, ref = _deepspeed_gram(G, dtype), _deepspeed_gram(G.double(), torch.float64)
                    if x is None:
                        break
                elif method == "compiled":
                    x = compiled_newton_schulz()(G, 5, "keller", dtype)
                    ref = newton_schulz(G.double(), 5, "keller", torch.float64)
                else:
                    x = newton_schulz(G, 5, "keller", dtype, method=method)
                    ref = newton_schulz(G.double(), 5, "keller", torch.float64, method=method)
                errs.append(_error(x, ref))
            if errs:
                runs_in = dtype if method in (None, "compiled") else compute_dtype(method, dtype)
                rows.append([f"{shape[0]}x{shape[1]}", name, str(dtype).replace("torch.", ""),
                             str(runs_in).replace("torch.", ""), f"{statistics.median(errs):.2e}"])
    table(["shape", "method", "ns_dtype", "iterates in", "rel. error"], rows)


if __name__ == "__main__":
    main()
