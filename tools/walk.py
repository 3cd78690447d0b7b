"""The walk of ``model`` through ``muon_param_groups``, read statically: ``python tools/walk.py``.

How far a reader travels to see what happens to a model: issue 43's measure ("stays, rooms, climbs back
up, returns to a room already left").  Like ``tools/import_graph.py`` (whose module discovery, roles and
layering it reuses) it reads ``ds_muon/`` with :mod:`ast` and imports nothing of it.

The definition (the default; ``--every-call`` and ``--reread`` are variants, below):

- The reader starts in ``muon_param_groups`` of ``ds_muon/param_groups.py``, following its parameter ``model``.
- A function's body is read in source order: statement by statement; within a statement the calls in
  evaluation order as far as the syntax tree gives it (a call after the calls in its callee and arguments,
  an assignment's value before its targets, otherwise the tree's field order).  The bodies of nested
  ``def``/``class``/``lambda`` are not read where they stand (they run later, if ever).
- A call is followed when a followed name is one of its arguments *directly* (``f(model)``,
  ``f(x, model=model)``, ``f(*model)``, ``f(**model)``; not ``f(g(model))``, where only ``g`` is followed)
  or its receiver (``model.foo()``), and its callee resolves to a function of ``ds_muon``: a name defined
  in the module; a name imported (at module level or lazily inside the function, relative or absolute,
  ``as`` included, re-exports through ``__init__`` files and ``name = other`` aliases followed); an
  attribute of an imported module (``kinds.classify``); a class (then its ``__init__``, its own or a
  ``ds_muon`` base's); inside a class, ``self.m(...)``, ``cls.m(...)`` and ``super().m(...)``; ``x.m(...)``
  where the text gives ``x``'s class (``x = Rules(...)``, a parameter ``x: Rules``).  A parameter or local
  variable hides a module name of the same spelling.  Anything else (torch, builtins, methods of other
  objects) is not followed: ``model.foo()`` never resolves.
- In the callee the followed name is the parameter that received the model, by position or keyword
  (``self``/``cls`` skipped for methods and classes); into ``*args``/``**kwargs`` that name is followed.
  A starred argument (``*model``, ``**model``) may fill any parameter from its place on: all of them are
  followed.  In a body, a pure alias ``m = model`` (the value a followed name) is followed from there
  on; nothing else is (not ``inner = unwrap_model(model)``, not ``for`` targets).  A followed name stays
  followed for the whole body even where it is rebound (``model = unwrap_model(model)`` is still the model
  to a reader).
- Each function is read once: a call to a function already read is not entered again.
- The reader's location is the module.  Entering a callee in another module starts a new *stay*, and so
  does returning from it to the caller's module.  *stays*: the maximal runs of reading in one module;
  *rooms*: the distinct modules visited; *returns to a room already left*: stays in a module visited
  before (stays - rooms); *climbs back up*: calls (entries, not returns) into a module on a higher floor.
  A module's floor is its role's place in ``import_graph.MAY_IMPORT``, which lists the roles bottom up
  (tensors 0, rules 1, engine 2, models 3, integrations 4, the face 5, setup 6, conversion 7, doors 8);
  a module with no role has no floor and no climb into or out of it is counted.
  *entered k times*: calls into the module from another module.

Since a call needs an import and imports follow the layers, a call into a higher floor is a layering
violation (a lazy import upward, say): a layered tree has no climbs by this count.  The report also says
how often the reader *rises* a floor, returns included (coming back up from ``models/`` into
``integrations/fsdp1.py``, say): the count issue 43's "15 climbs back up" matches best (its "fsdp1 entered
4 times from below" are four such returns).

Variants, for comparing with numbers measured another way: ``--every-call`` follows every call that
resolves, whether or not the model is passed; ``--derived`` follows what is made from the model too (a
call with a followed name anywhere in an argument, ``f(unwrap_model(model))``, ``f(p)``; any name bound
from an expression mentioning one: assignments, ``for``/``with``/comprehension targets); ``--reread``
enters a function again at every followed call (not while it is being read: no recursion).  ``--root DIR``
reads another checkout (DIR holds ``ds_muon/``, e.g. ``git archive <rev> ds_muon | tar -x -C DIR``);
``--json`` prints the walk for machines.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import import_graph  # noqa: E402  (tools/ is not a package)

START = ("ds_muon.param_groups", "muon_param_groups", "model")
# A role's floor: its place in MAY_IMPORT, which lists the roles bottom up.
FLOORS = {role: i for i, role in enumerate(import_graph.MAY_IMPORT)}
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def floor_of(module: str) -> Optional[int]:
    return FLOORS.get(import_graph.role_of(module))


def discover(root: str) -> Dict[str, str]:
    """``module name -> path`` of every module under ``root/ds_muon`` (import_graph's discovery)."""
    package = os.path.join(os.path.abspath(root), "ds_muon")
    if not os.path.isdir(package):
        raise SystemExit(f"walk.py: --root {root!r} holds no ds_muon/ folder (give a checkout's root)")
    saved, import_graph.ROOT = import_graph.ROOT, package
    try:
        return import_graph.modules()
    finally:
        import_graph.ROOT = saved


class Function:
    """A function or method the reader can enter: its module, its qualified name, its node and its class."""

    def __init__(self, module: "Module", qualname: str, node: ast.AST, cls: Optional["Class"] = None):
        self.module, self.qualname, self.node, self.cls = module, qualname, node, cls
        self.key = (module.name, qualname)
        self._imports: Optional[Dict[str, Tuple[str, Optional[str]]]] = None
        self._locals: Optional[Set[str]] = None
        self._instances: Optional[Dict[str, "Class"]] = None

    def bound(self, call_through_instance: bool) -> bool:
        """Whether the first parameter is filled by the call itself (``self``; ``cls`` of a classmethod)."""
        if self.cls is None:
            return False
        decorators = {d.id for d in self.node.decorator_list if isinstance(d, ast.Name)}
        if "staticmethod" in decorators:
            return False
        return call_through_instance or "classmethod" in decorators

    def imports(self) -> Dict[str, Tuple[str, Optional[str]]]:
        """Names imported lazily inside the function (outside nested definitions)."""
        if self._imports is None:
            self._imports = {}
            for node in _own_nodes(self.node.body):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    self._imports.update(self.module.bindings(node))
        return self._imports

    def locals(self) -> Set[str]:
        """Parameters and names assigned in the body: they hide the module's names of the same spelling."""
        if self._locals is None:
            a = self.node.args
            params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p is not None]
            self._locals = {p.arg for p in params} | {
                n.id for n in _own_nodes(self.node.body) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        return self._locals

    def instances(self, program: "Program") -> Dict[str, "Class"]:
        """Local names whose ``ds_muon`` class is known from the text: a parameter annotated with it
        (``rules: Rules``, ``Optional[Rules]``) or a name assigned from a call of it (``rules = Rules(...)``,
        either branch of ``a if c else Rules(...)``)."""
        if self._instances is None:
            self._instances = {}
            a = self.node.args
            for p in a.posonlyargs + a.args + a.kwonlyargs:
                if p.annotation is not None:
                    cls = self._class_in(program, p.annotation)
                    if cls is not None:
                        self._instances[p.arg] = cls
            for n in _own_nodes(self.node.body):
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                    values = [n.value.body, n.value.orelse] if isinstance(n.value, ast.IfExp) else [n.value]
                    for v in values:
                        if isinstance(v, ast.Call):
                            cls = program.resolve_expr(v.func, self.module, self)
                            if isinstance(cls, Class):
                                self._instances[n.targets[0].id] = cls
        return self._instances

    def _class_in(self, program: "Program", annotation: ast.AST) -> Optional["Class"]:
        if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, (ast.Name, ast.Attribute)):
            names = getattr(annotation.value, "id", getattr(annotation.value, "attr", ""))
            if names == "Optional":
                annotation = annotation.slice
        found = program.resolve_expr(annotation, self.module, None)
        return found if isinstance(found, Class) else None


