"""Checkpoints from elsewhere are data, not code; bad files are one line naming the file and what to do.

Hostile files: a pickle whose unpickling would call :func:`plant` (which writes a marker file) planted in a
torch file, in one file of a universal folder, of a ZeRO folder (DeepSpeed's converter unpickles fully), in
DCP's ``.metadata`` and in a DCP non-tensor item.  Through ``ds_muon.convert`` and ``ds-muon convert`` the
marker never appears, the message names the file and the global, nothing is written at ``dst``; with
``trust_checkpoint=True`` / ``--trust-checkpoint`` the file loads (and the marker shows it ran).  A ZeRO resume
at W=2 (``engine.load_checkpoint``) refuses the planted model-states file on every rank.

Bad files, generated (seeded): truncated at drawn lengths (every file kind of every format), a folder of one
format given as another, a checkpoint of another model, an optimizer state dict of other groups: each a
ValueError of one line naming the file, with a fix, nothing at ``dst``.
"""

import os
import pickle
import random
import shutil

import pytest
import torch

import dist_harness

pytest.importorskip("deepspeed")

from ds_muon import convert as cv  # noqa: E402
from ds_muon.cli import main  # noqa: E402
from ds_muon.setup.build import build_optimizer  # noqa: E402
from test_deepspeed import ENV, PARAMS, TinyLM, batch, ds_config, make_model, train  # noqa: E402

SEED = int(os.environ.get("DS_MUON_BAD_FILES_SEED", "7"))
CUTS = int(os.environ.get("DS_MUON_BAD_FILES_CUTS", "1"))  # truncation lengths drawn per file
FULL = os.environ.get("DS_MUON_BAD_FILES_FULL") == "1"  # every bad case (else one drawn per kind of fault and format)
GLOBAL = "test_checkpoint_files.plant"


def plant(path):
    """What a hostile checkpoint would run: here, only a marker file."""
    with open(path, "w") as f:
        f.write("ran")
    return None


class Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return plant, (self.marker,)


def other_model():
    torch.manual_seed(0)
    m = TinyLM()
    m.gate, m.proj = torch.nn.Linear(m.mix.out_features, 10, bias=False), torch.nn.Linear(10, m.mix.out_features,
                                                                                           bias=False)
    return m


def _zero_worker(rank, world, folder):
    from ds_muon import deepspeed as ds_muon_deepspeed

    engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=ds_config(2))
    train(engine, 1)
    engine.save_checkpoint(folder, tag="t")
    return True


def _hostile_resume_worker(rank, world, folder, marker):
    """Every rank: the planted model-states file is refused before DeepSpeed reads anything."""
    from ds_muon import deepspeed as ds_muon_deepspeed
    from ds_muon.integrations.safe_load import UntrustedCheckpoint

    engine, _, _, _ = ds_muon_deepspeed.initialize(model=make_model(), config=ds_config(2))
    try:
        engine.load_checkpoint(folder, tag="t")
    except UntrustedCheckpoint as e:
        return str(e), os.path.exists(marker)
    return None, os.path.exists(marker)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """One checkpoint of each format (TinyLM, ds_muon's groups): torch file, DCP, ZeRO-2 at W=2, universal."""
    root = tmp_path_factory.mktemp("good")
    with dist_harness.one_thread():
        model = make_model()
        muon = build_optimizer(model, dict(PARAMS, log_summary=False))
        model(*batch(0)).backward()
        muon.step()
    out = {"torch": cv.write_torch(model, muon, str(root / "state.pt")),
           "dcp": cv.write_dcp(model, muon, str(root / "dcp"))}
    dist_harness.run(_zero_worker, 2, str(root / "zero"), env=ENV, timeout=300)
    out["deepspeed"] = str(root / "zero" / "t")
    from ds_muon.integrations.deepspeed_universal import zero_to_universal

    out["universal"] = zero_to_universal(out["deepspeed"], str(root / "universal" / "t_universal"))
    out["root"] = str(root)
    out["model"], out["muon"] = model, muon
    return out


def _copy(src, dst):
    (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, dst)
    return str(dst)


def _plant_torch_file(path, marker):
    """The file loaded (trusted: it is ours) with a Hostile object added beside its data, saved again."""
    obj = torch.load(path, weights_only=False)
    if isinstance(obj, dict):
        obj["note"] = Hostile(marker)
    else:
        obj = {"param": obj, "note": Hostile(marker)}
    torch.save(obj, path)


