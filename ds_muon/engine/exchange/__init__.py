"""Exchange: where every piece of a matrix lives, and how the pieces travel to their home and back.

* :mod:`.layout` — the vocabulary every package speaks: a :class:`~.layout.Piece` of a matrix, a
  tensor's :class:`~.layout.ParamBinding` (its :class:`~.layout.MatrixSlot` s), the :class:`~.layout.Layout`
  of one process group (built and checked on every rank: the pieces partition each matrix);
* :mod:`.slots` — the matrix slots a tensor's tags (:mod:`ds_muon.tensors.tag_keys`) make;
* :mod:`.copies` — which ranks hold identical copies of a shard (for the agreement);
* :mod:`.routes` — who sends a home each piece, which home sends each result back (replica groups);
* :mod:`.all_to_all` — the fused exchange: pack, one ``all_to_all_single`` each way, unpack into the
  stack's own buffers; :mod:`.pieces` — this rank's pieces of one wave, for the update's foreach calls;
* :mod:`.row_moments` — NorMuon's second moment, updated at home after NS and shared with every rank;
* :mod:`.row_scale` — a rank's piece of a matrix multiplied in place by a factor per output feature (QK-clip).

Imports: :mod:`~ds_muon.engine.memory` and :mod:`ds_muon.rules` only.
"""

from ..moved import forward_names

__getattr__ = forward_names(__name__, "ds_muon.engine.exchange", "ds_muon.engine.exchange.all_to_all")
