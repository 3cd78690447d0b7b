"""What each weight decay mode costs: the apply of one result (``ds_muon.rules.update.apply_result``)
and a whole one-process Muon step, per mode, against decoupled decay.

One process, one thread.  Modes run interleaved (decoupled, independent, cautious, none, decoupled,
...) on the same tensors, and each row reports the median over repeats of the ratio to the decoupled
run taken next to it, in wall time and in process CPU time (the machine is shared; CPU time swings
less).  Cautious decay reads the weight and the result once more (their product, the decayed copy,
the select): the apply is memory-bound, so it costs a few passes over the piece; the step, where NS
dominates, barely moves.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from common import header, table

import ds_muon
from ds_muon.rules.decay import decay_of
from ds_muon.rules.update import apply_result

MODES = ("decoupled", "independent", "cautious", "none")


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def apply_rows(shapes, repeats):
    rows = []
    for shape in shapes:
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(shape, generator=g).reshape(-1)]
        results = [torch.randn(shape, generator=g).bfloat16().reshape(-1)]
        decays = {m: None if m == "none" else decay_of(m, 0.02, 0.1) for m in MODES}
        ratios = {m: ([], []) for m in MODES}
        base = {}
        for _ in range(repeats):
            for m in MODES:
                t = _timed(lambda: apply_result(params, results, decays[m], -1e-9, all_flat=True))
                if m == "decoupled":
                    base = t
                else:
                    ratios[m][0].append(t[0] / base[0])
                    ratios[m][1].append(t[1] / max(base[1], 1e-9))
        ms = statistics.median(_timed(lambda: apply_result(params, results, decays["decoupled"], -1e-9, all_flat=True))[0]
                               for _ in range(repeats)) * 1e3
        rows.append([f"{shape[0]}x{shape[1]}", ms] + [statistics.median(ratios[m][k]) for m in MODES[1:] for k in (0, 1)])
    return rows


def step_rows(dim, layers, repeats):
    torch.manual_seed(0)
    models, opts = {}, {}
    for m in MODES:
        models[m] = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
        mode, wd = ("decoupled", 0.0) if m == "none" else (m, 0.1)
        opts[m] = ds_muon.Muon(ds_muon.muon_param_groups(models[m], weight_decay=wd, adam_weight_decay=wd),
                               weight_decay_mode=mode, ns_dtype=torch.bfloat16, log_summary=False)
    x = torch.randn(8, dim)
    for m in MODES:  # grads once; the step reads them, never clears them here
        models[m](x).square().mean().backward()
        opts[m].step()
    ratios = {m: ([], []) for m in MODES}
    base_ms = []
    for _ in range(repeats):
        base = None
        for m in MODES:
            t = _timed(opts[m].step)
            if m == "decoupled":
                base = t
                base_ms.append(t[0] * 1e3)
            else:
                ratios[m][0].append(t[0] / base[0])
                ratios[m][1].append(t[1] / max(base[1], 1e-9))
    return [[f"{layers} x Linear({dim}, {dim})", statistics.median(base_ms)]
            + [statistics.median(ratios[m][k]) for m in MODES[1:] for k in (0, 1)]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    header("weight decay modes: cost against decoupled decay (one process, one thread)")
    cols = ["decoupled ms"] + [f"{m} / decoupled ({k})" for m in MODES[1:] for k in ("wall", "cpu")]
    print("apply_result of one fp32 piece with a bf16 result:")
    table(["piece"] + cols, apply_rows([(512, 512), (1024, 1024), (2048, 2048)], args.repeats))
    print("Muon.step (bf16 NS), the same gradients each step:")
    table(["model"] + cols, step_rows(256, 6, max(5, args.repeats // 3)))


if __name__ == "__main__":
    main()
