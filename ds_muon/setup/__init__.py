"""What the front doors share, so that no door imports another: a Muon set up for a stack.

* ``dsmuon_entry.py``: the ``"type": "DsMuon"`` entry of a DeepSpeed config: read, checked, taken out.
* ``build.py``: a :class:`ds_muon.Muon` over :func:`ds_muon.muon_param_groups` from settings (an entry's
  ``params``, or the keyword settings of ``prepare`` and ``MuonTrainer``).
* ``deepspeed_bind.py``: the Muon inside a DeepSpeed engine bound to the engine's partitions.
* ``deepspeed_initialize.py``: ``deepspeed.initialize`` that builds or takes a Muon and binds it.
* ``accelerate_fsdp2.py``: accelerate's FSDP launches run FSDP2, also on CPU-only machines.

Each module imports the optimizer's face (``optimizer``, ``param_groups``, ``qk_clip``, ``unwrap``), the
integrations, models, engine and rules, never a front door; DeepSpeed and accelerate are imported only
inside the functions that call them.
"""
