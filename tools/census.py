"""The census: every model type the installed transformers builds from a config in code, classified
by ds_muon's rules (:mod:`ds_muon.models.kinds`), tensor by tensor.

For each model type of ``MODEL_MAPPING_NAMES`` (a family added by a future transformers release
enters by itself) the most complete class (causal LM, masked LM, seq2seq, classification, …,
else the base model) is built from its config with few layers and small sizes (on the ``meta``
device: no memory, no time), and :func:`ds_muon.muon_param_groups` classifies every trainable
tensor.  A row reports the kinds, the fused projections split, and what failed: the model does
not build (and why), or ds_muon refuses it (and why).  The census is also a proof: the forward is read
(:mod:`ds_muon.models.trace`, on the meta device) and each tensor's decision is checked against it
(:func:`proof`: the splits the forward performs are the splits made, no input layer or head on Muon),
with how many matrices the trace decided and how many the fallback rules did.  ``--step N`` also builds N seeded
families for real and runs one single-process step from random gradients (finite or not).

    python tools/census.py [--only llama,gpt2] [--step 6] [--markdown docs/CENSUS.md]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import random
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

CLASS_ORDER = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
               "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
               "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
               "MODEL_FOR_CTC_MAPPING_NAMES", "MODEL_MAPPING_NAMES")
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_encoder_layers", "num_decoder_layers",
              "encoder_layers", "decoder_layers", "num_blocks")
TINY = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 256, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "max_position_embeddings": 128}


@dataclass
class Row:
    family: str
    cls: str = ""
    built: bool = False
    error: str = ""  # why it did not build, or why ds_muon refused it
    refused: bool = False
    kinds: Dict[str, int] = field(default_factory=collections.Counter)
    muon: int = 0
    tensors: int = 0
    fused: List[str] = field(default_factory=list)
    step: str = ""  # "finite", "not finite: …", "skipped: …", "" (not stepped)
    tiny: bool = False  # built from the small-width config (else from the default one)
    by_trace: int = 0  # matrices (2+ dims) decided from the traced forward
    by_fallback: int = 0  # matrices decided by the config/module/name rules alone
    trace_error: str = ""  # why the forward could not be read ("" where it was)
    trace_ms: float = 0.0
    forward_splits: int = 0  # Muon matrices whose output the forward splits into blocks
    splits_made: int = 0  # of those, split by ds_muon into the same blocks
    disagreements: List[str] = field(default_factory=list)  # the decision against what the forward does


def families() -> List[str]:
    from transformers.models.auto import modeling_auto

    return sorted(modeling_auto.MODEL_MAPPING_NAMES)


def model_class(model_type: str):
    import transformers
    from transformers.models.auto import modeling_auto

    for mapping in CLASS_ORDER:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        if isinstance(name, (list, tuple)):
            name = name[0]
        if name and hasattr(transformers, name):
            return getattr(transformers, name)
    return None


def _shrink(config, tiny: bool, depth: int = 0):
    """Few layers (and, ``tiny``, small widths) everywhere in the config tree."""
    for k, v in list(vars(config).items()):
        if isinstance(v, bool):
            continue
        if k in LAYER_KEYS and isinstance(v, int) and v > 2:
            setattr(config, k, 2)
        elif tiny and k in TINY and isinstance(v, int) and v > TINY[k]:
            setattr(config, k, TINY[k])
        elif hasattr(v, "to_dict") and hasattr(v, "model_type") and depth < 3:
            _shrink(v, tiny, depth + 1)
    vocab = getattr(config, "vocab_size", None)
    for k in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if tiny and isinstance(vocab, int) and isinstance(getattr(config, k, None), int) and getattr(config, k) >= vocab:
            setattr(config, k, 0)
    if tiny and getattr(config, "hidden_size", None) == TINY["hidden_size"]:
        nh = getattr(config, "num_attention_heads", None)
        if isinstance(nh, int) and TINY["hidden_size"] % nh == 0 and hasattr(config, "head_dim"):
            config.head_dim = TINY["hidden_size"] // nh
    return config


def build(model_type: str, tiny: bool, device: str = "meta"):
    from transformers import AutoConfig

    cls = model_class(model_type)
    if cls is None:
        raise LookupError("no model class")
    config = _shrink(AutoConfig.for_model(model_type), tiny)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device(device):
            return cls(config)


def classify_family(model_type: str, read: bool = True) -> Row:
    import ds_muon

    row = Row(model_type)
    model = None
    for tiny in (True, False):
        try:
            model = build(model_type, tiny)
            row.tiny = tiny
            break
        except Exception as e:  # noqa: BLE001 - a census reports every failure
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    if model is None:
        return row
    row.built, row.error, row.cls = True, "", type(model).__name__
    return classify_model(row, model, read=read)


def classify_model(row: Row, model, example_inputs=None, read: bool = True) -> Row:
    """Read ``model``'s forward, build its groups from that reading, and check one against the other
    (``read=False``: the rules alone, no proof)."""
    import ds_muon
    from ds_muon.models.trace import Trace, trace

    row.built, row.cls = True, row.cls or type(model).__name__
    traced = trace(model, example_inputs) if read else Trace(error="not read (sampled out)")
    row.trace_error, row.trace_ms = traced.error, traced.ms
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            groups = ds_muon.muon_param_groups(model, trace=traced if read else False)
    except Exception as e:  # noqa: BLE001
        row.refused, row.error = True, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return row
    if read:
        proof(row, model, groups, traced)
    for g in groups:
        for name, kind, reason, p in zip(g["param_names"], g["param_kinds"], g["param_reasons"], g["params"]):
            row.kinds[kind] += 1
            row.tensors += 1
            row.muon += bool(g["use_muon"])
            if kind == "fused block" or ", " in reason and "apart" in reason:
                what = reason.split(", ")[1].replace(" apart", "").replace("|", "/").split(" (")[0]
                row.fused.append(f"{name.rsplit('.', 2)[-2]}:{what}")
    row.fused = sorted(set(row.fused))
    return row


def proof(row: Row, model, groups, traced) -> None:
    """The traced truth against the decision, tensor by tensor: every Muon matrix whose output the forward
    splits is split into exactly those blocks (and none the forward does not split), every matrix the
    forward reads the input with or makes the output with is on AdamW; who decided each matrix."""
    from ds_muon.engine.exchange.tag_keys import BLOCKS, SPLIT_ROWS
    from ds_muon.models.kinds import _RULES_OF

    rules = _RULES_OF.get(model)
    if rules is not None:
        row.disagreements.extend(rules.disagreements)
    for g in groups:
        for name, p, reason in zip(g["param_names"], g["params"], g["param_reasons"]):
            if p.ndim < 2:
                continue
            if "not traced" in reason:
                row.by_fallback += 1
            else:
                row.by_trace += 1
            use = traced.uses.get(name)
            if use is None or not use.matrix:
                continue
            if g["use_muon"] and (use.head or (use.input_layer and "conv" in use.ops)):
                row.disagreements.append(f"{name}: on Muon, but the forward {'makes the output' if use.head else 'reads the input'}")
            if not g["use_muon"] or "conv" in use.ops:
                continue
            split = getattr(p, SPLIT_ROWS, None) is not None or getattr(p, BLOCKS, None) is not None
            if use.blocks:
                row.forward_splits += 1
                if split and _blocks_equal(p, use):
                    row.splits_made += 1
                else:
                    row.disagreements.append(f"{name}: the forward splits it in {len(use.blocks)} blocks, "
                                             f"ds_muon {'otherwise' if split else 'not'}")
            elif split and not use.experts and not use.unread:
                row.disagreements.append(f"{name}: split by ds_muon, not by the forward")


def _blocks_equal(p, use) -> bool:
    """Whether the blocks ds_muon tagged on ``p`` (per expert) split its outputs as the forward does."""
    from ds_muon.engine.exchange.tag_keys import BLOCKS, SPLIT_ROWS, TRANSPOSED

    def run(spec):
        start, length, count, period = spec
        return [start + i * period + j for i in range(count) for j in range(length)]

    in_out = bool(getattr(p, TRANSPOSED, False))
    sets = set()
    split = getattr(p, SPLIT_ROWS, None)
    if split is not None:
        r = 0
        for _, n in split:
            sets.add(tuple(range(r, r + n)))
            r += n
    for _, rows, cols in getattr(p, BLOCKS, None) or ():
        sets.add(tuple(sorted(run(cols if in_out else rows))))
    return sets == {tuple(b) for b in use.blocks}


def step_family(model_type: str) -> str:
    """Build the family for real (tiny) and run one step from seeded random gradients."""
    import ds_muon

    model = build(model_type, True, device="cpu")
    if sum(p.numel() for p in model.parameters()) > 20_000_000:
        return "skipped: too large"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model), ns_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt.step()
    bad = [n for n, p in model.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
    still = [n for n, p in model.named_parameters() if p.requires_grad and torch.equal(p, before[n])]
    if bad:
        return f"not finite: {bad[:3]}"
    if still:
        return f"unchanged: {still[:3]}"
    return "finite"


def census(only: Optional[List[str]] = None, step: int = 0, seed: int = 0, read: Optional[int] = None,
           must_read=()) -> List[Row]:
    """Every family classified; the forward read (and the decision proven against it) for all of them, or
    for ``read`` seeded ones and ``must_read`` (the bounded CI run)."""
    names = only or families()
    chosen = set(names) if read is None else set(random.Random(seed).sample(names, min(read, len(names))))
    chosen |= set(must_read)
    rows = [classify_family(f, read=f in chosen) for f in names]
    if step:
        fine = [r for r in rows if r.built and not r.refused]
        for r in random.Random(seed).sample(fine, min(step, len(fine))):
            if not r.tiny:
                r.step = "skipped: builds only at its default (large) widths"
                continue
            try:
                r.step = step_family(r.family)
            except Exception as e:  # noqa: BLE001
                r.step = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    return rows


def table(rows: List[Row]) -> str:
    """The census as a markdown table, totals first."""
    built = [r for r in rows if r.built]
    ok = [r for r in built if not r.refused]
    tensors = sum(r.tensors for r in ok)
    kinds = collections.Counter()
    for r in ok:
        kinds.update(r.kinds)
    import transformers

    lines = ["# Census: every transformers model type, classified by ds_muon", "",
             f"`python tools/census.py --step 6 --markdown docs/CENSUS.md` (transformers {transformers.__version__}). "
             "Each model type is built from its config with 2 layers and small widths; every trainable tensor gets "
             "a kind from the README's rules table; `fused split` lists what was split apart; `decided by trace / "
             "by fallback` counts the family's matrices decided from its forward, read on the meta device "
             "(`ds_muon.models.trace`), and those the config/module/name rules decided alone (with why the forward "
             "could not be read); `forward splits / made` counts the Muon matrices whose output the forward splits "
             "into blocks and those ds_muon splits into the same blocks (the proof: equal, and no disagreement "
             "listed); `read (ms)` is what reading the forward took; `step` is one single-process step from random "
             "gradients on a seeded sample.", "",
             f"transformers model types: {len(rows)}; build from a config in code: {len(built)}; classified "
             f"with no unknown kind: {len(ok)}/{len(built)} ({100 * len(ok) / max(1, len(built)):.0f}%), "
             f"{tensors} tensors; with fused projections split: {sum(1 for r in ok if r.fused)}; "
             f"refused by ds_muon: {len(built) - len(ok)}.", "",
             f"Read from the forward (meta device, `ds_muon.models.trace`): {sum(1 for r in ok if not r.trace_error)}"
             f"/{len(ok)} families; matrices decided by the trace: {sum(r.by_trace for r in ok)}, by the fallback "
             f"rules (config, module types, names): {sum(r.by_fallback for r in ok)}; fused splits the forward "
             f"performs: {sum(r.forward_splits for r in ok)}, made by ds_muon alike: {sum(r.splits_made for r in ok)}; "
             f"disagreements between the traced forward and the decision: "
             f"{sum(len(r.disagreements) for r in ok)}. {_reading_cost(ok)}", "",
             "| kind | tensors |", "| --- | --- |"]
    lines += [f"| {k} | {n} |" for k, n in kinds.most_common()]
    lines += ["", "| family | class | tensors | Muon | kinds | fused split | decided by trace / by fallback | "
              "forward splits / made | read (ms) | step |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.built and not r.refused:
            ks = ", ".join(f"{k} {n}" for k, n in sorted(r.kinds.items()))
            by = f"{r.by_trace} / {r.by_fallback}" + (f" ({r.trace_error.split(':')[0]})" if r.trace_error else "")
            lines.append(f"| {r.family} | {r.cls} | {r.tensors} | {r.muon} | {ks} | {'; '.join(r.fused)} | {by} | "
                         f"{r.forward_splits} / {r.splits_made} | {r.trace_ms:.0f} | {r.step} |")
    dis = [(r.family, d) for r in ok for d in r.disagreements]
    if dis:
        lines += ["", "| family | disagreement |", "| --- | --- |"] + [f"| {f} | {d} |" for f, d in dis]
    lines += ["", "| family | refused or not built: why |", "| --- | --- |"]
    for r in rows:
        if not r.built or r.refused:
            lines.append(f"| {r.family} | {'refused: ' if r.refused else 'does not build: '}{r.error.replace('|', '/')} |")
    return "\n".join(lines)


def _reading_cost(ok: List[Row]) -> str:
    ms = sorted(r.trace_ms for r in ok if not r.trace_error)
    if not ms:
        return ""
    slow = max((r for r in ok if not r.trace_error), key=lambda r: r.trace_ms)
    return (f"Reading one forward on the meta device: median {ms[len(ms) // 2]:.0f} ms, 90th percentile "
            f"{ms[int(0.9 * len(ms))]:.0f} ms, slowest {ms[-1]:.0f} ms ({slow.family}).")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--step", type=int, default=0, help="step this many seeded families for real")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--read", type=int, default=None, help="read the forward of this many seeded families "
                    "(default: all)")
    ap.add_argument("--markdown", help="write the table to this file")
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = census(args.only.split(",") if args.only else None, args.step, args.seed, args.read)
    text = table(rows)
    print(text)
    print(f"\n({time.time() - t0:.0f} s)", file=sys.stderr)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
