"""How long ``planner="auto"`` (the default) takes to plan, next to what it plans.

No processes: :func:`ds_muon.engine.plan.planner.plan_multi_homes` on preset shapes under DDP (every rank
holds every matrix whole: the case with the most candidate homes) and ZeRO/FSDP1 partitions,
with the default cost model.  Per row: the modelled step of the one-home ``locality`` plan,
of ``auto`` and of duplicating every NS, homes per matrix, and this process's CPU seconds
to plan (wall time beside it: the machine is shared).  Planning is paid once per compiled
set of active matrices.
"""

from __future__ import annotations

import time

from common import header, table

from ds_muon.engine.plan import costs
from ds_muon.cli import load_shapes
from ds_muon.engine.plan.cost_model import CostModel
from ds_muon.engine.plan.planner import plan_multi_homes

CASES = [("gpt-125m", 8, "replicated"), ("gpt-125m", 64, "replicated"), ("llama-1b", 8, "replicated"),
         ("llama-1b", 64, "replicated"), ("llama-7b", 1024, "replicated"), ("llama-7b", 4096, "replicated"),
         ("llama-70b", 64, "replicated"), ("llama-70b", 1024, "replicated"), ("llama-7b", 4096, "partitioned"),
         ("llama-70b", 4096, "partitioned")]


def main() -> None:
    header("planner='auto': planning time and modelled step (default CostModel)")
    cm = CostModel()
    rows = []
    for preset, world, layout in CASES:
        tasks = costs.tasks_for([s for _, s in load_shapes(preset)], world, layout)
        cpu, wall = time.process_time(), time.perf_counter()
        homes = plan_multi_homes(tasks, world, cm, "auto")
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        by = {r["strategy"]: r["modelled_step_ms"] for r in costs.compare(tasks, world, cm, ("locality", "duplicated", "auto"))}
        rows.append((preset, world, layout, by["locality"], by["auto"], round(sum(map(len, homes)) / len(homes), 1),
                     by["duplicated"], round(cpu, 3), round(wall, 3)))
    table(["preset", "W", "layout", "locality ms", "auto ms", "homes/matrix", "duplicated ms", "plan CPU s",
           "plan wall s"], rows)


if __name__ == "__main__":
    main()
