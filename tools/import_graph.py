"""The package's internal import graph, its cycles and its layering: ``python tools/import_graph.py``.

Reads ``ds_muon/`` with :mod:`ast` (nothing is imported), counts imports made at module
level and inside functions alike (a lazy import that closes a cycle is still a cycle),
and prints one line per module with what it imports, then every cycle found, then every
import that crosses the layers the wrong way (:data:`MAY_IMPORT`; an engine stage importing a stage
above it, :data:`STAGES`; a door importing a door, :data:`DOORS`) and every module outside a role's
package, every module over :data:`LONG` lines whose docstring does not say why (:func:`reason_for_length`),
then the floors of the front doors, the longest import chain, the rooms (folders) with their sizes, the line
count of each module, and a last line that sums up the four checks.  Exit status 1 when a cycle, violation,
homeless module or long module without its reason is found.

A module over 400 lines says why in its module docstring: a paragraph that begins ``Over 400 lines``
(or ``(Over 400 lines``) and goes on to give the reason, e.g. ``(Over 400 lines, as one class: every stage
reads the same caches ...)``.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from typing import Dict, List, Optional, Set, Tuple

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ds_muon")

# The roles, bottom up.  A module's role is its package; the top level holds the optimizer's face and the doors.
FACE = {"ds_muon", "ds_muon.optimizer", "ds_muon.param_groups", "ds_muon.qk_clip", "ds_muon.unwrap"}
DOORS = {"ds_muon.deepspeed", "ds_muon.accelerate", "ds_muon.trainer", "ds_muon.cli", "ds_muon.convert",
         "ds_muon.fsdp", "ds_muon.lightning", "ds_muon.torchtitan", "ds_muon.peft"}
FRONT_DOORS = FACE | DOORS
BELOW_FACE = {"integrations", "models", "engine", "rules", "tensors"}
MAY_IMPORT = {
    "tensors": {"tensors"},  # the ground floor: a tensor's shape in the model, its tags
    "rules": {"rules", "tensors"},  # the maths: pure functions of tensors
    "engine": {"engine", "rules", "tensors"},  # where matrices live, the plan, the exchange, the agreement
    "models": {"models", "tensors"},  # what each tensor of a model is: never the engine, never a stack
    "integrations": {"integrations", "engine", "models", "rules", "tensors"},  # one file per stack
    "face": {"face"} | BELOW_FACE,  # Muon, muon_param_groups, QKClip, find_muon
    # what the doors share, so that no door imports another: a Muon built and bound for a stack; conversion
    "setup": {"setup", "face"} | BELOW_FACE,
    "conversion": {"conversion", "setup", "face"} | BELOW_FACE,
    "doors": {"conversion", "setup", "face"} | BELOW_FACE,  # never another door
}
# The engine's stages, bottom up: a stage imports only the stages below it.  ``moved`` (old paths) is a leaf
# under them all; any other module at the engine's top level is the step runtime, above them all.
STAGES = ("moved", "memory", "exchange", "agreement", "plan", "overlap", "report", "runtime")
# A module longer than this says why in its docstring (a paragraph starting "Over 400 lines", see above).
LONG = 400
REASON = re.compile(r"^\(?Over 400 lines\b")
REASON_WORDS = 8  # the paragraph's words after the marker, at least: a reason, not the marker alone


def role_of(module: str):
    """The role of a module: its package under ``ds_muon`` (None: a top-level module that is no front door)."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in MAY_IMPORT and module not in FRONT_DOORS:
        return parts[1]
    return "face" if module in FACE else "doors" if module in DOORS else None


def stage_of(module: str):
    """An engine module's stage (:data:`STAGES`), None outside the engine and for the engine's ``__init__``."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "engine":
        return None
    return parts[2] if parts[2] in STAGES else "runtime"


def layering(graph: Dict[str, Set[str]]):
    """(violations, homeless): imports against :data:`MAY_IMPORT` (a door importing another door among them:
    doors stand side by side, what they share lives below them), an engine stage importing a stage above it
    (:data:`STAGES`), and modules outside any role's package."""
    violations, homeless = [], sorted(m for m in graph if role_of(m) is None)
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            if d == "ds_muon" and m != "ds_muon":
                violations.append((m, d))
            elif role_of(m) and role_of(d) and role_of(d) not in MAY_IMPORT[role_of(m)]:
                violations.append((m, d))
            elif stage_of(m) and stage_of(d) and STAGES.index(stage_of(d)) > STAGES.index(stage_of(m)):
                violations.append((m, d))
    return violations, homeless


