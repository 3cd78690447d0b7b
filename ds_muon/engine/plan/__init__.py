"""Plan: from a layout's matrices that step to compiled exchanges, once per set of active matrices.

* :mod:`.planner` — home ranks (LPT against traffic, the cost model, extra homes for replicas);
* :mod:`.team` — team NS: one step-bounding matrix orthogonalized by a team of ranks in column blocks;
* :mod:`.compile` — the plan compiled: homes, wire dtypes, waves of bounded memory, NS settings per
  stack of same-shape matrices, into :class:`~ds_muon.engine.exchange.all_to_all.Exchange` objects
  cached across steps (:class:`~.compile.ExchangeCache`);
* :mod:`.costs` — what each strategy costs a step per rank (``ds-muon plan``).

Imports: :mod:`~ds_muon.engine.agreement`, :mod:`~ds_muon.engine.exchange`, :mod:`~ds_muon.engine.memory`
and :mod:`ds_muon.rules` only.
"""
