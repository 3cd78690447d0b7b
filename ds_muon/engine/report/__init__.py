"""Report: what the optimizer does with each tensor and what a step costs each rank.

* :mod:`.summary` — ``Muon.summary()`` (per tensor: Muon or AdamW and why, matrices, scales, homes; per
  rank: NS FLOPs and bytes), before the first step from this rank's metadata alone;
* :mod:`.rows` — what it returns: the rows, the :class:`~.rows.Summary` holding them, its table and JSON;
* :mod:`.summary_file` — reading a saved summary back, every field checked.

Imports: every other stage (it describes them), never the step runtime.
"""
