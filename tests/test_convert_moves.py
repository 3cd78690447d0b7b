"""Every conversion move, generated: each source format × each target × ``fresh`` off/on × the source's groups
(ds_muon's own, or lm_head stepped with Muon where ds_muon puts it on AdamW) × the ZeRO stage and world size
a DeepSpeed source was saved at, each run twice in one process into the same ``dst``.

Sources are made once per module: one-process ds_muon trained two steps (``TinyLM``), written as a torch file
and as DCP; DsMuon engines at ZeRO-1/2/3 × W=1/2 trained the same two steps and saved (their own full state is
that source's reference), and those folders converted to universal.  After each run the written checkpoint is
read back and compared with ``torch.equal`` to the reference computed once: every weight, and each tensor's
state where the source stepped it with ds_muon's algorithm (zero or absent where it starts fresh).  A source
with other groups and ``fresh=False`` must be refused, naming the tensor, with nothing at ``dst``.

CI runs a seeded sample (issue 42's failing moves always in it: ``--fresh`` to universal, two universal
conversions in one process); ``DS_MUON_CONVERT_MATRIX=1`` runs every move.
"""

import os
import random

import pytest
import torch

import dist_harness

pytest.importorskip("deepspeed")

from ds_muon import convert as cv  # noqa: E402
from ds_muon.conversion.named import ADAMW_KEYS, MUON_KEYS  # noqa: E402
from ds_muon.setup.build import build_optimizer  # noqa: E402
from test_deepspeed import ENV, PARAMS, batch, ds_config, make_model, train  # noqa: E402

OTHER = dict(PARAMS, include=["lm_head.weight"])  # a source that stepped the head with Muon
GROUPS = {"same": PARAMS, "other": OTHER}
ZERO = [(stage, world) for stage in (1, 2, 3) for world in (1, 2)]
SOURCES = [("torch",), ("dcp",)] + [(fmt, stage, world) for fmt in ("deepspeed", "universal") for stage, world in ZERO]
TARGETS = ("torch", "dcp", "universal")
MOVES = [(src, groups, to, fresh) for src in SOURCES for groups in GROUPS for to in TARGETS for fresh in (False, True)]
# issue 42: --fresh to universal raised KeyError 'momentum_buffer'; a second universal conversion in one process
# raised "Group ... is not registered" (every move runs twice, so any move to universal is that)
FAILING = [(("torch",), "other", "universal", True), (("deepspeed", 2, 2), "same", "universal", False)]
FULL = os.environ.get("DS_MUON_CONVERT_MATRIX") == "1"
SEED = int(os.environ.get("DS_MUON_CONVERT_SEED", "42"))


def _sample():
    """FAILING, plus a seeded draw: two moves from one-process sources and one from a ZeRO (stage, W) that
    FAILING already builds (each ZeRO source costs a spawn)."""
    rng = random.Random(SEED)
    light = [m for m in MOVES if m[0][0] in ("torch", "dcp") and m not in FAILING]
    built = [m for m in MOVES if m[0] in {f[0] for f in FAILING} | {("universal", 2, 2)} and m not in FAILING]
    return FAILING + rng.sample(light, 2) + rng.sample(built, 1)


CASES = MOVES if FULL else _sample()


def _id(move):
    src, groups, to, fresh = move
    return f"{'-'.join(map(str, src))}.{groups}->{to}{'.fresh' if fresh else ''}"


def _muon_names(settings):
    opt = build_optimizer(make_model(), dict(settings, log_summary=False))
    return {n for g in opt.param_groups if g["use_muon"] for n in g["param_names"]}


def _reference(weights, state, muon_names):
    """Named of what a source holds: each tensor's state under its own algorithm's keys."""
    out = cv.Named(weights={n: w.detach().clone() for n, w in weights.items()})
    for n, st in state.items():
        keys = MUON_KEYS if n in muon_names else ADAMW_KEYS
        out.state[n] = {k: st[k].detach().clone() for k in keys}
    return out


def _one_process(groups):
    with dist_harness.one_thread():
        model = make_model()
        muon = build_optimizer(model, dict(GROUPS[groups], log_summary=False))
        for t in range(2):
            muon.zero_grad(set_to_none=True)
            model(*batch(t)).backward()
            muon.step()
    return model, muon


