"""Plan: from a layout's matrices that step to compiled exchanges, once per set of active matrices.

* :mod:`.cost_model` — what a matrix at given homes costs each rank (:class:`~.cost_model.CostModel`,
  :class:`~.cost_model.MatrixTask`, :class:`~.cost_model.Plan`, the traffic each exchange moves);
* :mod:`.planner` — home ranks (LPT against traffic, extra homes for replicas, local moves, duplication);
* :mod:`.team_plan` — which step-bounding matrices a team of ranks orthogonalizes, and the homes moved
  off the ranks those teams load;
* :mod:`.team` — team NS itself: one matrix orthogonalized by its team in column blocks, and its exchange;
* :mod:`.compile` — the plan compiled: homes, wire dtypes, waves of bounded memory, NS settings per
  stack of same-shape matrices, into :class:`~ds_muon.engine.exchange.all_to_all.Exchange` objects
  cached across steps (:class:`~.compile.ExchangeCache`);
* :mod:`.costs` — what each strategy costs a step per rank (``ds-muon plan``); :mod:`.mesh_costs` — the
  same on a 2-D mesh (``ds-muon plan --mesh``).

Imports: :mod:`~ds_muon.engine.agreement`, :mod:`~ds_muon.engine.exchange`, :mod:`~ds_muon.engine.memory`
and :mod:`ds_muon.rules` only.
"""
