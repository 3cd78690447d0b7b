"""The package's internal import graph, its cycles and its layering: ``python tools/import_graph.py``.

Reads ``ds_muon/`` with :mod:`ast` (nothing is imported), counts imports made at module
level and inside functions alike (a lazy import that closes a cycle is still a cycle),
and prints one line per module with what it imports, then every cycle found, then every
import that crosses the layers the wrong way (:data:`MAY_IMPORT`) and every module outside
a role's package, then the line count of each module.  Exit status 1 when any of those is found.
"""

from __future__ import annotations

import ast
import os
import sys
from typing import Dict, List, Set

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ds_muon")

# The roles, bottom up.  A module's role is its package; the top level holds the front doors only.
FRONT_DOORS = {"ds_muon", "ds_muon.optimizer", "ds_muon.param_groups", "ds_muon.deepspeed", "ds_muon.accelerate",
               "ds_muon.trainer", "ds_muon.cli", "ds_muon.convert", "ds_muon.unwrap", "ds_muon.fsdp",
               "ds_muon.qk_clip", "ds_muon.lightning", "ds_muon.torchtitan", "ds_muon.peft"}
MAY_IMPORT = {
    "rules": {"rules"},  # the maths: pure functions of tensors
    "engine": {"engine", "rules"},  # where matrices live, the plan, the exchange, the agreement
    "models": {"models", "engine"},  # what each tensor of a model is
    "integrations": {"integrations", "engine", "models"},  # one file per stack, describing where pieces live
    # what the front doors share, so no door imports another: a Muon built and bound for a stack; conversion
    # (until the optimizer's face has a role of its own, "front doors" here stands for it)
    "setup": {"setup", "front doors", "integrations", "models", "engine", "rules"},
    "conversion": {"conversion", "setup", "front doors", "integrations", "models", "engine", "rules"},
    "front doors": {"front doors", "conversion", "setup", "integrations", "models", "engine", "rules"},
}


def role_of(module: str):
    """The role of a module: its package under ``ds_muon`` (None: a top-level module that is no front door)."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in MAY_IMPORT:
        return parts[1]
    return "front doors" if module in FRONT_DOORS else None


def layering(graph: Dict[str, Set[str]]):
    """(violations, homeless): imports against :data:`MAY_IMPORT`, and modules outside any role's package."""
    violations, homeless = [], sorted(m for m in graph if role_of(m) is None)
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            if d == "ds_muon" and m != "ds_muon":
                violations.append((m, d))
            elif role_of(m) and role_of(d) and role_of(d) not in MAY_IMPORT[role_of(m)]:
                violations.append((m, d))
    return violations, homeless


def modules() -> Dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def imports_of(name: str, path: str, known: Set[str]) -> Set[str]:
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in known else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in known and m != name}


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    out, seen = [], set()

    def visit(node, stack):
        for nxt in sorted(graph[node]):
            if nxt in stack:
                cyc = stack[stack.index(nxt):]
                key = frozenset(cyc)
                if key not in seen:
                    seen.add(key)
                    out.append(cyc + [nxt])
            elif len(stack) < 12:
                visit(nxt, stack + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    return out


def main() -> int:
    mods = modules()
    known = set(mods)
    graph = {m: imports_of(m, p, known) for m, p in sorted(mods.items())}
    for m, deps in graph.items():
        print(f"{m} -> {', '.join(sorted(deps)) or '-'}")
    found = cycles({m: {d for d in deps if d != "ds_muon"} for m, deps in graph.items()})
    print(f"\ncycles: {len(found)}")
    for c in found:
        print("  " + " -> ".join(c))
    violations, homeless = layering(graph)
    print(f"\nlayering violations: {len(violations)}")
    for m, d in violations:
        print(f"  {m} ({role_of(m)}) -> {d} ({role_of(d)})")
    print(f"\noutside a role's package: {len(homeless)}")
    for m in homeless:
        print(f"  {m}")
    print("\nlines:")
    for m, p in sorted(mods.items(), key=lambda kv: -sum(1 for _ in open(kv[1]))):
        print(f"  {sum(1 for _ in open(p)):5d}  {m}")
    return 1 if found or violations or homeless else 0


if __name__ == "__main__":
    sys.exit(main())
