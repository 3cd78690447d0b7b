"""``ds-muon``: run the optimizer's own planner on a model's matrix shapes, at any world size.

    ds-muon plan --hf-config config.json --world-sizes 8 64 512
    ds-muon plan --shapes shapes.json --layout partitioned --json

No GPUs, no processes: the same :func:`ds_muon.planner.plan_homes` the optimizer
calls, fed with shapes and with what each rank would hold.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Sequence, Tuple

from .planner import STRATEGIES, CostModel, MatrixTask, plan_homes


def shapes_from_hf_config(cfg: dict) -> List[Tuple[str, Tuple[int, int]]]:
    """Hidden matrices of a decoder-only transformer from a Hugging Face config.json."""
    try:
        d = cfg["hidden_size"]
        layers = cfg["num_hidden_layers"]
        heads = cfg["num_attention_heads"]
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}; need hidden_size, num_hidden_layers, "
                         "num_attention_heads (and optionally intermediate_size, num_key_value_heads)") from None
    ff = cfg.get("intermediate_size", 4 * d)
    kv = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim", d // heads)
    experts = cfg.get("num_local_experts", cfg.get("num_experts", 0)) or 0
    out = []
    for i in range(layers):
        out += [(f"layers.{i}.q", (heads * head_dim, d)), (f"layers.{i}.k", (kv * head_dim, d)),
                (f"layers.{i}.v", (kv * head_dim, d)), (f"layers.{i}.o", (d, heads * head_dim))]
        mlp_ff = cfg.get("moe_intermediate_size", ff) if experts else ff
        for e in range(max(experts, 1)):
            tag = f"layers.{i}.experts.{e}" if experts else f"layers.{i}.mlp"
            out += [(f"{tag}.gate", (mlp_ff, d)), (f"{tag}.up", (mlp_ff, d)), (f"{tag}.down", (d, mlp_ff))]
    return out


def tasks_for(shapes: Sequence[Tuple[str, Tuple[int, int]]], world: int, layout: str, steps: int,
              elem_bytes: int) -> List[MatrixTask]:
    """MatrixTasks with holdings of a replicated (DDP) or flat-partitioned (ZeRO/FSDP1) layout."""
    if layout == "replicated":
        return [MatrixTask(r, c, steps, elem_bytes, (r * c,) * world) for _, (r, c) in shapes]
    total = sum(r * c for _, (r, c) in shapes)
    bounds = [(total * k // world, total * (k + 1) // world) for k in range(world)]
    tasks, pos = [], 0
    for _, (r, c) in shapes:
        n = r * c
        held = tuple(max(0, min(hi, pos + n) - max(lo, pos)) for lo, hi in bounds)
        tasks.append(MatrixTask(r, c, steps, elem_bytes, held))
        pos += n
    return tasks


def cmd_plan(args) -> int:
    if args.hf_config:
        with open(args.hf_config) as f:
            shapes = shapes_from_hf_config(json.load(f))
    else:
        with open(args.shapes) as f:
            shapes = [(m["name"], tuple(m["shape"])) for m in json.load(f)["matrices"]]
    cm = CostModel(args.tflops * 1e12, args.link_gbps * 1e9 / 8)
    rows = []
    for world in args.world_sizes:
        tasks = tasks_for(shapes, world, args.layout, args.ns_steps, 2)
        for strategy in args.strategies:
            plan = plan_homes(tasks, world, strategy, cm)
            sent = plan.bytes_sent
            rows.append({
                "world_size": world, "strategy": strategy, "matrices": len(tasks),
                "waves": -(-len(tasks) // world),
                "ns_max_over_mean": round(plan.imbalance, 4),
                "ns_max_over_bound": round(plan.imbalance_vs_bound, 4),
                "max_bytes_sent_per_rank": max(sent), "total_bytes_sent": sum(sent),
                "collectives_per_step": 2,
                "modelled_step_ms": round(max(plan.step_time()) * 1e3, 4),
            })
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    cols = list(rows[0].keys())
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ds-muon", description="ds_muon tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="run the home planner on a model's shapes at given world sizes")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-config", help="a Hugging Face config.json")
    src.add_argument("--shapes", help='JSON: {"matrices": [{"name": ..., "shape": [rows, cols]}, ...]}')
    p.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--layout", choices=["replicated", "partitioned"], default="partitioned")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--ns-steps", type=int, default=5)
    p.add_argument("--tflops", type=float, default=400.0, help="NS matmul TFLOP/s per rank (H100/H200-like bf16)")
    p.add_argument("--link-gbps", type=float, default=400.0, help="all_to_all bandwidth per rank in Gbit/s")
    p.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    return cmd_plan(args)


if __name__ == "__main__":
    sys.exit(main())
