"""Every ``ds-muon`` error is one line naming the argument and the fix, exit status 2, never a traceback.

Generated: hypothesis draws argv for each subcommand (``plan``, ``shapes``, ``convert``) from pools of
good and bad values per argument: missing, empty, garbage, non-JSON, wrong-JSON, folder-for-file and
file-for-folder paths, malformed numbers, unknown choices, bad mesh specs, and for ``--model`` every
way a factory can fail (no colon, a missing module, a module that fails to import, a missing attribute,
a non-callable, a callable that raises or returns no module).  ``cli.main(argv)`` runs in-process;
an argv of only good values must succeed (exit 0), any other must exit 2 with one stderr line that
names an argument of the argv.  Before the fix ``--model no_such_module:build`` and a dozen other
inputs printed a traceback.  A few real subprocess calls check the console script's output too.
DS_MUON_CLI_EXAMPLES raises the count.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ds_muon import cli

EXAMPLES = int(os.environ.get("DS_MUON_CLI_EXAMPLES", "40"))
HYP = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    f = {}

    def put(name, data):
        path = d / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        f[name] = str(path)

    put("garbage.bin", os.urandom(64))
    put("empty.json", "")
    put("not.json", "{'hidden_size': 8,")
    put("list.json", "[1, 2]")
    put("wrong_hf.json", json.dumps({"hidden_size": "big", "num_hidden_layers": 2, "num_attention_heads": 2}))
    put("neg_hf.json", json.dumps({"hidden_size": 8, "num_hidden_layers": -1, "num_attention_heads": 2}))
    put("huge_hf.json", json.dumps({"hidden_size": 8, "num_hidden_layers": 10**9, "num_attention_heads": 2}))
    put("hf.json", json.dumps({"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}))
    put("shapes.json", json.dumps({"matrices": [{"name": "a", "shape": [8, 16]}, {"name": "b", "shape": [16, 8]}]}))
    put("bad_shapes.json", json.dumps({"matrices": [{"name": "a", "shape": [8]}]}))
    put("bad_shapes2.json", json.dumps({"matrices": [{"name": "a", "shape": ["x", 2]}]}))
    put("bad_shapes3.json", json.dumps({"matrices": {"a": 1}}))
    put("summary_bad.json", json.dumps({"version": 99}))
    put("ds.json", json.dumps({"optimizer": {"type": "DsMuon", "params": {"lr": 0.02, "adam_lr": 3e-3}}}))
    put("ds_bad_params.json", json.dumps({"optimizer": {"type": "DsMuon", "params": [1]}}))
    put("ds_bad_key.json", json.dumps({"optimizer": {"type": "DsMuon", "params": {"no_such_setting": 1}}}))
    put("broken_import_mod.py", "raise RuntimeError('this module fails to import')\n")
    # a good source: torch.optim.Muon + AdamW state of test_convert's net, names recorded
    from test_convert import net, run, torch_pair

    a = net()
    pair = torch_pair(a)
    run(a, pair, 1)
    src = d / "state.pt"
    torch.save({"model": a.state_dict(), "optimizers": [o.state_dict() for o in pair]}, src)
    f["state.pt"] = str(src)
    f["dir"] = str(d)
    f["missing"] = str(d / "no_such_file.json")
    f["under_file"] = os.path.join(f["garbage.bin"], "out.pt")
    f["no_folder"] = str(d / "no_such_folder" / "out.pt")
    f["out"] = str(d / "out.pt")
    sys.path.insert(0, str(d))  # broken_import_mod
    yield f
    sys.path.remove(str(d))


def _good(v):
    return ("good", v)


def _bad(v):
    return ("bad", v)


def _run(argv, capsys):
    """(exit status, stderr) of cli.main(argv) in-process; anything but SystemExit/return is a traceback."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    return rc, err


def _check(values, argv, capsys):
    rc, err = _run(argv, capsys)
    bad = [v for kind, v in values if kind == "bad"]
    if not bad:
        assert rc == 0, (argv, err)
        return
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, (argv, rc, err)
    assert len(lines) == 1 and "Traceback" not in err and "unexpected" not in err, (argv, err)
    named = [a for a in argv if a.startswith("--")] + ["SRC", "DST", "argument", "the following arguments"]
    assert any(a in lines[0] for a in named), (argv, lines[0])


NUM = st.sampled_from([_good("2"), _good("4"), _bad("0"), _bad("-3"), _bad("abc"), _bad("nan"), _bad("inf"),
                       _bad("1e999"), _bad(""), _bad("70000"), _bad("2.5")])
FLOAT = st.sampled_from([_good("100"), _good("0.5"), _bad("0"), _bad("-1"), _bad("x"), _bad("nan"), _bad("inf")])


def _source(f):
    return st.sampled_from([
        ("--preset", _good("gpt-125m")), ("--preset", _bad("no-such-preset")), ("--preset", _bad(f["garbage.bin"])),
        ("--hf-config", _good(f["hf.json"])), ("--hf-config", _bad(f["missing"])), ("--hf-config", _bad(f["dir"])),
        ("--hf-config", _bad(f["not.json"])), ("--hf-config", _bad(f["list.json"])),
        ("--hf-config", _bad(f["wrong_hf.json"])), ("--hf-config", _bad(f["neg_hf.json"])),
        ("--hf-config", _bad(f["huge_hf.json"])), ("--hf-config", _bad(f["garbage.bin"])),
        ("--shapes", _good(f["shapes.json"])), ("--shapes", _bad(f["bad_shapes.json"])),
        ("--shapes", _bad(f["bad_shapes2.json"])), ("--shapes", _bad(f["bad_shapes3.json"])),
        ("--shapes", _bad(f["empty.json"])), ("--summary", _bad(f["summary_bad.json"])),
        ("--summary", _bad(f["missing"])), ("--summary", _bad(f["garbage.bin"]))])


