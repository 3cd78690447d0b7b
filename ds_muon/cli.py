"""``ds-muon``: run the optimizer's own planner on a model's matrix shapes, at any world size.

    ds-muon plan --preset llama-7b --world-sizes 8 64 512 4096 --plot plan.png
    ds-muon plan --hf-config config.json --layout replicated --json
    ds-muon shapes --hf-config config.json > configs/models/mine.json
    ds-muon plan --summary run.json            # a run's own matrices and holdings (Summary.save)
    ds-muon plan --preset llama-70b --mesh replicate=64,shard=8 dp=64,tp=8 --ranks-per-node 8

No GPUs, no processes: the same :func:`ds_muon.engine.plan.planner.plan_homes` the optimizer
calls, fed with shapes and with what each rank would hold, next to the baselines
of :mod:`ds_muon.engine.plan.costs`.  From Python, :func:`shapes_from_module` reads a live
model and :func:`plan_rows` returns the table.

(Over 400 lines: one door for three commands (``plan``, ``shapes``, ``convert``), each flag checked with an
error that names it and what to do, and the readers of the plan's inputs (a preset, a HF config.json, a shapes
file, a live model); the work itself is elsewhere: the planner and its costs in :mod:`ds_muon.engine.plan`,
the conversion in :mod:`ds_muon.conversion`.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import List, Optional, Sequence, Tuple

from .engine.plan import costs, mesh_costs
from .engine.plan.cost_model import EXCHANGES, CostModel, ranks_per_node_from_env

MAX_WORLD_SIZE = 65536  # llama-7b's table at 65536 ranks: ~25 s and ~0.7 GB here; beyond, the planner's inputs outgrow memory
MAX_NS_STEPS = 100


def _bounded(kind, name: str, low, high=None, strict: bool = False):
    """An argparse ``type``: a finite ``kind`` in [low, high] ((low, high] if ``strict``), else a clear error."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        ok = v == v and v not in (float("inf"), float("-inf")) and (v > low if strict else v >= low)
        if ok and high is not None:
            ok = v <= high
        if not ok:
            span = f"{'>' if strict else '>='} {low}" + (f" and <= {high}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"{name} must be a finite {'integer' if kind is int else 'number'} "
                                             f"{span}, got {text!r}")
        return v
    return parse


class UsageError(Exception):
    """A bad argument: :func:`main` prints the one line (naming the argument and the fix) and exits 2."""


class _Parser(argparse.ArgumentParser):
    """argparse's errors as one line (no usage block), pointing to ``--help``."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = " ".join(str(e).split())
    return text[:400] if isinstance(e, (ValueError, UsageError)) and text else \
        (f"{type(e).__name__}: {text[:400]}" if text else type(e).__name__)


@contextlib.contextmanager
def _about(flag: str, value, fix: str):
    """Whatever fails inside becomes one :class:`UsageError` line: ``flag value: why; fix``."""
    try:
        yield
    except UsageError:
        raise
    except Exception as e:
        why = _one_line(e)
        if why.startswith(flag + " "):  # the message names the argument and the fix already
            raise UsageError(why) from None
        shown = f" {os.fspath(value)!r}" if value is not None and os.fspath(value) not in why else ""
        raise UsageError(f"{flag}{shown}: {why}; {fix}") from None


def _writable_target(path: str) -> None:
    """OSError unless ``path`` can be written: its folder exists and is writable, and ``path`` is not an
    existing folder's parent's unwritable child."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise FileNotFoundError(2, f"its folder {parent} does not exist")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise PermissionError(13, f"{path} is not writable")
    if not os.path.exists(path) and not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(13, f"its folder {parent} is not writable")


