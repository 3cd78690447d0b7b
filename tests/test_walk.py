"""tools/walk.py, issue 43's measure: the walk of ``model`` through ``muon_param_groups`` (read with ast).

A small package written to tmp_path fixes every count by hand (a function read once, an alias, a class's
``__init__`` and ``self`` methods, a method of a local of known class, a lazy import that climbs a floor, a
re-export, a keyword argument, calls that are not followed); then the real tree against issue 43's limits."""

from __future__ import annotations

import importlib.util
import json
import os
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _walk_module():
    spec = importlib.util.spec_from_file_location("walk", os.path.join(ROOT, "tools", "walk.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # it finds tools/import_graph.py beside it
    return module


walk = _walk_module()

FILES = {
    "__init__.py": "",
    "param_groups.py": """
        from .models import describe                # re-exported by models/__init__.py
        from .models.kinds import Rules, unseen
        from .integrations import stack as st


        def muon_param_groups(model, lr=0.1):
            m = model                               # a pure alias: followed
            helper(m)                               # same module: no new stay
            describe(model)                         # -> models.kinds (re-export)
            describe(model)                         # read already: not entered again
            unseen(list(model))                     # the model is not an argument directly: not followed
            rules = Rules(model)                    # a class: its __init__
            rules.skip(model)                       # a method of an object whose class the text gives
            st.bind(1, model=m)                     # an attribute of an imported module, by keyword
            model.cuda()                            # a method of the model: not ds_muon's
            return len(model)                       # a builtin


        def helper(net):
            return net
        """,
    "models/__init__.py": "from .kinds import describe\n",
    "models/kinds.py": """
        class Rules:
            def __init__(self, model, head=None):
                self._look(model)
                self.skip(head)                     # head is not the model: not followed

            def _look(self, net):
                from ..integrations.stack import adapt   # lazy import, one floor up: a climb
                adapt(net)

            def skip(self, x):
                return x


        def describe(model):
            return _inner(model)


        def _inner(module):                          # received by position under another name
            return module


        def unseen(x):
            return x
        """,
    "integrations/__init__.py": "",
    "integrations/stack.py": """
        def adapt(model=None, x=0):
            for layer in model:                     # a for target is not followed
                touch(layer)
            return model


        def bind(x, model=None):
            touch(model)


        def touch(layer):
            return layer
        """,
}


@pytest.fixture
def tree(tmp_path):
    for rel, text in FILES.items():
        path = tmp_path / "ds_muon" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(tmp_path)


def test_counts_on_a_small_package(tree):
    w = walk.Walk(walk.Program(tree))
    assert w.trace == [
        (0, "ds_muon.param_groups", "muon_param_groups"),
        (1, "ds_muon.param_groups", "helper"),
        (1, "ds_muon.models.kinds", "describe"),
        (2, "ds_muon.models.kinds", "_inner"),
        (1, "ds_muon.models.kinds", "Rules.__init__"),
        (2, "ds_muon.models.kinds", "Rules._look"),
        (3, "ds_muon.integrations.stack", "adapt"),
        (1, "ds_muon.models.kinds", "Rules.skip"),
        (1, "ds_muon.integrations.stack", "bind"),
        (2, "ds_muon.integrations.stack", "touch"),
    ]
    pg, kinds, stack = "ds_muon.param_groups", "ds_muon.models.kinds", "ds_muon.integrations.stack"
    assert [s["module"] for s in w.stays] == [pg, kinds, pg, kinds, stack, kinds, pg, kinds, pg, stack, pg]
    assert [s["how"] for s in w.stays] == ["start", "call", "return", "call", "call", "return", "return", "call",
                                           "return", "call", "return"]
    assert w.climbs == [(kinds, stack, "adapt")]  # floor 3 -> 4; the face (5) calling down is no climb
    assert w.totals() == {"stays": 11, "rooms": 3, "climbs": 1, "returns": 8, "rises": 5}
    assert w.per_module() == {pg: {"floor": 5, "entered": 0, "stays": 5},
                              kinds: {"floor": 3, "entered": 3, "stays": 4},
                              stack: {"floor": 4, "entered": 2, "stays": 2}}
    assert w.summary_line() == ("walk of model through muon_param_groups: 11 stays in 3 rooms, 1 climbs back up, "
                                "8 returns to a room already left")


def test_variants_on_a_small_package(tree):
    every = walk.Walk(walk.Program(tree), every_call=True)
    assert "unseen" in {f for _, _, f in every.trace}  # followed whatever the arguments
    assert (2, "ds_muon.models.kinds", "Rules.skip") in every.trace  # self.skip(head), from __init__
    derived = walk.Walk(walk.Program(tree), derived=True)
    assert "unseen" in {f for _, _, f in derived.trace}  # list(model) is made from the model
    assert (1, "ds_muon.models.kinds", "Rules.skip") in derived.trace  # head is not
    # touch is read from adapt now (the loop's target is made from the model)
    assert (4, "ds_muon.integrations.stack", "touch") in derived.trace
    reread = walk.Walk(walk.Program(tree), reread=True)
    assert [f for _, _, f in reread.trace].count("describe") == 2
    assert reread.totals()["stays"] == walk.Walk(walk.Program(tree)).totals()["stays"] + 2


def test_command_line(tree, capsys):
    assert walk.main(["--root", tree, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["totals"]["stays"] == 11 and out["trace"][0]["function"] == "muon_param_groups"
    assert walk.main(["--root", tree]) == 0
    assert "11 stays in 3 rooms, 1 climbs back up, 8 returns" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no ds_muon"):
        walk.main(["--root", os.path.join(tree, "ds_muon")])


def test_the_real_tree_is_read():
    w = walk.Walk(walk.Program(ROOT))
    assert w.stays[0]["module"] == "ds_muon.param_groups" and w.trace[0][2] == "muon_param_groups"
    assert len(w.trace) > 1 and all(s["floor"] is not None for s in w.stays)


def test_the_real_walk_within_issue_43s_limits():
    """Issue 43's limits on the walk of ``model`` through ``muon_param_groups``; the climbs also read as every
    move up a floor, returns included (the issue's count of coming back up into the FSDP1 adapter)."""
    t = walk.Walk(walk.Program(ROOT)).totals()
    assert t["stays"] <= 30 and t["rooms"] <= 6 and t["climbs"] <= 3 and t["rises"] <= 3, t