def test_plan_errors_are_one_line(files, capsys):
    @HYP
    @given(source=_source(files), world=st.one_of(st.none(), NUM), steps=st.one_of(st.none(), NUM),
           tflops=st.one_of(st.none(), FLOAT),
           layout=st.sampled_from([None, _good("replicated"), _bad("diagonal")]),
           mesh=st.sampled_from([None, _good("replicate=2,shard=2"), _bad("replicate=2"), _bad("dp=0,tp=2"),
                                 _bad("nonsense")]),
           plot=st.sampled_from([None, _bad(files["no_folder"] + ".png"), _bad(files["under_file"])]))
    def check(source, world, steps, tflops, layout, mesh, plot):
        flag, value = source
        argv, values = ["plan", flag, value[1], "--json"], [value]
        if flag == "--summary" and mesh is not None:
            mesh = _bad(mesh[1])  # --mesh takes shapes, not --summary
        for name, v in (("--world-sizes", world), ("--ns-steps", steps), ("--tflops", tflops), ("--layout", layout),
                        ("--mesh", mesh), ("--plot", plot)):
            if v is not None:
                argv += [name, v[1]]
                values.append(v)
        _check(values, argv, capsys)

    check()


def test_shapes_errors_are_one_line(files, capsys):
    @HYP
    @given(path=st.sampled_from([_good(files["hf.json"]), _bad(files["missing"]), _bad(files["not.json"]),
                                 _bad(files["list.json"]), _bad(files["wrong_hf.json"]), _bad(files["dir"]),
                                 _bad(files["garbage.bin"])]))
    def check(path):
        _check([path], ["shapes", "--hf-config", path[1]], capsys)

    check()
    rc, err = _run(["shapes"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--hf-config" in err


MODELS = [_good("test_convert:net"), _bad("nocolon"), _bad(":net"), _bad("test_convert:"),
          _bad("no_such_module_xyz:build"), _bad("broken_import_mod:build"), _bad("test_convert:no_such_factory"),
          _bad("math:pi"), _bad("json:loads"), _bad("builtins:dict"), _bad("test_convert:other_net")]


def test_convert_errors_are_one_line(files, capsys):
    @HYP
    @given(src=st.sampled_from([_good(files["state.pt"]), _bad(files["missing"]), _bad(files["garbage.bin"]),
                                _bad(files["empty.json"]), _bad(files["dir"]), _bad(files["hf.json"])]),
           dst=st.sampled_from([_good(files["out"]), _bad(files["under_file"]), _bad(files["no_folder"]),
                                _bad(files["dir"])]),
           model=st.sampled_from(MODELS),
           to=st.sampled_from([None, _good("torch"), _bad("zip")]),
           source=st.sampled_from([None, _good("torch"), _good("auto"), _bad("dcp"), _bad("universal"), _bad("nope")]),
           sets=st.sampled_from([None, _good(["lr=0.02", "adam_lr=0.003"]), _bad(["=3"]), _bad(["lr"]),
                                 _bad(["no_such_setting=1"]), _bad(["lr=abc"]), _bad(["momentum=7"])]),
           config=st.sampled_from([None, _good(files["ds.json"]), _bad(files["missing"]), _bad(files["not.json"]),
                                   _bad(files["list.json"]), _bad(files["ds_bad_params.json"]),
                                   _bad(files["ds_bad_key.json"])]))
    def check(src, dst, model, to, source, sets, config):
        argv, values = ["convert", src[1], dst[1], "--model", model[1]], [src, dst, model]
        to = to or _bad("universal")  # the default: DeepSpeed's engine per example is too slow here
        if to[1] == "universal":
            argv += ["--to", "universal"]
            if dst[1] == files["dir"]:  # a folder is what a universal checkpoint is written into
                values[1] = dst = _good(dst[1])
            if all(k == "good" for k, _ in values + [x for x in (source, sets, config) if x]):
                return  # an all-good universal conversion: tests/test_convert.py runs it
        else:
            argv += ["--to", to[1]]
        values.append(to if to[1] != "universal" else _good("universal"))
        for name, v in (("--source", source), ("--config", config)):
            if v is not None:
                argv += [name, v[1]]
                values.append(v)
        if sets is not None:
            argv += ["--set", *sets[1]]
            values.append(sets)
        if dst[1] == files["out"] and os.path.exists(dst[1]):
            os.remove(dst[1])
        _check(values, argv, capsys)

    check()


def test_the_console_script_prints_one_line(files, tmp_path):
    """Real processes (the installed entry point's module): the fault of the issue and two more."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.path.join(os.getcwd(), "tests")]))
    for argv, named in ((["convert", files["state.pt"], str(tmp_path / "o.pt"), "--model", "no_such_module:build"],
                         "--model"),
                        (["convert", files["garbage.bin"], str(tmp_path / "o.pt"), "--model", "test_convert:net"], "SRC"),
                        (["plan", "--shapes", files["not.json"]], "--shapes")):
        p = subprocess.run([sys.executable, "-m", "ds_muon.cli", *argv], capture_output=True, text=True, env=env,
                           timeout=120)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and named in p.stderr, p.stderr


def test_plan_refuses_a_plot_of_one_mesh(tmp_path, capsys):
    """``--mesh`` plans one mesh: ``--plot`` (a sweep over world sizes) is refused by name, not ignored."""
    out = tmp_path / "plan.png"
    rc, err = _run(["plan", "--preset", "gpt-125m", "--mesh", "replicate=2,shard=2", "--plot", str(out)], capsys)
    assert rc == 2 and "--plot" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
