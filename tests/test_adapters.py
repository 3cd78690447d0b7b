"""Stack adapters: the protocol, the choice at construction, what they tell the engine, and the
package's import graph (adapters apart from the engine, no cycles)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import torch
from torch import nn

import ds_muon
from ds_muon.integrations.base import BindContext, StackAdapter
from ds_muon.integrations.default import DefaultAdapter
from ds_muon.integrations.fsdp1 import Fsdp1Adapter
from ds_muon.integrations.fsdp2 import Fsdp2Adapter
from ds_muon.integrations.local import LocalAdapter, bind_replicated

from models import HandAdapter

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _graph():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "import_graph.py")], capture_output=True,
                         text=True, check=False).stdout
    edges = {}
    for line in out.split("\n\n")[0].splitlines():
        mod, deps = line.split(" -> ")
        edges[mod] = set() if deps == "-" else set(deps.split(", "))
    return out, edges


def test_the_package_keeps_its_layers():
    """No cycles; imports only downwards (front doors → integrations → models, engine → rules, tensors); every
    module in its role's package (tools/import_graph.py's MAY_IMPORT and FRONT_DOORS)."""
    out, edges = _graph()
    assert "\ncycles: 0\n" in out, out
    assert "\nlayering violations: 0\n" in out, out
    assert "\noutside a role's package: 0\n" in out, out
    # every module over 400 lines says why in its docstring (tools/import_graph.py's REASON)
    assert "\nover 400 lines without the reason in the docstring: 0\n" in out, out
    assert out.rstrip().splitlines()[-1] == ("summary: 0 cycles, 0 layering violations, 0 modules outside a role's "
                                            "package, 0 modules over 400 lines without their reason"), out
    # the layers as the docs state them, spelled out here too (a table edited to allow more fails this)
    for mod, deps in edges.items():
        role = mod.split(".")[1] if mod.count(".") >= 1 else None
        if role == "rules":
            assert all(d.startswith("ds_muon.rules") for d in deps), (mod, deps)
        if role in ("engine", "rules"):
            assert not {d for d in deps if d.startswith(("ds_muon.integrations", "ds_muon.models"))}, (mod, deps)
        if role in ("models", "tensors"):  # what a tensor is never depends on where it lives (issue 43)
            assert all(d.startswith(("ds_muon.models", "ds_muon.tensors")) for d in deps), (mod, deps)
    # the optimizer knows the protocol and the default only, never a stack's module
    assert {d for d in edges["ds_muon.optimizer"] if d.startswith("ds_muon.integrations")} <= {
        "ds_muon.integrations.base", "ds_muon.integrations.default"}
    # bind is the DeepSpeed front door's: the adapter never sees the optimizer
    assert "ds_muon.optimizer" not in edges["ds_muon.integrations.deepspeed"]


def test_the_layering_check_reports_what_crosses():
    """The checker itself: an upward import, an engine module reading a model reader, a module at the top
    level that is no front door, and a cycle are each reported."""
    spec = importlib.util.spec_from_file_location("import_graph", os.path.join(ROOT, "tools", "import_graph.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    graph = {"ds_muon.rules.a": {"ds_muon.engine.b"}, "ds_muon.engine.b": {"ds_muon.models.c"},
             "ds_muon.models.c": set(), "ds_muon.integrations.d": {"ds_muon.optimizer"},
             "ds_muon.optimizer": {"ds_muon.integrations.d"}, "ds_muon.helpers": set()}
    violations, homeless = tool.layering(graph)
    assert set(violations) == {("ds_muon.rules.a", "ds_muon.engine.b"), ("ds_muon.engine.b", "ds_muon.models.c"),
                               ("ds_muon.integrations.d", "ds_muon.optimizer")}
    assert homeless == ["ds_muon.helpers"]
    assert tool.cycles(graph) == [["ds_muon.integrations.d", "ds_muon.optimizer", "ds_muon.integrations.d"]]
    # an engine stage reading a stage above it, and a door standing on another door, are each reported too
    staged = {"ds_muon.engine.exchange.a": {"ds_muon.engine.plan.b"}, "ds_muon.engine.plan.b": {"ds_muon.engine.exchange.a"},
              "ds_muon.engine.runtime": {"ds_muon.engine.plan.b"}, "ds_muon.cli": {"ds_muon.convert"},
              "ds_muon.convert": {"ds_muon.optimizer"}, "ds_muon.optimizer": set()}
    assert tool.layering(staged) == ([("ds_muon.cli", "ds_muon.convert"),
                                      ("ds_muon.engine.exchange.a", "ds_muon.engine.plan.b")], [])
    assert tool.floors(staged) == {"ds_muon.cli": 4, "ds_muon.convert": 3, "ds_muon.optimizer": 2}


def test_the_length_check_wants_a_reason(tmp_path):
    """A module over 400 lines is reported unless a paragraph of its docstring begins "Over 400 lines" and goes
    on to say why; the marker alone, or the reason inside another paragraph, is not enough."""
    spec = importlib.util.spec_from_file_location("import_graph", os.path.join(ROOT, "tools", "import_graph.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    body = "x = 1\n" * 400
    reason = "as one class: every stage reads the same caches, and a split would only pass them back."
    modules = {  # name -> (source, reported)
        "short": ('"""Short."""\n', False),
        "none": ('"""Long."""\n' + body, True),
        "bare": ('"""Long.\n\nOver 400 lines.\n"""\n' + body, True),
        "inline": (f'"""Long, and over 400 lines, {reason}"""\n' + body, True),
        "why": (f'"""Long.\n\n(Over 400 lines, {reason})\n"""\n' + body, False),
        "plain": (f'"""Long.\n\nOver 400 lines: {reason}"""\n' + body, False),
    }
    paths = {}
    for name, (source, _) in modules.items():
        (tmp_path / f"{name}.py").write_text(source)
        paths[f"ds_muon.{name}"] = str(tmp_path / f"{name}.py")
    assert tool.long_without_reason(paths) == [(f"ds_muon.{n}", source.count("\n"))
                                               for n, (source, bad) in sorted(modules.items()) if bad]
    assert ("ds_muon.short", 1) in tool.long_without_reason(paths, limit=0)  # the limit is the one asked for


def test_every_adapter_follows_the_protocol():
    for adapter in (DefaultAdapter(), LocalAdapter(), Fsdp1Adapter(), Fsdp2Adapter()):
        assert isinstance(adapter, StackAdapter), type(adapter).__name__
        assert adapter.applies_in_step is False and adapter.data_parallel_group is None
    p = nn.Parameter(torch.randn(4, 3))
    assert LocalAdapter().grad_final_at_hook(p, BindContext()) is True  # one process: nothing to reduce
    assert Fsdp1Adapter().grad_final_at_hook(p, BindContext()) is False
    # FSDP2: only parameters of a fully_shard unit of the model (the FSDP2 overlap tests in test_overlap.py
    # assert that their gathers leave from backward); a tensor outside one is reduced by nobody
    assert Fsdp2Adapter().grad_final_at_hook(p, BindContext()) is False
    assert Fsdp2Adapter().grad_final_at_hook(p, BindContext(model=nn.Linear(3, 4))) is False


def _mlp(seed=0):
    torch.manual_seed(seed)
    # 0: the input layer, 6: the output layer (AdamW); 2 and 4: hidden matrices
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3))


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_adapter_chosen_at_construction_describes_every_muon_tensor():
    model = _mlp()
    seen = []

    def describe(p, name, context):
        seen.append((name, context.process_group, context.model, context.options["lr"]))
        return bind_replicated(p, name)

    opt = ds_muon.Muon(ds_muon.muon_param_groups(model, lr=0.03), adapter=HandAdapter(describe), model=model,
                       ns_dtype=torch.float32)
    ref_model = _mlp()
    ref = ds_muon.Muon(ds_muon.muon_param_groups(ref_model, lr=0.03), ns_dtype=torch.float32)
    assert isinstance(opt.adapter, HandAdapter) and isinstance(ref.adapter, DefaultAdapter)
    for t in range(2):
        _grads(model, t)
        _grads(ref_model, t)
        opt.step()
        ref.step()
    assert seen == [("2.weight", None, model, 0.03), ("4.weight", None, model, 0.03)]  # bound once, then cached
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


class _AppliesInStep(HandAdapter):
    applies_in_step = True  # as DeepSpeed: the stack copies results out right after step()


def test_an_adapter_that_applies_in_step_turns_deferred_updates_off():
    steps = {}
    for kind in ("default", "in_step"):
        model = _mlp()
        adapter = None if kind == "default" else _AppliesInStep(lambda p, n, c: bind_replicated(p, n))
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model), overlap=True, apply_in_forward=True, model=model,
                           adapter=adapter, ns_dtype=torch.float32)
        before = model[2].weight.detach().clone()
        _grads(model, 0)
        opt.step()
        steps[kind] = (torch.equal(model[2].weight, before), opt)
        opt.flush()
        steps[kind] += (model[2].weight.detach().clone(),)
    assert steps["default"][0] is True  # deferred to the next forward (or flush)
    assert steps["in_step"][0] is False  # applied inside step()
    assert steps["default"][1].runtime.stack_allows_overlap() and not steps["in_step"][1].runtime.stack_allows_overlap()
    assert torch.equal(steps["default"][2], steps["in_step"][2])


def test_attach_replaces_the_adapter_and_forgets_layouts():
    model = _mlp()
    opt = ds_muon.Muon(ds_muon.muon_param_groups(model), ns_dtype=torch.float32)
    _grads(model, 0)
    opt.step()
    first = dict(opt.runtime.bindings)
    calls = []
    group = object()

    class WithGroup(HandAdapter):
        data_parallel_group = group  # planned in when the optimizer was given no process_group

    opt.attach(WithGroup(lambda p, n, c: calls.append(c.process_group) or first[id(p)]))
    assert opt.process_group is group
    opt.process_group = None  # (a fake group cannot run collectives)
    _grads(model, 1)
    opt.step()
    assert calls == [None, None]
