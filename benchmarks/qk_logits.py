"""What recording S_max per head costs: a Llama forward + backward with and without LogitRecorder.

One process, one model per row (GQA Llama from a config: d=256, 4 layers, 8 query heads over 4 key/value
heads of 32, SiLU MLP of 688, vocab 1024), causal-LM loss on random tokens with a padded row. Each round
times ``--iters`` iterations without the recorder and ``--iters`` with it, in alternating order (A B, B A,
…), wall (perf_counter) and process CPU time (process_time) side by side; the table gives each side's
median and the median over rounds of the per-round ratio on/off. The recorder is removed and installed
again between the two halves of a round (``remove()`` / ``LogitRecorder(model)``: a config switch).
"in recorder" is the time spent inside the recording itself (its ``_record``, timed around each call),
a direct reading of the added work that does not depend on two noisy totals. One thread by default
(``--threads``), so that process CPU time is work, not spinning, on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import header, table

from ds_muon.models.attention_logits import LogitRecorder


def _model(impl: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation(impl)
    return model


def _batch(batch: int, seq: int, padded: bool):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (batch, seq), generator=g)
    if not padded:
        return ids, None  # SDPA then gets no mask and runs is_causal (the recorder too: causal blocks)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, : seq // 4] = 0  # one left-padded row: the mask is materialized, as in padded training
    return ids, mask


def _iterate(model, ids, mask, iters: int, backward: bool):
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        if backward:
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        else:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
    return (time.perf_counter() - w0) / iters, (time.process_time() - c0) / iters


def measure(impl: str, padded: bool, batch: int, seq: int, rounds: int, iters: int, backward: bool):
    model = _model(impl)
    ids, mask = _batch(batch, seq, padded)
    _iterate(model, ids, mask, 3, backward)  # warm-up, both ways (the first iterations run several times slower)
    recorder = LogitRecorder(model)
    _iterate(model, ids, mask, 2, backward)
    recorder.remove()
    off, on, inside = [], [], []
    for r in range(rounds):
        for recording in ((False, True) if r % 2 == 0 else (True, False)):
            if recording:
                recorder = LogitRecorder(model)
                spent = [0.0, 0.0]
                record = recorder._record

                def timed(*a, record=record, spent=spent):
                    w0, c0 = time.perf_counter(), time.process_time()
                    record(*a)
                    spent[0] += time.perf_counter() - w0
                    spent[1] += time.process_time() - c0

                recorder._record = timed  # the instance attribute is what the wrapper calls
                on.append(_iterate(model, ids, mask, iters, backward))
                inside.append((spent[0] / iters, spent[1] / iters))
                recorder.remove()
            else:
                off.append(_iterate(model, ids, mask, iters, backward))
    wall = statistics.median(b[0] / a[0] for a, b in zip(off, on))
    cpu = statistics.median(b[1] / a[1] for a, b in zip(off, on))
    med = lambda xs, i: statistics.median(x[i] for x in xs) * 1e3  # noqa: E731
    share = statistics.median(i[1] / a[1] for i, a in zip(inside, off))
    return [impl, "padded" if padded else "none", f"{batch} x {seq}", "fwd+bwd" if backward else "fwd (no_grad)",
            med(off, 0), med(on, 0), wall, med(off, 1), med(on, 1), cpu, med(inside, 1), share]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--shapes", default="2x256,1x512", help="batch x seq, comma-separated")
    ap.add_argument("--impls", default="sdpa,sdpa:none,eager",
                    help="attention implementations; ':none' = no padding, no mask passed")
    ap.add_argument("--forward-only", action="store_true", help="also time no_grad forwards")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    header("LogitRecorder cost: GQA Llama d=256 x 4 layers (8 q / 4 kv heads of 32), one process")
    rows = []
    for shape in args.shapes.split(","):
        batch, seq = (int(x) for x in shape.lower().split("x"))
        for spec in args.impls.split(","):
            impl, _, masking = spec.partition(":")
            modes = (True, False) if args.forward_only else (True,)
            for backward in modes:
                rows.append(measure(impl, masking != "none", batch, seq, args.rounds, args.iters, backward))
    table(["attention", "mask", "batch x seq", "timed", "off ms", "on ms", "wall on/off (median of rounds)",
           "off CPU ms", "on CPU ms", "CPU on/off (median of rounds)", "in recorder CPU ms",
           "in recorder / off CPU (median of rounds)"], rows)


if __name__ == "__main__":
    main()
