"""The :class:`ds_muon.Muon` inside a DeepSpeed engine bound to the engine's flat partitions.

The adapter (:class:`~ds_muon.integrations.deepspeed.DeepSpeedAdapter`) describes where each matrix's
pieces live and never sees the optimizer; binding is where the two meet, after ``deepspeed.initialize``.
"""

from __future__ import annotations

from ..integrations.base import FLAT_PARTITION
from ..integrations.deepspeed import DeepSpeedAdapter, check_no_deepspeed_muon_tags
from ..integrations.deepspeed_checkpoint import guard_loads
from ..integrations.moe import tag_deepspeed_moe
from ..unwrap import find_muon


def bind(engine, optimizer=None):
    """Attach a :class:`~ds_muon.integrations.deepspeed.DeepSpeedAdapter` to the ``ds_muon.Muon`` inside ``engine``; returns the Muon.

    Call once, after ``deepspeed.initialize`` (``ds_muon.deepspeed.initialize`` does it
    for you).  ``engine`` is the DeepSpeedEngine (with accelerate: the prepared model).
    """
    muon = optimizer if optimizer is not None else find_muon(engine, required=False)
    if muon is None:
        raise ValueError(
            f"ds_muon: {type(engine).__name__} holds no ds_muon.Muon (its optimizer is "
            f"{type(getattr(engine, 'optimizer', None)).__name__}); pass the DeepSpeed engine that was built "
            "with a ds_muon.Muon")
    if not hasattr(engine, "optimizer"):
        raise ValueError(f"ds_muon: bind() needs the DeepSpeed engine, got {type(engine).__name__}")
    names = dict(getattr(engine, "param_names", None) or {})
    check_no_deepspeed_muon_tags(list(engine.module.parameters()), names)
    tag_deepspeed_moe(engine.module)  # expert parameters: their expert data-parallel domain
    adapter = DeepSpeedAdapter(engine, wrapped=engine.optimizer is not muon)
    for t in adapter.flat_partitions():
        setattr(t, FLAT_PARTITION, True)  # 1-D flat partitions that hold matrices
    muon.attach(adapter)
    guard_loads(engine, muon)  # checkpoints whose groups differ are refused before anything loads
    return muon
