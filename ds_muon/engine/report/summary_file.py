"""Reading a saved :class:`~ds_muon.engine.report.rows.Summary` (``Summary.save``; ``ds-muon plan --summary``).

The file is JSON a person may edit or craft, so every field is checked against the
dataclass it fills (present, no unknown ones, of its type) and against what the
planner's table will read from it (homes inside the world, one holding per rank of a
domain, a known NS method, the rates of a :class:`~ds_muon.engine.plan.cost_model.CostModel`).  Anything
else is a ValueError naming the path of the field, e.g. ``tensors[3].matrices[0].held``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict

from ...rules.newton_schulz import NS_METHODS
from ..plan.cost_model import CostModel


def _fail(where: str, what: str):
    raise ValueError(f"Summary file: {where}: {what}")


def _int(v, where: str, low: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        _fail(where, f"must be an integer >= {low}, got {v!r}")
    return v


def _num(v, where: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        _fail(where, f"must be a finite number >= 0, got {v!r}")
    return v


def _str(v, where: str) -> str:
    if not isinstance(v, str):
        _fail(where, f"must be a string, got {v!r}")
    return v


def _list(v, where: str) -> list:
    if not isinstance(v, list):
        _fail(where, f"must be a list, got {type(v).__name__}")
    return v


def _ints(v, where: str, low: int = 0) -> tuple:
    return tuple(_int(x, f"{where}[{k}]", low) for k, x in enumerate(_list(v, where)))


def _fields(d, cls, where: str) -> Dict[str, Any]:
    """``d`` as an object holding every required field of ``cls`` and no other."""
    if not isinstance(d, dict):
        _fail(where, f"must be an object, got {type(d).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        _fail(where, f"unknown field(s) {unknown}; a {cls.__name__} has {sorted(known)}")
    missing = sorted(n for n, f in known.items() if n not in d and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        _fail(where, f"missing field(s) {missing}")
    return d


def _matrix(d, where: str, MatrixRow):
    d = _fields(d, MatrixRow, where)
    shape = _ints(d["shape"], f"{where}.shape", 1)
    if len(shape) != 2:
        _fail(f"{where}.shape", f"must be [rows, cols], got {d['shape']!r}")
    method = _str(d["ns_method"], f"{where}.ns_method")
    if method not in NS_METHODS:
        _fail(f"{where}.ns_method", f"{method!r} is unknown; one of {list(NS_METHODS)}")
    groups = tuple(_ints(g, f"{where}.groups[{k}]") for k, g in enumerate(_list(d.get("groups", []), f"{where}.groups")))
    return MatrixRow(_str(d["key"], f"{where}.key"), shape, _num(d["scale"], f"{where}.scale"),
                     _ints(d["homes"], f"{where}.homes"), _num(d["ns_flops"], f"{where}.ns_flops"),
                     _ints(d["held"], f"{where}.held"), _int(d["domain"], f"{where}.domain"),
                     _int(d["ns_steps"], f"{where}.ns_steps", 1), method,
                     _int(d["wire_bytes"], f"{where}.wire_bytes", 1), groups)


def _tensor(d, where: str, TensorRow, MatrixRow):
    d = _fields(d, TensorRow, where)
    matrices = tuple(_matrix(m, f"{where}.matrices[{k}]", MatrixRow)
                     for k, m in enumerate(_list(d.get("matrices", []), f"{where}.matrices")))
    return TensorRow(_str(d["name"], f"{where}.name"), _int(d["group"], f"{where}.group"),
                     _str(d["algorithm"], f"{where}.algorithm"), _str(d["reason"], f"{where}.reason"),
                     _ints(d["shape"], f"{where}.shape"), matrices, _str(d.get("evidence", ""), f"{where}.evidence"))


def _rank(d, where: str, RankRow):
    d = _fields(d, RankRow, where)
    return RankRow(_int(d["rank"], f"{where}.rank"), _int(d["matrices"], f"{where}.matrices"),
                   _num(d["ns_flops"], f"{where}.ns_flops"), _int(d["bytes_sent"], f"{where}.bytes_sent"),
                   _int(d["bytes_received"], f"{where}.bytes_received"))


def _cost_model(d, where: str):
    if d is None:
        return None
    d = _fields(d, CostModel, where)
    for f in dataclasses.fields(CostModel):
        if f.name not in d:
            continue
        v, at = d[f.name], f"{where}.{f.name}"
        if isinstance(f.default, bool):
            if not isinstance(v, bool):
                _fail(at, f"must be true or false, got {v!r}")
        elif isinstance(f.default, str):
            _str(v, at)
        elif f.default is None:  # ranks_per_node: none (one flat link) or a count
            if v is not None:
                _int(v, at, 1)
        elif _num(v, at) <= 0 and f.default > 0:
            _fail(at, f"must be > 0, got {v!r}")
    try:
        CostModel(**d)
    except (TypeError, ValueError) as e:
        _fail(where, str(e))
    return d


def summary_from_dict(d, Summary, TensorRow, MatrixRow, RankRow):
    """The :class:`~ds_muon.engine.report.rows.Summary` a saved file holds, every field checked (see the module).
    (The classes are passed in: :mod:`ds_muon.engine.report.rows` imports this module.)"""
    d = _fields(d, Summary, "the file")
    world = _int(d["world_size"], "world_size", 1)
    tensors = [_tensor(t, f"tensors[{k}]", TensorRow, MatrixRow) for k, t in enumerate(_list(d["tensors"], "tensors"))]
    ranks = [_rank(r, f"ranks[{k}]", RankRow) for k, r in enumerate(_list(d["ranks"], "ranks"))]
    out = Summary(tensors, ranks, world, _int(d["rank"], "rank"), _str(d["mode"], "mode"),
                  _str(d["planner"], "planner"), _int(d["waves"], "waves", 1), _int(d.get("domains", 1), "domains", 1),
                  [_str(n, f"notes[{k}]") for k, n in enumerate(_list(d.get("notes", []), "notes"))],
                  _cost_model(d.get("cost_model"), "cost_model"), _qk_clip(d.get("qk_clip"), "qk_clip"),
                  _str(d.get("ns", ""), "ns"))
    _check_consistent(out)
    return out


def _qk_clip(q, where: str):
    """QK-clip's report (``ds_muon.QKClip.report``): settings, counts, S_max lists per attention module."""
    if q is None:
        return None
    if not isinstance(q, dict) or sorted(q) != ["alpha", "clipped_heads", "clipped_total", "s_max", "steps", "tau"]:
        _fail(where, "must be null or an object with tau, alpha, steps, clipped_heads, clipped_total, s_max")
    _num(q["tau"], f"{where}.tau"), _num(q["alpha"], f"{where}.alpha")
    for k in ("steps", "clipped_heads", "clipped_total"):
        _int(q[k], f"{where}.{k}")
    if not isinstance(q["s_max"], dict):
        _fail(f"{where}.s_max", "must be an object of lists of numbers")
    for name, s in q["s_max"].items():
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in _list(s, f"{where}.s_max.{name}")):
            _fail(f"{where}.s_max.{name}", "must be a list of numbers")
    return q