class Class:
    def __init__(self, module: "Module", node: ast.ClassDef):
        self.module, self.node, self.name = module, node, node.name
        self.methods = {n.name: Function(module, f"{node.name}.{n.name}", n, self) for n in node.body
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def bases(self, program: "Program") -> List["Class"]:
        out = []
        for b in self.node.bases:
            found = program.resolve_expr(b, self.module, None)
            if isinstance(found, Class):
                out.append(found)
        return out

    def method(self, program: "Program", name: str, seen=None) -> Optional[Function]:
        """``name`` in this class or its ``ds_muon`` bases (depth first, in order: Python's MRO for simple trees)."""
        if name in self.methods:
            return self.methods[name]
        seen = seen if seen is not None else set()
        if id(self) in seen:
            return None
        seen.add(id(self))
        for base in self.bases(program):
            found = base.method(program, name, seen)
            if found is not None:
                return found
        return None


class Module:
    def __init__(self, name: str, path: str):
        self.name, self.path = name, path
        self.is_package = path.endswith("__init__.py")
        self.tree = ast.parse(open(path).read(), path)
        self.functions: Dict[str, Function] = {}
        self.classes: Dict[str, Class] = {}
        self.imports: Dict[str, Tuple[str, Optional[str]]] = {}
        self.aliases: Dict[str, str] = {}
        for node in self.tree.body:
            self._top(node)

    def _top(self, node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.functions[node.name] = Function(self, node.name, node)
        elif isinstance(node, ast.ClassDef):
            self.classes[node.name] = Class(self, node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            self.imports.update(self.bindings(node))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    self.aliases[t.id] = node.value.id
        elif isinstance(node, (ast.If, ast.Try)):  # imports under `if TYPE_CHECKING:` / `try:` still bind
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    self._top(child)
            for handler in getattr(node, "handlers", []):
                for child in handler.body:
                    self._top(child)

    def bindings(self, node) -> Dict[str, Tuple[str, Optional[str]]]:
        """What an import binds: ``local name -> (module, attribute or None for the module itself)``."""
        out = {}
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = (a.name, None)
                else:
                    head = a.name.split(".")[0]
                    out[head] = (head, None)
            return out
        package = self.name if self.is_package else self.name.rsplit(".", 1)[0]
        if node.level:
            base = package.split(".")
            base = base[:len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for a in node.names:
            if a.name != "*":
                out[a.asname or a.name] = (target, a.name)
        return out


def _own_nodes(body: Sequence[ast.AST]) -> Iterator[ast.AST]:
    """Every node of a body outside nested definitions."""
    stack = list(body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def events(node: ast.AST) -> Iterator[tuple]:
    """``("call", Call)`` and ``("bind", targets, value, kind)`` in reading order (see the module docstring)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
        return
    if isinstance(node, ast.Call):
        yield from events(node.func)
        for a in node.args:
            yield from events(a)
        for k in node.keywords:
            yield from events(k.value)
        yield "call", node
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
        if node.value is not None:
            yield from events(node.value)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            yield from events(t)
        if node.value is not None:
            yield "bind", targets, node.value, "augassign" if isinstance(node, ast.AugAssign) else "assign"
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        yield from events(node.iter)
        yield "bind", [node.target], node.iter, "loop"
        for child in ast.iter_child_nodes(node):
            if child is not node.iter and child is not node.target:
                yield from events(child)
    elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
        for g in node.generators:  # evaluated before the element
            yield from events(g)
        for child in ([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]):
            yield from events(child)
    elif isinstance(node, ast.withitem):
        yield from events(node.context_expr)
        if node.optional_vars is not None:
            yield "bind", [node.optional_vars], node.context_expr, "with"
    else:
        for child in ast.iter_child_nodes(node):
            yield from events(child)


def mentions(node: ast.AST, followed: Set[str]) -> bool:
    """Whether a followed name occurs anywhere in an expression (the ``--derived`` variant's test)."""
    return any(isinstance(n, ast.Name) and n.id in followed for n in ast.walk(node))


def bound_names(targets: Sequence[ast.AST]) -> Set[str]:
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


class Program:
    """The modules of one checkout and how a name in one of them resolves."""

    def __init__(self, root: str):
        self.paths = discover(root)
        self.modules: Dict[str, Module] = {}

    def module(self, name: str) -> Optional[Module]:
        if name not in self.modules and name in self.paths:
            self.modules[name] = Module(name, self.paths[name])
        return self.modules.get(name)

    def lookup(self, module_name: str, attr: str, seen=None):
        """``module.attr``: a Function, a Class, a module name (str) or None, through imports and re-exports."""
        seen = seen if seen is not None else set()
        if (module_name, attr) in seen:
            return None
        seen.add((module_name, attr))
        mod = self.module(module_name)
        if mod is None:
            return None
        if attr in mod.functions:
            return mod.functions[attr]
        if attr in mod.classes:
            return mod.classes[attr]
        if attr in mod.imports:
            return self.imported(*mod.imports[attr], seen=seen)
        if attr in mod.aliases:
            return self.lookup(module_name, mod.aliases[attr], seen)
        sub = f"{module_name}.{attr}"
        return sub if sub in self.paths else None

    def imported(self, target: str, attr: Optional[str], seen=None):
        if attr is None:
            return target if target in self.paths else None
        if f"{target}.{attr}" in self.paths:
            return f"{target}.{attr}"
        return self.lookup(target, attr, seen)

    def resolve_expr(self, node: ast.AST, module: Module, function: Optional[Function]):
        """What an expression names: a Function, a Class, a module name, or None (not ``ds_muon``'s)."""
        if isinstance(node, ast.Name):
            if function is not None and node.id in function.imports():
                return self.imported(*function.imports()[node.id])
            if function is not None and node.id in function.locals():
                return None  # a parameter or local variable, not the module's name
            return self.lookup(module.name, node.id)
        if isinstance(node, ast.Attribute):
            cls = function.cls if function is not None else None
            value = node.value
            if cls is not None and isinstance(value, ast.Name) and value.id == _first_param(function):
                found = cls.method(self, node.attr)
                return found if found is not None else None
            if (cls is not None and isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                    and value.func.id == "super"):
                for base in cls.bases(self):
                    found = base.method(self, node.attr)
                    if found is not None:
                        return found
                return None
            if function is not None and isinstance(value, ast.Name) and value.id in function.instances(self):
                return function.instances(self)[value.id].method(self, node.attr)
            base = self.resolve_expr(value, module, function)
            if isinstance(base, str):
                return self.lookup(base, node.attr)
            if isinstance(base, Class):
                return base.method(self, node.attr)
        return None


def _first_param(function: Function) -> Optional[str]:
    args = function.node.args.posonlyargs + function.node.args.args
    return args[0].arg if args else None


def received(function: Function, call: ast.Call, followed: Set[str], skip_first: bool,
             derived: bool = False) -> Set[str]:
    """The callee's parameters that receive a followed name at ``call`` (``derived``: an argument mentioning one)."""
    def named(n):
        return mentions(n, followed) if derived else isinstance(n, ast.Name) and n.id in followed

    a = function.node.args
    positional = [p.arg for p in a.posonlyargs + a.args][1 if skip_first else 0:]
    keyword_names = [p.arg for p in a.args + a.kwonlyargs]
    out: Set[str] = set()
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred):
            if named(arg.value):
                out.update(positional[i:])
                out.update([a.vararg.arg] if a.vararg else [])
            break  # positions after a starred argument are unknown
        if named(arg):
            if i < len(positional):
                out.add(positional[i])
            elif a.vararg:
                out.add(a.vararg.arg)
    for k in call.keywords:
        if not named(k.value):
            continue
        if k.arg is None:  # **model
            out.update(keyword_names)
            out.update([a.kwarg.arg] if a.kwarg else [])
        elif k.arg in keyword_names:
            out.add(k.arg)
        elif a.kwarg:
            out.add(a.kwarg.arg)
    return out


def passes(call: ast.Call, followed: Set[str], derived: bool = False) -> bool:
    """Whether a followed name is an argument of ``call`` directly, or its receiver (``derived``: mentioned in
    an argument or the receiver)."""
    def named(n):
        return mentions(n, followed) if derived else isinstance(n, ast.Name) and n.id in followed

    if any(named(x.value if isinstance(x, ast.Starred) else x) for x in call.args):
        return True
    if any(named(k.value) for k in call.keywords):
        return True
    return isinstance(call.func, ast.Attribute) and named(call.func.value)


class Walk:
    """One walk from :data:`START`: the call trace, the stays and what they add up to."""

    def __init__(self, program: Program, every_call: bool = False, reread: bool = False, derived: bool = False,
                 start: Tuple[str, str, str] = START):
        self.program, self.every_call, self.reread, self.derived = program, every_call, reread, derived
        self.trace: List[Tuple[int, str, str]] = []  # (depth, module, function) per function entered
        self.stays: List[dict] = []
        self.climbs: List[Tuple[str, str, str]] = []  # (from module, to module, function entered)
        self.entered: Dict[str, int] = {}
        self.read: Set[Tuple[str, str]] = set()
        module, name, param = start
        mod = program.module(module)
        if mod is None or name not in mod.functions:
            raise SystemExit(f"walk.py: no function {name} in {module} (the tree read has none to start from)")
        self._move(module, "start", name)
        self._read(mod.functions[name], {param}, 0, [])

    def _move(self, module: str, how: str, function: str) -> None:
        if self.stays and self.stays[-1]["module"] == module:
            if function not in self.stays[-1]["functions"]:
                self.stays[-1]["functions"].append(function)
            return
        self.stays.append({"module": module, "floor": floor_of(module), "how": how, "functions": [function]})

    def _read(self, function: Function, followed: Set[str], depth: int, stack: List[Tuple[str, str]]) -> None:
        self.read.add(function.key)
        self.trace.append((depth, function.module.name, function.qualname))
        stack = stack + [function.key]
        followed = set(followed)
        for kind, *node in events(ast.Module(body=function.node.body, type_ignores=[])):
            node = node[0] if kind == "call" else node
            if kind == "bind":
                targets, value, how = node
                if self.derived and mentions(value, followed):
                    followed.update(bound_names(targets))
                elif (how == "assign" and isinstance(value, ast.Name) and value.id in followed
                      and all(isinstance(t, ast.Name) for t in targets)):
                    followed.update(t.id for t in targets)
                continue
            if not (self.every_call or passes(node, followed, self.derived)):
                continue
            callee, skip_first = self._callee(node, function)
            if callee is None or callee.key in stack or (callee.key in self.read and not self.reread):
                continue
            here, there = function.module.name, callee.module.name
            if there != here:
                self.entered[there] = self.entered.get(there, 0) + 1
                f_here, f_there = floor_of(here), floor_of(there)
                if f_here is not None and f_there is not None and f_there > f_here:
                    self.climbs.append((here, there, callee.qualname))
            self._move(there, "call" if there != here else "", callee.qualname)
            self._read(callee, received(callee, node, followed, skip_first, self.derived), depth + 1, stack)
            self._move(here, "return", function.qualname)

    def _callee(self, call: ast.Call, function: Function) -> Tuple[Optional[Function], bool]:
        found = self.program.resolve_expr(call.func, function.module, function)
        if isinstance(found, Class):
            init = found.method(self.program, "__init__")
            return init, True
        if isinstance(found, Function):
            through_instance = isinstance(call.func, ast.Attribute) and found.cls is not None and not (
                isinstance(self.program.resolve_expr(call.func.value, function.module, function), Class))
            return found, found.bound(through_instance)
        return None, False

    # -- what it adds up to ------------------------------------------------------------------------
    def totals(self) -> Dict[str, int]:
        rooms = len({s["module"] for s in self.stays})
        return {"stays": len(self.stays), "rooms": rooms, "climbs": len(self.climbs),
                "returns": len(self.stays) - rooms, "rises": len(self.rises())}

    def rises(self) -> List[Tuple[str, str]]:
        """Every move of the reader to a higher floor, returns included: (from module, to module)."""
        return [(a["module"], b["module"]) for a, b in zip(self.stays, self.stays[1:])
                if a["floor"] is not None and b["floor"] is not None and b["floor"] > a["floor"]]

    def per_module(self) -> Dict[str, dict]:
        out: Dict[str, dict] = {}
        for s in self.stays:
            m = out.setdefault(s["module"], {"floor": s["floor"], "entered": self.entered.get(s["module"], 0),
                                             "stays": 0})
            m["stays"] += 1
        return out

    def summary_line(self) -> str:
        t = self.totals()
        return (f"walk of model through muon_param_groups: {t['stays']} stays in {t['rooms']} rooms, "
                f"{t['climbs']} climbs back up, {t['returns']} returns to a room already left")

    def as_json(self) -> dict:
        return {"variant": {"every_call": self.every_call, "reread": self.reread, "derived": self.derived},
                "trace": [{"depth": d, "module": m, "function": f} for d, m, f in self.trace],
                "stays": self.stays, "climbs": [{"from": a, "to": b, "function": f} for a, b, f in self.climbs],
                "modules": self.per_module(), "totals": self.totals(), "summary": self.summary_line()}

    def report(self) -> str:
        lines = ["call trace (module:function, indented by depth):"]
        lines += [f"  {'  ' * d}{m}:{f}" for d, m, f in self.trace]
        lines.append(f"\nstays ({len(self.stays)}): module [floor] how: functions read there")
        for i, s in enumerate(self.stays, 1):
            fl = "?" if s["floor"] is None else s["floor"]
            lines.append(f"  {i:3d}. {s['module']} [{fl}] {s['how']}: {', '.join(s['functions'])}")
        lines.append(f"\nclimbs back up ({len(self.climbs)}):")
        lines += [f"  {a} [{floor_of(a)}] -> {b} [{floor_of(b)}] ({f})" for a, b, f in self.climbs]
        lines.append("\nmodules (floor, entered by a call from another module, stays):")
        for m, v in sorted(self.per_module().items(), key=lambda kv: (-kv[1]["stays"], kv[0])):
            fl = "?" if v["floor"] is None else v["floor"]
            lines.append(f"  {m} [{fl}]: entered {v['entered']} times, {v['stays']} stays")
        lines.append("\n" + self.summary_line())
        lines.append(f"moves up a floor, returns included: {len(self.rises())} (calls: {len(self.climbs)})")
        return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=CHECKOUT, help="a checkout's root (holding ds_muon/); default: this one")
    parser.add_argument("--json", action="store_true", help="the walk as JSON")
    parser.add_argument("--every-call", action="store_true",
                        help="follow every call that resolves to ds_muon, whether the model is passed or not")
    parser.add_argument("--reread", action="store_true",
                        help="enter a function again at every followed call (never while it is being read)")
    parser.add_argument("--derived", action="store_true",
                        help="follow what is made from the model too (any argument or binding mentioning it)")
    args = parser.parse_args(argv)
    walk = Walk(Program(args.root), every_call=args.every_call, reread=args.reread, derived=args.derived)
    print(json.dumps(walk.as_json(), indent=1) if args.json else walk.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