def _mesh_spec(text: str) -> str:
    """An argparse ``type`` for ``--mesh``: a spec :func:`ds_muon.engine.plan.mesh_costs.parse_mesh` reads, of at most
    :data:`MAX_WORLD_SIZE` ranks."""
    try:
        _, outer, inner = mesh_costs.parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if outer * inner > MAX_WORLD_SIZE:
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: {outer * inner} ranks; at most {MAX_WORLD_SIZE}")
    return text


PRESETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "models")
ALL_STRATEGIES = costs.STRATEGIES
DEFAULT_WORLD_SIZES = [8, 64, 512, 4096]


def shapes_from_hf_config(cfg: dict) -> List[Tuple[str, Tuple[int, int]]]:
    """Hidden matrices of a decoder-only transformer from a Hugging Face config.json."""
    try:
        d = cfg["hidden_size"]
        layers = cfg["num_hidden_layers"]
        heads = cfg["num_attention_heads"]
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}; need hidden_size, num_hidden_layers, "
                         "num_attention_heads (and optionally intermediate_size, num_key_value_heads)") from None
    for key, v in (("hidden_size", d), ("num_hidden_layers", layers), ("num_attention_heads", heads)):
        if not _positive_int(v):
            raise ValueError(f"config.json's {key} is {v!r}; it must be a positive integer")
    ff = cfg.get("intermediate_size", 4 * d)
    kv = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim", d // heads)
    experts = cfg.get("num_local_experts", cfg.get("num_experts", 0)) or 0
    for key, v in (("intermediate_size", ff), ("num_key_value_heads", kv), ("head_dim", head_dim),
                   ("moe_intermediate_size", cfg.get("moe_intermediate_size", ff))):
        if not _positive_int(v):
            raise ValueError(f"config.json's {key} is {v!r}; it must be a positive integer")
    if not (_positive_int(experts) or experts == 0):
        raise ValueError(f"config.json's number of experts is {experts!r}; it must be an integer >= 0")
    if layers * (4 + 3 * max(experts, 1)) > MAX_MATRICES:
        raise ValueError(f"config.json makes {layers * (4 + 3 * max(experts, 1))} matrices; at most {MAX_MATRICES}")
    out = []
    for i in range(layers):
        out += [(f"layers.{i}.q", (heads * head_dim, d)), (f"layers.{i}.k", (kv * head_dim, d)),
                (f"layers.{i}.v", (kv * head_dim, d)), (f"layers.{i}.o", (d, heads * head_dim))]
        mlp_ff = cfg.get("moe_intermediate_size", ff) if experts else ff
        for e in range(max(experts, 1)):
            tag = f"layers.{i}.experts.{e}" if experts else f"layers.{i}.mlp"
            out += [(f"{tag}.gate", (mlp_ff, d)), (f"{tag}.up", (mlp_ff, d)), (f"{tag}.down", (d, mlp_ff))]
    return out


def shapes_from_module(model) -> List[Tuple[str, Tuple[int, int]]]:
    """The Muon matrices of a live ``nn.Module`` (by :func:`ds_muon.muon_param_groups`'s rules: one
    per expert of a fused stack, one per split block)."""
    from .engine.exchange.layout import global_shape, matrix_shape
    from .param_groups import split_params_checked
    from .engine.exchange.slots import logical_blocks

    muon, _ = split_params_checked(model)
    return [(key, matrix_shape(shape)) for name, p in muon for key, shape, _ in logical_blocks(p, name, global_shape(p))]


