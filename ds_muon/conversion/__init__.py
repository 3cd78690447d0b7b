"""Checkpoint conversion by tensor name, shared by ``ds_muon.convert`` and ``ds-muon convert`` (``ds_muon.cli``).

* ``named.py``: ``Named``, the neutral form: weights and each tensor's optimizer state by its name in the model.
* ``read.py``: every source format (DeepSpeed ZeRO and universal, DCP, torch files, live optimizers) as ``Named``.
* ``regroup.py``: that state given to ds_muon's own groups, matched by name and shape.
* ``write.py``: a torch file, a DCP checkpoint or a DeepSpeed universal checkpoint.
* ``arguments.py``: the command's ``--set``, ``--config`` and ``--model`` as settings, config and model.

Imports the optimizer's face, :mod:`ds_muon.setup` (the DsMuon entry, a one-rank engine) and the
integrations, never a front door.
"""
