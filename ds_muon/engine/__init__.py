"""The engine: where each matrix lives, and how one step moves it to its home and back.

Nothing here knows a training stack or a model; adapters (:mod:`ds_muon.integrations`) describe the
pieces, the rules (:mod:`ds_muon.rules`) do the maths.  One subpackage per stage, each importing
only the stages below it (``tools/import_graph.py`` checks), bottom up:

* :mod:`.memory` — budgets, lent buffers, host-held state;
* :mod:`.exchange` — layouts (the pieces of every matrix), routes, the fused all_to_all each way;
* :mod:`.agreement` — settings, state checks and the step's one all_reduce, before anything is written;
* :mod:`.plan` — homes, teams and waves, compiled once per set of active matrices;
* :mod:`.overlap` — gathers from backward, updates in the next forward;
* :mod:`.report` — ``summary()``;
* :mod:`.moved` — the old module paths (one release more, with a DeprecationWarning);

and, at the top, what one optimizer's steps hold and run:

* :mod:`.binding` — the bindings and layouts of the Muon tensors, from the stack's adapter;
* :mod:`.state` — the state keys of every tensor (momentum, AdamW moments, FSDP1 placeholders);
* :mod:`.pickling` — what a copy of the optimizer carries; older state dicts' groups brought up to date;
* :mod:`.runtime` — one step through the stages, in order (what ``Muon.step`` runs), and every cache
  and hook the steps keep (``Muon.runtime``).
"""