def load_shapes(preset: Optional[str] = None, hf_config: Optional[str] = None,
                shapes_file: Optional[str] = None) -> List[Tuple[str, Tuple[int, int]]]:
    """Shapes from a preset name (configs/models/NAME.json), a shapes JSON file, or a HF config.json."""
    path = shapes_file
    if preset:
        path = preset if os.path.exists(preset) else os.path.join(PRESETS, f"{preset}.json")
        if not os.path.exists(path):
            names = sorted(f[:-5] for f in os.listdir(PRESETS)) if os.path.isdir(PRESETS) else []
            raise ValueError(f"preset {preset!r} not found; presets: {names}")
    if hf_config:
        return shapes_from_hf_config(_read_json(hf_config))
    data = _read_json(path)
    if "matrices" not in data:  # a HF config saved as a preset
        return shapes_from_hf_config(data)
    matrices = data["matrices"]
    if not isinstance(matrices, list):
        raise ValueError('"matrices" must be a list of {"name": ..., "shape": [rows, cols]}')
    out = []
    for i, m in enumerate(matrices):
        shape = m.get("shape") if isinstance(m, dict) else None
        if not (isinstance(m, dict) and isinstance(m.get("name"), str) and isinstance(shape, list) and len(shape) == 2
                and all(_positive_int(x) for x in shape)):
            raise ValueError(f'matrices[{i}] is {json.dumps(m)[:80]}; each must be {{"name": "...", '
                             '"shape": [rows, cols]}} with positive integer rows and cols')
        out.append((m["name"], tuple(shape)))
    return out


MAX_MATRICES = 10**6  # beyond, the planner's tables outgrow a laptop's memory


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _read_json(path: str) -> dict:
    """A JSON object from ``path``, or ValueError / OSError saying why not."""
    with open(path) as f:
        try:
            data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    return data


def plan_rows(shapes: Sequence[Tuple[str, Tuple[int, int]]], world_sizes: Sequence[int],
              layout: str = "partitioned", strategies: Sequence[str] = ALL_STRATEGIES, ns_steps: int = 5,
              cost_model: Optional[CostModel] = None, elem_bytes: int = 2, transport: bool = False) -> List[dict]:
    """One row per (world size, strategy): balance, bytes, collectives, waves, modelled time."""
    cm = cost_model or CostModel()
    rows = []
    for world in world_sizes:
        tasks = costs.tasks_for([s for _, s in shapes], world, layout, ns_steps, elem_bytes)
        rows.extend(costs.compare(tasks, world, cm, strategies, transport))
    return rows