def _check_consistent(s) -> None:
    """What the planner's table (``Summary.plan_rows``) relies on: each domain's matrices hold one
    count per rank of that domain, homes and replica groups name ranks of the world."""
    held_len: Dict[int, int] = {}
    for ti, t in enumerate(s.tensors):
        for mi, m in enumerate(t.matrices):
            where = f"tensors[{ti}].matrices[{mi}]"
            n = held_len.setdefault(m.domain, len(m.held))
            if len(m.held) != n or not 1 <= n <= s.world_size:
                _fail(f"{where}.held", f"holds {len(m.held)} counts; every matrix of domain {m.domain} must hold "
                      f"one per rank of its domain ({n}, at most world_size={s.world_size})")
            numel = m.shape[0] * m.shape[1]
            if any(h > numel for h in m.held) or sum(m.held) < numel:
                _fail(f"{where}.held", f"each rank holds at most the matrix's {numel} elements and together at "
                      f"least all of them, got {list(m.held)}")
            if not m.homes or any(h >= s.world_size for h in m.homes):
                _fail(f"{where}.homes", f"must name one or more ranks below world_size={s.world_size}, "
                      f"got {list(m.homes)}")
            if m.groups and sorted(r for g in m.groups for r in g) != list(range(n)):
                _fail(f"{where}.groups", f"replica groups must split the domain's ranks 0..{n - 1}, got "
                      f"{[list(g) for g in m.groups]}")