def _zero_worker(rank, world, stage, settings, folder):
    from ds_muon import deepspeed as ds_muon_deepspeed
    from test_checkpoints import full_state
    from test_deepspeed import full_fp32

    engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=ds_config(stage, params=settings))
    train(engine, 2)
    engine.save_checkpoint(folder, tag="t")
    return full_state(engine), full_fp32(engine)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each source built once, on first use: (path, reference Named)."""
    root = tmp_path_factory.mktemp("sources")
    made = {}

    def get(src, groups):
        key = (src, groups)
        if key in made:
            return made[key]
        folder = str(root / f"{'-'.join(map(str, src))}.{groups}")
        if src[0] in ("torch", "dcp"):
            model, muon = _one_process(groups)
            state = {n: muon.state[p] for g in muon.param_groups for n, p in zip(g["param_names"], g["params"])}
            ref = _reference(model.state_dict(), state, _muon_names(GROUPS[groups]))
            path = folder + ".pt" if src[0] == "torch" else folder
            (cv.write_torch if src[0] == "torch" else cv.write_dcp)(model, muon, path)
        elif src[0] == "deepspeed":
            state, fp32 = dist_harness.run(_zero_worker, src[2], src[1], GROUPS[groups], folder, env=ENV,
                                           timeout=300)[0]
            ref = _reference(fp32, state, _muon_names(GROUPS[groups]))
            path = os.path.join(folder, "t")
        else:
            zero_path, ref = get(("deepspeed",) + src[1:], groups)
            from ds_muon.integrations.deepspeed_universal import zero_to_universal

            path = zero_to_universal(zero_path, os.path.join(folder, "t_universal"))
        made[key] = (path, ref)
        return made[key]

    return get


def _read_back(to, dst):
    return {"torch": cv.read_torch, "dcp": cv.read_dcp, "universal": cv.read_universal_named}[to](dst)


def _expected(ref, muon_names):
    """Per tensor of ds_muon's groups: the reference's state where it is under ds_muon's algorithm, else zeros."""
    out = {}
    for n, w in ref.weights.items():
        keys = MUON_KEYS if n in muon_names else ADAMW_KEYS
        st = ref.state.get(n, {})
        out[n] = {k: st[k] if all(x in st for x in keys) else torch.zeros_like(w) for k in keys}
    return out


def _check(got, ref, muon_names, case):
    for n, w in ref.weights.items():
        assert torch.equal(got.weights[n].reshape(w.shape).float(), w.float()), f"{case}: weight {n}"
    for n, keys in _expected(ref, muon_names).items():
        for k, want in keys.items():
            have = got.state.get(n, {}).get(k)
            have = torch.zeros_like(want) if have is None else torch.as_tensor(have).reshape(want.shape)
            assert torch.equal(have.float(), want.float()), f"{case}: {n} {k}"


@pytest.mark.filterwarnings("ignore:ds_muon.muon_param_groups")
@pytest.mark.parametrize("move", CASES, ids=_id)
def test_move_twice_in_one_process(move, sources, tmp_path):
    src, groups, to, fresh = move
    path, ref = sources(src, groups)
    ours = _muon_names(PARAMS)
    dst = str(tmp_path / ("out.pt" if to == "torch" else "out"))
    results = []
    for run in range(2):
        if groups == "other" and not fresh:
            with pytest.raises(ValueError, match="lm_head.weight takes AdamW .* Muon's state .* fresh=True"):
                cv.convert(path, dst, make_model(), to=to, settings=PARAMS)
            assert not os.path.exists(dst), "a refused conversion left something at dst"
        else:
            with pytest.warns(UserWarning, match="lm_head.weight") if groups == "other" else _nothing():
                assert cv.convert(path, dst, make_model(), to=to, settings=PARAMS, fresh=fresh) == dst
            got = _read_back(to, dst)
            _check(got, ref, ours, f"{_id(move)} run {run}")
            results.append(got)
        assert set(os.listdir(tmp_path)) <= {os.path.basename(dst), "latest_universal"}, \
            f"leftovers beside dst: {os.listdir(tmp_path)}"
    if to == "universal" and results:
        with open(tmp_path / "latest_universal") as f:
            assert f.read() == "out"


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("to", ["torch", "dcp"])
def test_a_write_that_fails_leaves_dst_as_it_was(to, sources, tmp_path, monkeypatch):
    """The writer stops half way (it has written part of its output): the earlier checkpoint at dst is
    untouched, bit for bit, and nothing is left beside it."""
    import ds_muon.conversion.write as write

    path, _ = sources(("torch",), "same")
    dst = str(tmp_path / ("out.pt" if to == "torch" else "out"))
    cv.convert(path, dst, make_model(), to=to, settings=PARAMS)
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(dst) for f in fs) if to == "dcp" else [dst]
    before = {f: open(f, "rb").read() for f in files}

    def half_way(model, muon, out):
        os.makedirs(out) if to == "dcp" else None
        with open(os.path.join(out, "part") if to == "dcp" else out, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(write, f"write_{to}", half_way)
    with pytest.raises(OSError, match="No space left"):
        cv.convert(path, dst, make_model(), to=to, settings=PARAMS)
    after = sorted(os.path.join(r, f) for r, _, fs in os.walk(dst) for f in fs) if to == "dcp" else [dst]
    assert after == files and all(open(f, "rb").read() == before[f] for f in files)
    assert os.listdir(tmp_path) == [os.path.basename(dst)]