def plot_rows(rows: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        rs = [r for r in rows if r["strategy"] == strategy]
        ws = [r["world_size"] for r in rs]
        ax_t.plot(ws, [r["modelled_step_ms"] for r in rs], marker="o", label=strategy)
        ax_b.plot(ws, [max(r["max_bytes_sent"], r["max_bytes_received"]) / 2**20 for r in rs], marker="o",
                  label=strategy)
    for ax, title in ((ax_t, "modelled optimizer step (ms)"), (ax_b, "busiest rank's traffic (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mesh_table(shapes, meshes: Sequence[str], cm: CostModel, ns_steps: int = 5) -> List[dict]:
    """Rows of :func:`ds_muon.engine.plan.mesh_costs.mesh_rows` for each mesh spec (``replicate=R,shard=S``, ``dp=D,tp=T``)."""
    return [r for m in meshes for r in mesh_costs.mesh_rows([s for _, s in shapes], m, cm, ns_steps)]


def _print_table(rows: List[dict]) -> None:
    cols = list(dict.fromkeys(c for r in rows for c in r))  # the "team" row adds its own columns
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" for _ in cols) + "|")
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")


def cmd_plan(args) -> int:
    rpn = args.ranks_per_node or ranks_per_node_from_env()
    cm = CostModel(args.tflops * 1e12, args.link_gbps * 1e9 / 8, args.pcie_gbps * 1e9 / 8, args.offload,
                   rpn, args.intra_gbps * 1e9 / 8, exchange=args.exchange or "all_to_all")
    if args.mesh:
        if args.summary:
            print("--mesh takes the shapes of --preset/--hf-config/--shapes, not --summary", file=sys.stderr)
            return 2
        if args.plot:  # a mesh is one point: nothing to draw against world size
            print("--plot draws a sweep over --world-sizes; --mesh plans one mesh: drop --plot (or --mesh)",
                  file=sys.stderr)
            return 2
        shapes = _shapes_of(args)
        rows = mesh_table(shapes, args.mesh, cm, args.ns_steps)
        if args.json:
            json.dump(rows, sys.stdout, indent=1)
            print()
            return 0
        print(f"{len(shapes)} matrices, NS {args.ns_steps} steps, {args.tflops:g} TFLOP/s per rank, "
              + (f"{rpn} ranks per node, {args.intra_gbps:g} Gbit/s inside a node, {args.link_gbps:g} Gbit/s "
                 "across nodes" if rpn else f"one flat {args.link_gbps:g} Gbit/s link (no --ranks-per-node)"))
        _print_table(rows)
        return 0
    rows = []
    if args.summary:  # the run's own world and holdings first, then any --world-sizes by --layout
        from .engine.report.rows import Summary

        with _about("--summary", args.summary, "give the JSON a run wrote with Muon.summary().save(PATH)"):
            run = Summary.load(args.summary)
        shapes = [(m.key, m.shape) for m in run.matrices]
        rows = run.plan_rows(args.strategies, cm)
    else:
        shapes = _shapes_of(args)
        args.world_sizes = args.world_sizes or DEFAULT_WORLD_SIZES
    if args.plot:
        with _about("--plot", args.plot, "give a PNG path in an existing, writable folder"):
            _writable_target(args.plot)
    rows += plan_rows(shapes, args.world_sizes or [], args.layout, args.strategies, args.ns_steps, cm,
                      transport=bool(args.exchange))
    if not rows:
        print("no Muon matrices to plan", file=sys.stderr)
        return 1
    if args.plot:
        with _about("--plot", args.plot, "give a PNG path in an existing, writable folder (and install matplotlib)"):
            plot_rows(rows, args.plot)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    source = f"the run in {args.summary} (its own holdings), then " if args.summary else ""
    print(f"{len(shapes)} matrices, {source}{args.layout} layout, NS {args.ns_steps} steps, "
          f"{args.tflops:g} TFLOP/s per rank, {args.link_gbps:g} Gbit/s per rank"
          + (f", optimizer state offloaded to the host ({args.pcie_gbps:g} Gbit/s host<->device)" if args.offload else ""))
    _print_table(rows)
    return 0


def _shapes_of(args):
    """The shapes of --preset / --hf-config / --shapes, any failure one line naming the flag."""
    for flag, value, fix in (("--preset", args.preset, "give a preset name of configs/models/ or a shapes JSON path"),
                             ("--hf-config", args.hf_config, "give a Hugging Face config.json"),
                             ("--shapes", args.shapes, 'give a JSON {"matrices": [{"name": ..., "shape": [rows, cols]}]}')):
        if value is not None:
            with _about(flag, value, fix):
                return load_shapes(args.preset, args.hf_config, args.shapes)
    raise UsageError("give one of --preset, --hf-config, --shapes")


def cmd_shapes(args) -> int:
    with _about("--hf-config", args.hf_config, "give a Hugging Face config.json"):
        shapes = load_shapes(hf_config=args.hf_config)
        cfg = {k: v for k, v in _read_json(args.hf_config).items() if not k.startswith("_")}
    lines = [json.dumps({"name": n, "shape": list(s)}) for n, s in shapes]
    print('{"source": ' + json.dumps(args.description or cfg) + ',\n "matrices": [\n  ' + ",\n  ".join(lines) + "\n]}")
    return 0


def cmd_convert(args) -> int:
    """Each argument checked (and each phase's failure named by its argument) before the next is used;
    DST is checked before anything is read, so a bad one costs nothing."""
    from .conversion.arguments import load_factory, resolve_config, settings_from
    from .conversion.read import read
    from .conversion.regroup import build
    from .conversion.write import check_target, write
    from .setup.build import build_optimizer

    with _about("--set", " ".join(args.set or []), "give KEY=VALUE pairs of muon_param_groups / Muon settings"):
        settings = settings_from(args.set or []) or None
    config = None
    if args.config is not None:
        with _about("--config", args.config, "give the DeepSpeed JSON file the run resumes with"):
            config, settings = resolve_config(args.config, settings)
    with _about("SRC", args.src, "give a DeepSpeed checkpoint folder (ZeRO or universal), a DCP folder or a torch file"):
        if not os.path.exists(args.src):
            raise FileNotFoundError(2, "no such file or folder")
    with _about("DST", args.dst, "give a path in an existing, writable folder"):
        _writable_target(args.dst)
        check_target(args.to, os.path.abspath(args.dst))
    with _about("--model", None, "give MODULE:CALLABLE that builds the model on the CPU"):
        model = load_factory(args.model)
    flag = "--set" if args.set or args.config is None else "--config"
    with _about(flag, " ".join(args.set or []) if flag == "--set" else args.config,
                "give settings of muon_param_groups / Muon (lr=0.02 adam_lr=3e-4 ...; README.md lists them)"):
        build_optimizer(model, dict({"log_summary": False}, **(settings or {})))  # the groups, before any read
    with _about("SRC", args.src, f"give a checkpoint of --source {args.source} (docs/CHECKPOINTS.md lists them)"):
        named = read(args.src, args.source, trust_checkpoint=args.trust_checkpoint)
    with _about("SRC", args.src, "give the checkpoint of the model --model builds, with the settings of its "
                                 "groups in --set or --config (or --fresh)"):
        muon = build(model, named, settings, fresh=args.fresh)
    with _about("DST", args.dst, "give a path in an existing, writable folder (and --config / --set of these "
                                 "groups)"):
        out = write(args.to, model, muon, args.dst, config, settings)
    print(json.dumps({"converted": os.fspath(args.src), "to": args.to, "out": os.fspath(out)}))
    return 0


def main(argv=None) -> int:
    ap = _Parser(prog="ds-muon", description="ds_muon tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="run the home planner on a model's shapes at given world sizes")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="configs/models/NAME.json (e.g. gpt-125m, llama-7b, llama-70b, moe-64e) or a path")
    src.add_argument("--hf-config", help="a Hugging Face config.json")
    src.add_argument("--shapes", help='JSON: {"matrices": [{"name": ..., "shape": [rows, cols]}, ...]}')
    src.add_argument("--summary", help="JSON of a run's Muon.summary().save(PATH): its matrices, at its world size "
                                       "with what each rank held (and at --world-sizes if given)")
    p.add_argument("--world-sizes", type=_bounded(int, "--world-sizes", 1, MAX_WORLD_SIZE), nargs="+", help=f"default {DEFAULT_WORLD_SIZES} (none with --summary)")
    p.add_argument("--layout", choices=["replicated", "partitioned"], default="partitioned",
                   help="replicated: DDP; partitioned: ZeRO-1/2 or FSDP1 flat shards")
    p.add_argument("--strategies", nargs="+", choices=ALL_STRATEGIES + costs.OPTIONAL, default=list(ALL_STRATEGIES),
                   help="default: all ('auto' is the optimizer's default planner='auto')")
    p.add_argument("--ns-steps", type=_bounded(int, "--ns-steps", 1, MAX_NS_STEPS), default=5)
    p.add_argument("--tflops", type=_bounded(float, "--tflops", 0, strict=True), default=400.0, help="NS matmul TFLOP/s per rank (default: H100/H200-like bf16)")
    p.add_argument("--link-gbps", type=_bounded(float, "--link-gbps", 0, strict=True), default=400.0, help="all_to_all Gbit/s per rank (default: 400, one NIC)")
    p.add_argument("--offload", action="store_true",
                   help="optimizer state in host memory (ZeRO-Offload, FSDP2 CPUOffloadPolicy): add each rank's "
                        "host<->device copies of its pieces and results (column max_host_bytes)")
    p.add_argument("--pcie-gbps", type=_bounded(float, "--pcie-gbps", 0, strict=True), default=400.0,
                   help="host<->device Gbit/s per rank under --offload (default: 400, PCIe Gen5 x16 in practice)")
    p.add_argument("--mesh", nargs="+", metavar="SPEC", type=_mesh_spec,
                   help="model a 2-D mesh instead of --world-sizes: replicate=R,shard=S (HSDP) or dp=D,tp=T "
                        "(FSDP x tensor parallel); rows per strategy with NS per rank and bytes inside/across nodes")
    p.add_argument("--ranks-per-node", type=_bounded(int, "--ranks-per-node", 1, MAX_WORLD_SIZE),
                   help="ranks per node for the intra/inter-node cost model (default: $LOCAL_WORLD_SIZE, else one flat link)")
    p.add_argument("--intra-gbps", type=_bounded(float, "--intra-gbps", 0, strict=True), default=3200.0,
                   help="Gbit/s per rank inside a node (default 3200: NVLink-class, 400 GB/s)")
    p.add_argument("--exchange", choices=list(EXCHANGES),
                   help="add the columns max_peers and transport: the exchange's transport under CostModel(exchange=...) "
                        "(auto: all_to_all or batched p2p by modelled per-peer latency)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", help="write a PNG of modelled step time and traffic against world size")
    p.set_defaults(fn=cmd_plan)
    s = sub.add_parser("shapes", help="print the Muon matrix shapes of a HF config.json as a preset JSON")
    s.add_argument("--hf-config", required=True)
    s.add_argument("--description", help="what the preset is (stored as its source)")
    s.set_defaults(fn=cmd_shapes)
    c = sub.add_parser("convert", help="move optimizer state between DeepSpeed ZeRO/universal, DCP and torch "
                                       "checkpoints by tensor name, in ds_muon's groups (docs/CHECKPOINTS.md)")
    c.add_argument("src", help="a DeepSpeed checkpoint folder (ZeRO or universal), a DCP folder or a torch file")
    c.add_argument("dst", help="the folder (universal, dcp) or file (torch) to write")
    c.add_argument("--model", required=True, help="MODULE:CALLABLE building the model on the CPU (ds_muon's groups "
                                                  "come from muon_param_groups of it)")
    c.add_argument("--to", choices=["universal", "dcp", "torch"], default="universal",
                   help="universal: DeepSpeed ZeRO-1/2/3 at any world size (load_universal); dcp: FSDP2 at any "
                        "world size; torch: one file {model, optim}")
    c.add_argument("--source", choices=["auto", "deepspeed", "universal", "dcp", "torch"], default="auto")
    c.add_argument("--config", help="the DeepSpeed JSON the run resumes with (its DsMuon params set the groups)")
    c.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="muon_param_groups / Muon settings (lr=0.02 ...)")
    c.add_argument("--fresh", action="store_true",
                   help="start at zero the state of tensors the source stepped with the other algorithm")
    c.add_argument("--trust-checkpoint", action="store_true",
                   help="unpickle SRC's files fully (they may run code): only for a checkpoint you trust; by default "
                        "every file is read as data (weights-only) and one holding anything else is refused")
    c.set_defaults(fn=cmd_convert)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (UsageError, ValueError, OSError) as e:  # a bad argument: one line naming it, not a traceback
        ap.exit(2, f"ds-muon {args.cmd}: error: {_one_line(e)}\n")
    except Exception as e:  # a fault of the tool itself: still one line; the traceback on request
        if os.environ.get("DS_MUON_TRACEBACK"):
            raise
        ap.exit(2, f"ds-muon {args.cmd}: error: unexpected {_one_line(e)} (a bug in ds-muon? "
                   "DS_MUON_TRACEBACK=1 shows the traceback)\n")


if __name__ == "__main__":
    sys.exit(main())