def _planted(good, fmt, tmp_path, marker):
    """(a copy of the ``fmt`` checkpoint with a Hostile object in one of its files, that file)."""
    src = _copy(good[fmt], tmp_path / f"src_{fmt}")
    if fmt == "torch":
        target = src
    elif fmt == "universal":
        target = os.path.join(src, "zero", "up.weight", "momentum_buffer.pt")
    elif fmt == "deepspeed":
        target = os.path.join(src, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    if fmt == "dcp":
        target = os.path.join(src, ".metadata")
        with open(target, "rb") as f:
            meta = pickle.load(f)
        meta.storage_meta.modules = [Hostile(marker)]
        with open(target, "wb") as f:
            pickle.dump(meta, f)
    else:
        _plant_torch_file(target, marker)
    return src, target


def _one_line_naming(message, path):
    assert "\n" not in message.strip(), message
    assert os.fspath(path) in message, (path, message)


@pytest.mark.parametrize("fmt", ["torch", "universal", "deepspeed", "dcp"])
def test_hostile_file_runs_nothing(fmt, good, tmp_path, capsys):
    from ds_muon.integrations.safe_load import UntrustedCheckpoint

    marker = str(tmp_path / "marker")
    src, target = _planted(good, fmt, tmp_path, marker)
    dst = str(tmp_path / "out.pt")
    with pytest.raises(UntrustedCheckpoint) as err:
        cv.convert(src, dst, make_model(), to="torch", settings=PARAMS)
    _one_line_naming(str(err.value), target)
    assert GLOBAL in str(err.value) and "trust_checkpoint=True" in str(err.value)
    argv = ["convert", src, dst, "--to", "torch", "--model", "test_deepspeed:make_model", "--set", "lr=0.02",
            "momentum=0.95", "adam_lr=0.003", "weight_decay=0.01"]
    with pytest.raises(SystemExit) as code:
        main(argv)
    said = capsys.readouterr().err
    assert code.value.code == 2 and GLOBAL in said and "--trust-checkpoint" in said, said
    _one_line_naming(said, target)
    assert not os.path.exists(marker), "unpickling ran the planted code"
    assert not os.path.exists(dst)
    # the opt-in: the file is unpickled fully (the marker shows the code ran) and the conversion succeeds
    assert main(argv + ["--trust-checkpoint"]) == 0
    assert os.path.exists(marker) and os.path.exists(dst)
    os.remove(marker), os.remove(dst)
    cv.convert(src, dst, make_model(), to="torch", settings=PARAMS, trust_checkpoint=True)
    assert os.path.exists(marker) and os.path.exists(dst)


def test_hostile_dcp_item_runs_nothing(good, tmp_path):
    """A non-tensor item of a DCP checkpoint (which DCP unpickles fully) holding code."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ds_muon.conversion.write import one_rank_group

    from ds_muon.integrations.safe_load import UntrustedCheckpoint

    marker = str(tmp_path / "marker")
    with one_rank_group():
        msd, osd = get_state_dict(good["model"], good["muon"])
        dcp.save({"model": msd, "optim": osd, "note": Hostile(marker)}, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(UntrustedCheckpoint, match=f"{tmp_path / 'dcp'} \\(item note\\) holds {GLOBAL}"):
        cv.convert(str(tmp_path / "dcp"), str(tmp_path / "out.pt"), make_model(), to="torch", settings=PARAMS)
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "out.pt")


@pytest.mark.parametrize("planted", ["mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_hostile_resume_refused_on_every_rank(planted, good, tmp_path):
    """The model-states file (which ds_muon's check reads) and rank 1's optimizer states (which only DeepSpeed's
    load would read, unpickling fully)."""
    marker = str(tmp_path / "marker")
    folder = _copy(os.path.dirname(good["deepspeed"]), tmp_path / "zero")
    target = os.path.join(folder, "t", planted)
    _plant_torch_file(target, marker)
    said = dist_harness.run(_hostile_resume_worker, 2, folder, marker, env=ENV, timeout=300)
    for message, ran in said:
        assert message is not None and not ran
        _one_line_naming(message, target)
        assert GLOBAL in message and "DS_MUON_TRUST_CHECKPOINT=1" in message
    assert not os.path.exists(marker)


# -- bad files, generated ------------------------------------------------------------------------------------
def _files_of(path, fmt):
    """The files a conversion of ``fmt`` reads (a universal one reads only its ``zero/<tensor>/`` files)."""
    if os.path.isfile(path):
        return [path]
    found = sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs
                   if f.endswith((".pt", ".distcp")) or f == ".metadata")
    if fmt == "universal":
        found = [f for f in found if os.path.dirname(os.path.dirname(f)) == os.path.join(path, "zero")]
    return found


def _bad_cases(good, root):
    """(name, src, source, model factory, the path the message must name) for every bad input drawn."""
    rng = random.Random(SEED)
    cases = []
    for fmt in ("torch", "dcp", "deepspeed", "universal"):
        kinds = {}
        for f in _files_of(good[fmt], fmt):  # one file of each kind (name without the rank / tensor)
            kinds.setdefault((os.path.basename(f).split("_rank")[0].split("__")[0], os.path.dirname(f) == good[fmt]), f)
        for i, f in enumerate(sorted(kinds.values())):
            for c in range(CUTS):
                size = os.path.getsize(f)
                cut = rng.randrange(0, size)
                copy = _copy(good[fmt], os.path.join(root, f"trunc_{fmt}_{i}_{c}"))
                victim = os.path.join(copy, os.path.relpath(f, good[fmt])) if os.path.isdir(copy) else copy
                with open(victim, "r+b") as h:
                    h.truncate(cut)
                cases.append((f"truncated {fmt} {os.path.relpath(f, good['root'])} at {cut}/{size}", copy, "auto",
                              make_model, copy))
    for given in ("dcp", "deepspeed", "universal"):
        for claimed in ("dcp", "deepspeed", "universal", "torch"):
            if claimed != given:
                cases.append((f"a {given} folder as --source {claimed}", good[given], claimed, make_model,
                              good[given]))
    unrelated = os.path.join(root, "unrelated")
    os.makedirs(unrelated, exist_ok=True)
    with open(os.path.join(unrelated, "notes.txt"), "w") as f:
        f.write("not a checkpoint")
    cases.append(("a folder of no format", unrelated, "auto", make_model, unrelated))
    for fmt in ("torch", "dcp", "deepspeed", "universal"):
        cases.append((f"a {fmt} checkpoint of another model", good[fmt], "auto", other_model, good[fmt]))
    sd = torch.load(good["torch"], weights_only=False)
    for g in sd["optim"]["param_groups"]:
        g["param_names"] = [f"other.{n}" for n in g["param_names"]]
    torch.save(sd, os.path.join(root, "other_names.pt"))
    cases.append(("an optimizer state dict of other tensors", os.path.join(root, "other_names.pt"), "auto",
                  make_model, os.path.join(root, "other_names.pt")))
    sd = torch.load(good["torch"], weights_only=False)
    for g in sd["optim"]["param_groups"]:
        del g["param_names"]
    torch.save(sd, os.path.join(root, "unnamed.pt"))
    cases.append(("an optimizer state dict whose groups name nothing", os.path.join(root, "unnamed.pt"), "auto",
                  make_model, os.path.join(root, "unnamed.pt")))
    sd = torch.load(good["torch"], weights_only=False)
    sd["optim"]["param_groups"] = sd["optim"]["param_groups"][:1]
    torch.save(sd, os.path.join(root, "one_group.pt"))
    cases.append(("an optimizer state dict with one of its two groups", os.path.join(root, "one_group.pt"), "auto",
                  make_model, os.path.join(root, "one_group.pt")))
    return cases


FIXES = ("give", "pass", "copy", "convert", "build")


def test_bad_files_one_line_naming_the_file(good, tmp_path):
    cases = _bad_cases(good, str(tmp_path))
    assert len(cases) >= 20
    rng = random.Random(SEED)
    if not FULL:  # one case per kind of fault (its name up to the format's first word)
        by_kind = {}
        for case in cases:
            by_kind.setdefault(" ".join(case[0].split()[:2]), []).append(case)
        cases = [rng.choice(group) for _, group in sorted(by_kind.items())]
    problems, kinds = [], set()
    for name, src, source, factory, named in cases:
        to = rng.choice(("torch", "dcp", "universal"))
        dst = str(tmp_path / ("out.pt" if to == "torch" else "out"))
        try:
            cv.convert(src, dst, factory(), to=to, source=source, settings=PARAMS)
            problems.append((name, to, "converted"))
            continue
        except ValueError as e:
            message, kinds = str(e), kinds | {type(e).__name__}
        except BaseException as e:  # noqa: BLE001 - anything else (DCP's CheckpointException too) is a failure
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            problems.append((name, to, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"))
            continue
        if "\n" in message or named not in message or not any(w in message.lower() for w in FIXES):
            problems.append((name, to, f"not one line naming the file with a fix: {message}"))
        if os.path.exists(dst) or any(n.startswith(".out") for n in os.listdir(tmp_path)):
            problems.append((name, to, "something was left at dst"))
    print(f"bad files: {len(cases) - len({p[0] for p in problems})} of {len(cases)} hold")
    assert not problems, "\n".join(map(str, problems[:10]))
    assert "UnreadableCheckpoint" in kinds
