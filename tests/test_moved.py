"""Old module paths (before the engine was arranged by stage) import one release more, with a DeprecationWarning."""

import importlib
import json
import subprocess
import sys

import pytest

from ds_muon.engine.moved import MOVED


def test_every_old_engine_path_is_the_module_at_its_new_path_and_warns():
    # a fresh interpreter, so each old path is imported there for the first time and its warning is seen
    code = """
import importlib, json, sys, warnings
import ds_muon
from ds_muon.engine.moved import MOVED
out = {}
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    out[old] = [module is importlib.import_module(new), [str(w.message) for w in seen if w.category is DeprecationWarning]]
print(json.dumps(out))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(got) == sorted(MOVED)
    for old, (same, warned) in got.items():
        assert same, f"{old} is not the module {MOVED[old]}"
        assert warned == [f"{old} moved to {MOVED[old]}; import it from there (the old path goes in the next release)"], old


def test_every_new_path_exists_and_no_old_path_is_still_a_file():
    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        assert importlib.util.find_spec(old).origin is None, f"{old} is a module file again: drop it from MOVED"


@pytest.mark.parametrize("old, name, new", [("ds_muon.engine.exchange", "Exchange", "ds_muon.engine.exchange.all_to_all"),
                                            ("ds_muon.engine.agreement", "Agreement", "ds_muon.engine.agreement.check")])
def test_an_old_module_that_is_now_a_package_still_hands_out_its_names(old, name, new):
    package = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"{old}.{name} moved to {new}.{name}"):
        got = getattr(package, name)
    assert got is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        package.NotAName
