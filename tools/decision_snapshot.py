"""Every tensor's decision, written down so that two trees can be compared: ``python tools/decision_snapshot.py
OUT.json [--only ...] [--beyond diffusers,litgpt]`` then ``--compare A.json B.json``.

For each model the census builds (every transformers family, every diffusers class and litgpt config with
``--beyond``, and the config-less models of ``tests/trace_models.py`` and ``tests/map_models.py``) and each of
a few settings (the default, rules only with ``trace=False``, per-head attention splits, whole fused
projections with routers on Muon), it records per parameter what :func:`ds_muon.muon_param_groups` decided:
the group (Muon or AdamW), kind, reason, the evidence that decided, and the tags left on the tensor (blocks,
orientation, experts).  A refactor of the model map must leave the file unchanged; a failure to build or a
refusal is recorded as its message, so it must stay the same too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))
sys.path.insert(0, os.path.join(HERE, os.pardir))

SETTINGS = {
    "default": {},
    "rules only": {"trace": False},
    "heads": {"split_attention": "heads"},
    "whole, routers on Muon": {"split_fused": False, "routers": "muon", "trace": False},
}


def _tags(p) -> list:
    from ds_muon.tensors.tag_keys import shape_tags

    return sorted((k, repr(v)) for k, v in (shape_tags(p) or {}).items())


def decisions(build, settings: dict) -> dict:
    """``{name: [group, kind, reason, evidence, tags]}`` of a freshly built model, or ``{"error": message}``."""
    import ds_muon

    try:
        model = build()
    except Exception as e:  # noqa: BLE001 - a snapshot records what happened
        return {"error": f"build: {type(e).__name__}"}
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            groups = ds_muon.muon_param_groups(model, **settings)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    out = {}
    for g in groups:
        for i, (name, p) in enumerate(zip(g["param_names"], g["params"])):
            out[name] = ["muon" if g["use_muon"] else "adamw", g["param_kinds"][i], g["param_reasons"][i],
                         g["param_evidence"][i], _tags(p)]
    return out


def models(only, beyond):
    """``(label, build)`` for every model of the snapshot, in a fixed order."""
    import census

    for family in census.families():
        if only and family not in only:
            continue

        def build(family=family):
            for tiny in (True, False):
                try:
                    return census.build(family, tiny)
                except Exception:  # noqa: BLE001
                    if not tiny:
                        raise
        yield f"transformers:{family}", build
    for lib in beyond:
        names = census.diffusers_classes() if lib == "diffusers" else census.litgpt_configs()
        maker = census.build_diffusers if lib == "diffusers" else census.build_litgpt
        for name in names:
            if only and name not in only:
                continue

            def build(name=name, maker=maker):
                for tiny in (True, False):
                    try:
                        return maker(name, tiny)
                    except Exception:  # noqa: BLE001
                        if not tiny:
                            raise
            yield f"{lib}:{name}", build
    if not only:
        import map_models
        import trace_models

        for name, fn in sorted(trace_models.FAMILIES.items()):
            yield f"trace_models:{name}", fn
        for name in sorted(n for n in dir(map_models) if n[:1].isupper()):
            cls = getattr(map_models, name)
            if isinstance(cls, type):
                try:
                    cls()
                except Exception:  # noqa: BLE001 - needs arguments
                    continue
                yield f"map_models:{name}", cls


def compare(a: str, b: str) -> int:
    one, two = json.load(open(a)), json.load(open(b))
    diffs = 0
    for key in sorted(set(one) | set(two)):
        if one.get(key) != two.get(key):
            diffs += 1
            x, y = one.get(key) or {}, two.get(key) or {}
            names = sorted(n for n in set(x) | set(y) if x.get(n) != y.get(n))
            print(f"{key}: {len(names)} differ")
            for n in names[:4]:
                print(f"    {n}\n      before {x.get(n)}\n      after  {y.get(n)}")
    print(f"{len(one)} / {len(two)} entries, {diffs} differ")
    return 1 if diffs else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--only", default="")
    ap.add_argument("--beyond", default="")
    ap.add_argument("--compare", nargs=2)
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    only = [s for s in args.only.split(",") if s]
    beyond = [s for s in args.beyond.split(",") if s]
    result, t0 = {}, time.time()
    for label, build in models(only, beyond):
        for setting, kwargs in SETTINGS.items():
            result[f"{label} | {setting}"] = decisions(build, kwargs)
        print(f"{time.time() - t0:7.1f}s {label}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=0, sort_keys=True)
    print(f"{len(result)} entries in {time.time() - t0:.0f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
