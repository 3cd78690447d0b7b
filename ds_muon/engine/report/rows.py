"""What ``Muon.summary()`` returns: a row per tensor (with its matrices) and per rank, in a :class:`Summary`
whose ``str()`` is the table, saved as JSON for ``ds-muon plan --summary`` (read back, every field checked,
by :mod:`.summary_file`).  Built from the optimizer's own decisions by :mod:`.summary`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from .summary_file import summary_from_dict

MB = 1e6
PLANNED = "planned at the first step"  # the homes and rank columns of a summary made before the first step


@dataclass(frozen=True)
class MatrixRow:
    """One logical matrix Newton–Schulz orthogonalizes."""

    key: str  # e.g. "...experts.gate_up_proj[3][gate]": tensor name, then expert and block
    shape: Tuple[int, int]  # the 2-D matrix NS sees (rows, cols)
    scale: float  # the update's scale factor
    homes: Tuple[int, ...]  # global ranks that run its NS (every rank in mode="duplicated")
    ns_flops: float  # of one NS run
    held: Tuple[int, ...]  # elements each rank of its domain holds (the planner's input)
    domain: int  # index of its layout (one per process group; MoE expert domains have their own)
    ns_steps: int
    ns_method: str
    wire_bytes: int  # bytes per element of its gather
    groups: Tuple[Tuple[int, ...], ...] = ()  # replica groups of its domain (HSDP; the planner's input too)
    team: int = 0  # team size when a team of ranks (``homes``) runs its NS in column blocks (ds_muon.engine.plan.team), else 0


@dataclass(frozen=True)
class TensorRow:
    """One tensor of ``param_groups``."""

    name: str
    group: int  # index in param_groups
    algorithm: str  # "Muon", "AdamW", or "Muon+AdamW" (an FSDP1 flat shard holding both)
    reason: str
    shape: Tuple[int, ...]  # as the optimizer sees it (a ZeRO/FSDP1 flat shard is 1-D)
    matrices: Tuple[MatrixRow, ...] = ()
    evidence: str = ""  # what decided it: trace, config, module type, name, include=/exclude= ("": not recorded)


@dataclass(frozen=True)
class RankRow:
    """What one optimizer step costs one rank."""

    rank: int  # global rank
    matrices: int  # NS runs at this rank
    ns_flops: float
    bytes_sent: int  # gather and scatter together, per step
    bytes_received: int

    @property
    def bytes_moved(self) -> int:
        return self.bytes_sent + self.bytes_received


@dataclass
class Summary:
    """:meth:`ds_muon.Muon.summary`: rows per tensor (with their matrices) and per rank; ``str()`` is a table."""

    tensors: List[TensorRow]
    ranks: List[RankRow]
    world_size: int
    rank: int
    mode: str
    planner: str
    waves: int
    domains: int = 1
    notes: List[str] = field(default_factory=list)
    cost_model: Optional[dict] = None  # the rates the optimizer planned with (CostModel fields)
    qk_clip: Optional[dict] = None  # QK-clip: tau, alpha, steps, heads clipped (last step, total), last S_max per head
    ns: str = ""  # the NS dtype and method each Muon group runs, "auto" resolved (ds_muon.rules.ns_auto)

    # -- counts ------------------------------------------------------------------
    @property
    def muon_tensors(self) -> int:
        return sum(t.algorithm != "AdamW" for t in self.tensors)

    @property
    def adamw_tensors(self) -> int:
        return sum(t.algorithm == "AdamW" for t in self.tensors)

    @property
    def matrices(self) -> List[MatrixRow]:
        return [m for t in self.tensors for m in t.matrices]

    def max_ns_gflop(self) -> float:
        return max((r.ns_flops for r in self.ranks), default=0.0) / 1e9

    def max_mb_moved(self) -> float:
        return max((r.bytes_moved for r in self.ranks), default=0) / MB

    def log_line(self) -> str:
        return (f"ds_muon: {self.muon_tensors} tensors Muon ({len(self.matrices)} matrices), {self.adamw_tensors} "
                f"AdamW; per step, busiest rank: NS {self.max_ns_gflop():.4g} GFLOP, {self.max_mb_moved():.4g} MB "
                f"moved (sent + received); world {self.world_size}, mode {self.mode}, planner {self.planner}"
                + (f"; {self.ns}" if self.ns else "")
                + " (Muon.summary() prints the table; log_summary=False turns this line off)")

    # -- the planner's table -------------------------------------------------------
    def plan_rows(self, strategies: Optional[Sequence[str]] = None, cost_model=None) -> List[dict]:
        """The ``ds-muon plan`` table (:func:`ds_muon.engine.plan.costs.compare`) for this run's own matrices and
        holdings: the optimizer's strategy next to the baselines, on what each rank really holds, at
        the rates the optimizer planned with (unless ``cost_model`` is given)."""
        from ..plan import costs
        from ..plan.cost_model import CostModel, MatrixTask

        rows = self.matrices
        if len({m.domain for m in rows}) > 1:
            raise ValueError("Summary.plan_rows: this optimizer plans in several domains (process groups); the "
                             "planner's table compares one domain at a time")
        if not rows:
            return []
        tasks = [MatrixTask(m.shape[0], m.shape[1], m.ns_steps, m.wire_bytes, m.held, m.ns_method, m.groups)
                 for m in rows]  # the optimizer's planner input (compile_exchanges), replica groups included
        if cost_model is None:
            cost_model = CostModel(**self.cost_model) if self.cost_model else CostModel()
        return costs.compare(tasks, len(rows[0].held), cost_model,
                             costs.STRATEGIES if strategies is None else strategies)

    # -- saved for ``ds-muon plan --summary`` ------------------------------------------
    def save(self, path: str) -> None:
        """Write the summary as JSON (``ds-muon plan --summary PATH`` reads it)."""
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Summary":
        """The summary :meth:`save` wrote; a file that is not one (edited, crafted, truncated) raises
        ValueError naming the field (:mod:`ds_muon.engine.report.summary_file`)."""
        with open(path) as f:
            try:
                d = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"Summary file {path!r} is not JSON: {e}") from None
        try:
            return summary_from_dict(d, cls, TensorRow, MatrixRow, RankRow)
        except ValueError as e:
            raise ValueError(f"{path!r}: {e}") from None

    # -- the table -------------------------------------------------------------------
    def __str__(self) -> str:
        head = (f"ds_muon.Muon summary: {self.muon_tensors} tensors Muon ({len(self.matrices)} matrices), "
                f"{self.adamw_tensors} AdamW; world {self.world_size} (computed on rank {self.rank}), mode "
                f"{self.mode}, planner {self.planner}, {self.waves} wave(s)"
                + (f", {self.domains} domains" if self.domains > 1 else "") + (f"\n{self.ns}" if self.ns else ""))
        table = [("tensor", "algo", "why", "by", "shape", "matrix", "rows x cols", "scale", "home")]
        for t in self.tensors:
            shape = "x".join(map(str, t.shape))
            single = len(t.matrices) == 1 and t.matrices[0].key == t.name
            first = t.matrices[0] if single else None
            table.append((t.name, t.algorithm, t.reason, t.evidence, shape, *(_matrix_cells(first, t.name) if first else
                          ("", "", "", "") if not t.matrices else (f"{len(t.matrices)} matrices:", "", "", ""))))
            if not single:
                table.extend(("", "", "", "", "", *_matrix_cells(m, t.name)) for m in t.matrices)
        ranks = [("rank", "NS matrices", "NS GFLOP", "sent", "received")]
        ranks += [(str(r.rank), str(r.matrices), f"{r.ns_flops / 1e9:.4g}", _bytes(r.bytes_sent),
                   _bytes(r.bytes_received)) for r in self.ranks] or [("all", PLANNED, "", "", "")]
        out = [head, _format(table), "", "per rank, per step:", _format(ranks)]
        if self.qk_clip is not None:
            out += ["", _qk_clip_lines(self.qk_clip)]
        return "\n".join(out + self.notes)


def _qk_clip_lines(q: dict) -> str:
    """QK-clip's settings, how many heads it clipped and each attention module's last S_max per head."""
    lines = [f"QK-clip (tau {q['tau']:g}, alpha {q['alpha']:g}): {q['clipped_heads']} head(s) clipped in the last "
             f"step, {q['clipped_total']} over {q['steps']} step(s); last S_max per head:"]
    table = [("attention", "S_max per head")]
    table += [(name, " ".join(f"{x:.4g}" for x in s)) for name, s in q["s_max"].items()]
    return "\n".join(lines + ([_format(table)] if q["s_max"] else ["(no step yet)"]))


def _matrix_cells(m: MatrixRow, name: str) -> Tuple[str, str, str, str]:
    key = m.key[len(name):] if m.key.startswith(name) and m.key != name else m.key
    # several homes: mode="duplicated" (every rank) or planner="auto"'s extra homes (some ranks)
    homes = ",".join(map(str, m.homes)) if len(m.homes) <= 4 else f"{len(m.homes)} ranks"
    if not m.homes:
        homes = PLANNED  # summarize_planned: one rank alone before the first step
    if m.team:
        homes = f"team of {m.team}: {homes}"
    return (key if key != name else "", f"{m.shape[0]} x {m.shape[1]}", f"{m.scale:.4g}", homes)


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"


def _format(rows: List[tuple]) -> str:
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)
