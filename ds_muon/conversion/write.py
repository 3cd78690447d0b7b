"""ds_muon's state written as a torch file (one process, DDP), a DCP checkpoint (FSDP2, any world size) or a
DeepSpeed universal checkpoint (ZeRO-1/2/3, any world size), the last through a one-rank DsMuon engine."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Dict, Optional

import torch
from torch import nn

from ..optimizer import Muon
from ..setup.deepspeed_initialize import initialize
from .named import ADAMW_KEYS, MUON_KEYS, NORMUON_V

TARGETS = ("universal", "dcp", "torch")


def write_torch(model: nn.Module, muon: Muon, path: str) -> str:
    torch.save({"model": model.state_dict(), "optim": muon.state_dict()}, path)
    return path


def write_dcp(model: nn.Module, muon: Muon, folder: str) -> str:
    """``{"model", "optim"}`` as ``get_state_dict`` gives them (FQN-keyed optimizer state), saved with DCP: FSDP2
    at any world size loads it with ``dcp.load`` + ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with one_rank_group():
        msd, osd = get_state_dict(model, muon)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    return folder


@contextlib.contextmanager
def one_rank_group():
    """A gloo group of one rank while ``body`` runs, when the caller has none (DeepSpeed and DCP writers)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def write_universal(model: nn.Module, muon: Muon, folder: str, config: Optional[dict] = None,
                    tag: Optional[str] = None) -> str:
    """A DeepSpeed universal checkpoint of ``model`` and ``muon``'s state: a one-rank ZeRO-1 DsMuon engine
    (``config``'s DsMuon entry and settings) is given the state through DeepSpeed's
    ``safe_set_full_optimizer_state``, saves with ``save_checkpoint``, and is converted by
    :func:`ds_muon.integrations.deepspeed_universal.zero_to_universal` into ``folder`` (``latest_universal`` beside it)."""
    from deepspeed.utils import safe_set_full_optimizer_state

    from ..integrations.deepspeed_universal import zero_to_universal

    cfg = dict(config or {})
    cfg.setdefault("optimizer", {"type": "DsMuon", "params": {}})
    cfg["train_micro_batch_size_per_gpu"] = 1
    cfg.pop("train_batch_size", None)
    cfg["zero_optimization"] = dict(cfg.get("zero_optimization") or {}, stage=1)
    cfg.pop("checkpoint", None)
    by_name = {}
    for g in muon.param_groups:
        for p, n in zip(g["params"], g["param_names"]):
            by_name[n] = (g["use_muon"], muon.state[p])
    held = [n for n, (_, st) in by_name.items() if NORMUON_V in st]
    if held:
        raise NotImplementedError(
            f"ds_muon.convert: {held[0]} (and {len(held) - 1} more) holds NorMuon's second moment ({NORMUON_V!r}), "
            "which this writer cannot lay out per DeepSpeed flat partition yet; nothing was written. Convert to a "
            "torch file or DCP, or convert the DeepSpeed checkpoint itself (zero_to_universal carries it)")
    with one_rank_group(), tempfile.TemporaryDirectory() as tmp:
        engine, _, _, _ = initialize(model=model, config=cfg)
        target = engine.basic_optimizer
        ours = {n for g in target.param_groups for n in g["param_names"]}
        if ours != set(by_name):
            raise ValueError(f"ds_muon.convert: the DeepSpeed config groups the tensors otherwise than the settings "
                             f"given ({sorted(ours ^ set(by_name))[:5]}); pass the same settings to both")
        target.runtime.fill_state()  # every group's state, so each tensor's fragment of it is linked below
        engine.optimizer._lazy_init_hp_params_optimizer_state()
        steps = {}
        for n, p in engine.module.named_parameters():
            use_muon, st = by_name[n]
            for k in (MUON_KEYS if use_muon else ADAMW_KEYS):
                safe_set_full_optimizer_state(p, st[k], k)
            if not use_muon:
                steps[n] = st["step"]
        if steps:
            first = next(iter(steps.values()))
            if any(not torch.equal(s, first) for s in steps.values()):
                raise ValueError("ds_muon.convert: the AdamW tensors have different step counts; ZeRO keeps one per "
                                 "group")
            for flat, st in target.state.items():
                if "step" in st:
                    st["step"] = first.clone()
        tag = tag or os.path.basename(os.path.abspath(folder))
        engine.save_checkpoint(tmp, tag=tag)
        return zero_to_universal(os.path.join(tmp, tag), folder)


def write(to: str, model: nn.Module, muon: Muon, dst: str, config: Optional[dict] = None,
          settings: Optional[Dict[str, Any]] = None) -> str:
    """Write ``muon`` (and ``model``'s weights) as ``to`` at ``dst``; returns what was written."""
    if to == "torch":
        return write_torch(model, muon, dst)
    if to == "dcp":
        return write_dcp(model, muon, dst)
    if config is None:
        config = {"optimizer": {"type": "DsMuon", "params": dict(settings or {})}}
    return write_universal(model, muon, dst, config)
