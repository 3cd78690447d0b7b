"""The engine: where each matrix lives, and how one step moves it to its home and back.

Nothing here knows a training stack or a model; adapters (:mod:`ds_muon.integrations`) describe the
pieces, the rules (:mod:`ds_muon.rules`) do the maths.  In the order a step meets them:

* settings and state: :mod:`.groups` (group defaults and validation), :mod:`.state_check`;
* the check: :mod:`.agreement` (the step's one small all_reduce and what it decides), with
  :mod:`.identity` (which optimizer steps what), :mod:`.copies` (replicas that must agree) and
  :mod:`.extremes`;
* layout: :mod:`.layout` (pieces per rank, the vocabulary every package speaks), :mod:`.slots` and
  :mod:`.tag_keys` (tags → matrix slots);
* plan: :mod:`.compile` → :mod:`.planner` (homes against traffic, the cost model), :mod:`.costs` (the
  planner's numbers per strategy, ``ds-muon plan``), :mod:`.timeouts` (the exchange's own groups);
* exchange: :mod:`.exchange` (one all_to_all each way), :mod:`.pieces` (a rank's pieces of one layout),
  :mod:`.team` (one matrix's NS across a team of ranks);
* rule state: :mod:`.row_moments` (NorMuon's second moment: at home after NS, shared with every rank);
* memory: :mod:`.lending`, :mod:`.budget`, :mod:`.offload` (host-held state);
* overlap: :mod:`.overlap` (gathers from backward, updates in forward);
* reporting: :mod:`.summary`, :mod:`.summary_file`.
"""