def reason_for_length(source: str) -> Optional[str]:
    """The paragraph of a module's docstring that says why it is over :data:`LONG` lines: one that begins
    ``Over 400 lines`` (or ``(Over 400 lines``) and goes on for at least :data:`REASON_WORDS` words; None."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    for para in re.split(r"\n\s*\n", doc):
        para = " ".join(para.split())
        if REASON.match(para) and len(para.split()) - 3 >= REASON_WORDS:
            return para
    return None


def long_without_reason(paths: Dict[str, str], limit: int = LONG) -> List[Tuple[str, int]]:
    """``(module, lines)`` of every module over ``limit`` lines whose docstring does not say why."""
    out = []
    for m, path in sorted(paths.items()):
        with open(path) as f:
            source = f.read()
        lines = source.count("\n") + (0 if source.endswith("\n") or not source else 1)
        if lines > limit and reason_for_length(source) is None:
            out.append((m, lines))
    return out


def room_of(module: str, package: bool = False) -> str:
    """A module's room: its folder (``ds_muon.engine.plan``, ``ds_muon.models``, the top level ``ds_muon``);
    a package's ``__init__`` is in its own folder."""
    return module if package else module.rsplit(".", 1)[0]


def floors(graph: Dict[str, Set[str]]) -> Dict[str, int]:
    """The floor of each module above the packages (the face, what the doors share, the doors): 1 + the highest
    floor among what it imports, the packages (rules, engine, models, integrations) being the ground floor (1).
    An import inside one shared package (``setup/``, ``conversion/``) stays on its floor; at the top level every
    module is a room of its own, so doors importing doors stack up.  The tallest is the house's height."""
    memo: Dict[str, int] = {}

    def above(m: str) -> bool:
        return role_of(m) not in BELOW_FACE | {None} and m != "ds_muon"

    def floor(m: str) -> int:
        if not above(m):
            return 1
        if m not in memo:
            memo[m] = 1  # (a cycle is reported apart)
            memo[m] = max((floor(d) + (0 if room_of(d) == room_of(m) != "ds_muon" else 1) for d in graph[m]),
                          default=2)
        return memo[m]

    return {m: floor(m) for m in graph if above(m)}


def longest_chain(graph: Dict[str, Set[str]]) -> List[str]:
    """The longest chain of imports in the package (module to module, each importing the next)."""
    memo: Dict[str, List[str]] = {}

    def chain(m: str) -> List[str]:
        if m not in memo:
            memo[m] = [m]
            below = [chain(d) for d in sorted(graph[m]) if d != "ds_muon"]
            memo[m] = [m] + max(below, key=len, default=[])
        return memo[m]

    return max((chain(m) for m in sorted(graph)), key=len, default=[])


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
    unexplained = long_without_reason(mods)
    print(f"\nover {LONG} lines without the reason in the docstring: {len(unexplained)}")
    for m, n in unexplained:
        print(f"  {m} ({n} lines)")
    tower = floors(graph)
    top = max(tower.values(), default=0)
    print(f"\nfloors (the face, what the doors share and the doors, over the packages at floor 1): {top}")
    for m in sorted(tower, key=lambda m: (-tower[m], m)):
        print(f"  {tower[m]}  {m}")
    chain = longest_chain(graph)
    print(f"\nlongest import chain: {len(chain)} modules")
    print("  " + " -> ".join(chain))
    rooms: Dict[str, List[str]] = {}
    for m in mods:
        rooms.setdefault(room_of(m, mods[m].endswith("__init__.py")), []).append(m)
    print(f"\nrooms: {len(rooms)} (modules, lines, largest module)")
    for r, ms in sorted(rooms.items()):
        sizes = {m: sum(1 for _ in open(mods[m])) for m in ms}
        big = max(sizes, key=sizes.get)
        print(f"  {r:32s} {len(ms):3d} {sum(sizes.values()):6d}  {big} ({sizes[big]})")
    print("\nlines:")
    for m, p in sorted(mods.items(), key=lambda kv: -sum(1 for _ in open(kv[1]))):
        print(f"  {sum(1 for _ in open(p)):5d}  {m}")
    print(f"\nsummary: {len(found)} cycles, {len(violations)} layering violations, {len(homeless)} modules outside a "
          f"role's package, {len(unexplained)} modules over {LONG} lines without their reason")
    return 1 if found or violations or homeless or unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
