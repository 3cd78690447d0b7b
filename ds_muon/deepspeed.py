"""``ds_muon.deepspeed.initialize``: DeepSpeed with ds_muon, from the same JSON file.

The config entry::

    "optimizer": {"type": "DsMuon",
                  "params": {"lr": 0.02, "momentum": 0.95, "adam_lr": 3e-4, "weight_decay": 0.0}}

``params`` accepts every :class:`ds_muon.Muon` keyword that JSON can express
(dtypes as strings such as ``"bfloat16"``, tuples as lists, ``cost_model`` as an
object of :class:`~ds_muon.engine.plan.planner.CostModel` fields) plus ``adam_lr`` and
``adam_weight_decay`` (the AdamW group of :func:`ds_muon.muon_param_groups`).
Everything else in the config goes to DeepSpeed unchanged, with
``zero_allow_untested_optimizer`` set.

Optimizer offload: ``"zero_optimization": {"offload_optimizer": {"device": "cpu",
"pin_memory": true}}`` works as written (``zero_force_ds_cpu_optimizer`` is set to
false for you: Muon, not DeepSpeed's CPU Adam, steps the host partition).  Momentum
and AdamW moments live beside the fp32 partition in host memory; the result is
bitwise the run without offload (docs/DEEPSPEED.md).

Binding: ``ds_muon.deepspeed.bind(engine)`` is the one spelling (after a
``deepspeed.initialize`` you called yourself; :func:`initialize`,
``ds_muon.accelerate.prepare`` and ``ds_muon.trainer.MuonTrainer`` call it).
(It moved here from ``ds_muon.integrations.deepspeed``, the adapter, which describes
partitions and never sees the optimizer.)

Gradient clipping: DeepSpeed's ``gradient_clipping`` (DeepSpeed 0.19.8 defaults it
to 1.0) clips the raw averaged gradient before ``Muon.step``; the orthogonalized
update is never clipped (its scale is set by ``lr`` and ``scale_mode``).

The code lives in :mod:`ds_muon.setup`, which the other front doors (accelerate, the Trainer,
Lightning, ``ds-muon convert``) share; this module is where users import it from.
"""

from __future__ import annotations

from .integrations.base import HOW_TO_BIND
from .setup.build import build_optimizer, optimizer_from_config
from .setup.deepspeed_bind import bind
from .setup.deepspeed_initialize import initialize
from .setup.dsmuon_entry import OPTIMIZER_TYPE, accepted_params, is_dsmuon_entry, load_config, parse_params

__all__ = ["initialize", "optimizer_from_config", "build_optimizer", "parse_params", "accepted_params", "load_config",
           "bind", "HOW_TO_BIND", "OPTIMIZER_TYPE", "is_dsmuon_entry"]
