"""``ds-muon convert``: optimizer state moved between checkpoint formats by tensor name, re-grouped by ds_muon.

Every format is read into one neutral form, ``Named``: the model's weights and each tensor's optimizer
state (``momentum_buffer`` for Muon, ``exp_avg`` / ``exp_avg_sq`` / ``step`` for AdamW), keyed by the
tensor's name in the model.  Sources:

* a DeepSpeed ZeRO-1/2/3 checkpoint (ds_muon's ``"type": "DsMuon"`` or DeepSpeed's ``"type": "muon"``):
  DeepSpeed's universal conversion over every state key (:mod:`ds_muon.integrations.deepspeed_universal`), then read by name;
* a DeepSpeed universal checkpoint (a folder with ``zero/``);
* a DCP checkpoint (FSDP2/FSDP1 ``get_state_dict`` saved as ``{"model": ..., "optim": ...}``, any world
  size): ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``, then as a torch file;
* a torch file or dict with the model's state dict and one or more optimizer state dicts that name their
  tensors (``param_names`` in each group, as torch optimizers record when built from
  ``model.named_parameters()``; FQN-keyed state as DCP's full state dicts) — or live optimizers
  (torch.optim.Muon + AdamW, Keller's ``MuonWithAuxAdam``, any torch optimizer) with the model they step.

The state is then given to ds_muon's own groups (:func:`ds_muon.muon_param_groups` of the model: which
tensors take Muon is ds_muon's decision, never the source's), matched by name and shape, and written as a
plain ds_muon state dict (``{"model", "optim"}``, for one process, DDP and accelerate's DDP), a DCP
checkpoint (FSDP2 at any world size) or a DeepSpeed universal checkpoint (ZeRO-1/2/3 at any world size,
``"checkpoint": {"load_universal": true}``), the last through a one-rank DsMuon engine's own
``save_checkpoint``.  A tensor whose source state is another algorithm's (a source that put it in Muon
where ds_muon puts it in AdamW, or the reverse) is an error naming it unless ``fresh=True``, which starts
just those tensors' state at zero and lists them in a warning.

The code lives in :mod:`ds_muon.conversion` (one module per phase: read, regroup, write, and the
command's arguments), which ``ds-muon convert`` shares; this module is where users import it from.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from torch import nn

from .conversion.arguments import load_factory, resolve_config
from .conversion.named import ADAMW_KEYS, MUON_KEYS, NORMUON_V, Named
from .conversion.read import (FORMATS, detect_format, named_state, read, read_dcp, read_deepspeed, read_torch,
                              read_universal_named)
from .conversion.regroup import build, load_named, load_state_from
from .conversion.write import TARGETS, check_target, write, write_dcp, write_torch, write_universal

__all__ = ["convert", "Named", "MUON_KEYS", "NORMUON_V", "ADAMW_KEYS", "FORMATS", "TARGETS", "detect_format", "read",
           "read_universal_named", "read_deepspeed", "read_torch", "read_dcp", "named_state", "load_named",
           "load_state_from", "build", "write", "write_torch", "write_dcp", "write_universal", "resolve_config",
           "load_factory"]


def convert(src, dst: str, model: nn.Module, to: str = "universal", source: str = "auto",
            settings: Optional[Dict[str, Any]] = None, config: Optional[dict] = None, fresh: bool = False,
            param_names=None, trust_checkpoint: bool = False) -> str:
    """``src`` (any source format) → ``dst`` in ds_muon's groups for ``model``: ``to`` is ``"universal"``
    (DeepSpeed, any ZeRO stage and world size), ``"dcp"`` (FSDP2, any world size) or ``"torch"`` (one file).
    Every file of ``src`` is read as data only (weights-only) unless ``trust_checkpoint``; nothing is written
    at ``dst`` unless the whole conversion succeeds."""
    if to not in TARGETS:
        raise ValueError(f"ds_muon.convert: to={to!r} is unknown; use one of {list(TARGETS)}")
    config, settings = resolve_config(config, settings)
    check_target(to, os.path.abspath(os.fspath(dst)))  # before anything is read
    try:
        muon = build(model, read(src, source, param_names, trust_checkpoint=trust_checkpoint), settings, fresh=fresh)
    except ValueError as e:  # every message names the source
        if isinstance(src, (str, os.PathLike)) and e.args and os.fspath(src) not in str(e.args[0]):
            e.args = (f"{e.args[0]} [source: {os.fspath(src)}]",) + e.args[1:]
        raise
    return write(to, model, muon, dst, config, settings)
