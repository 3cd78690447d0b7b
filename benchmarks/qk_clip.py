"""What QK-clip adds to ``Muon.step()``: one process, one thread, a transformers Llama.

Three optimizers on three copies of the model, stepped interleaved (A, B, C, A, B, C, …) on the same
batches: A without QK-clip, B with a ``tau`` no head reaches (the check and the reduce only: no arithmetic),
C with a ``tau`` every head exceeds (every q/k row scaled every step, the worst case).  Only ``step()`` is
timed (forward and backward are not: recording the maxima is the recorder's cost, measured apart); the
ratios are medians of per-repeat ratios, in wall and in process CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import header, table

import ds_muon


def build(d: int, layers: int, heads: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=256)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    header(f"QK-clip step cost: Llama d={args.d}, {args.layers} layers, {args.heads} heads, one thread")
    runs = {}
    for label, tau in (("A: no QK-clip", None), ("B: tau above every head", 1e9), ("C: every head clipped", 1e-9)):
        model = build(args.d, args.layers, args.heads)
        clip = ds_muon.QKClip(model, tau=tau) if tau is not None else None
        runs[label] = (model, ds_muon.Muon(ds_muon.muon_param_groups(model), qk_clip=clip, ns_dtype=torch.float32,
                                           log_summary=False), clip)
    gen = torch.Generator().manual_seed(0)
    wall = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    for r in range(args.repeats + 1):
        idx = torch.randint(0, 256, (4, 64), generator=gen)
        for label, (model, opt, _) in runs.items():
            model(input_ids=idx, labels=idx).loss.backward()
            t0, c0 = time.perf_counter(), time.process_time()
            opt.step()
            t1, c1 = time.perf_counter(), time.process_time()
            opt.zero_grad(set_to_none=True)
            if r:  # the first is warm-up
                wall[label].append(t1 - t0)
                cpu[label].append(c1 - c0)
    base = "A: no QK-clip"
    rows = []
    for label in runs:
        rw = statistics.median(a / b for a, b in zip(wall[label], wall[base]))
        rc = statistics.median(a / b for a, b in zip(cpu[label], cpu[base]))
        clip = runs[label][2]
        rows.append((label, statistics.median(wall[label]) * 1e3, statistics.median(cpu[label]) * 1e3, rw, rc,
                     "" if clip is None else clip.clipped_heads))
    table(("run", "step ms (wall)", "step ms (CPU)", "x A (wall)", "x A (CPU)", "heads clipped last step"), rows)


if __name__ == "__main__":
    main()
