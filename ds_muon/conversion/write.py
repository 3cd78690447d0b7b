"""ds_muon's state written as a torch file (one process, DDP), a DCP checkpoint (FSDP2, any world size) or a
DeepSpeed universal checkpoint (ZeRO-1/2/3, any world size), the last through a one-rank DsMuon engine."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
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
        ds_comm = sys.modules.get("deepspeed.comm.comm")
        if ds_comm is not None and getattr(ds_comm, "cdb", None) is not None:
            # DeepSpeed's own destroy also drops the groups it cached (deepspeed.utils.groups): a second engine
            # in this process would otherwise ask the destroyed group for its ranks ("is not registered")
            ds_comm.destroy_process_group()
        else:
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
                if k in st:  # (a tensor started fresh has none: fill_state's zeros stay)
                    safe_set_full_optimizer_state(p, st[k], k)
            if not use_muon and "step" in st:
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


def check_target(to: str, dst: str) -> None:
    """Before any work: ``dst`` can take what ``to`` writes (a file path for ``torch``; a new or empty folder, or
    a checkpoint of the same kind that it replaces, for ``dcp`` and ``universal``)."""
    if to == "torch":
        if os.path.isdir(dst):
            raise ValueError(f"ds_muon.convert: {dst} is a folder and to='torch' writes one file; give a file path")
        return
    if os.path.isfile(dst):
        raise ValueError(f"ds_muon.convert: {dst} is a file and to={to!r} writes a folder; give a folder path")
    marker = ".metadata" if to == "dcp" else "zero"
    if os.path.isdir(dst) and os.listdir(dst) and not os.path.exists(os.path.join(dst, marker)):
        raise ValueError(f"ds_muon.convert: {dst} is a folder holding other files, not a {to} checkpoint (no "
                         f"{marker}) to replace; give a new or empty folder")


def _move_into_place(staged: str, dst: str, scratch: str) -> None:
    """``staged`` becomes ``dst`` by renames in one folder: a folder already at ``dst`` is moved aside (into
    ``scratch``, removed with it) only once ``staged`` is whole, and put back if the last rename fails."""
    if not os.path.isdir(staged):
        os.replace(staged, dst)
        return
    aside = None
    if os.path.lexists(dst):
        aside = os.path.join(scratch, "replaced")
        os.rename(dst, aside)
    try:
        os.rename(staged, dst)
    except OSError:
        if aside is not None:
            os.rename(aside, dst)
        raise


def write(to: str, model: nn.Module, muon: Muon, dst: str, config: Optional[dict] = None,
          settings: Optional[Dict[str, Any]] = None) -> str:
    """Write ``muon`` (and ``model``'s weights) as ``to`` at ``dst``; returns what was written.  Everything is
    written under a temporary name in ``dst``'s folder and renamed to ``dst`` once whole: a conversion that
    fails leaves nothing at ``dst`` (and an earlier checkpoint there as it was)."""
    if to not in TARGETS:
        raise ValueError(f"ds_muon.convert: to={to!r} is unknown; use one of {list(TARGETS)}")
    dst = os.path.abspath(os.fspath(dst))
    check_target(to, dst)
    parent, name = os.path.split(dst)
    if to != "torch":
        os.makedirs(parent, exist_ok=True)  # (as DCP and DeepSpeed's savers make a checkpoint folder's parents)
    scratch = tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=parent)
    try:
        staged = os.path.join(scratch, name)  # the final name: DeepSpeed's tag and latest_universal are right
        if to == "torch":
            write_torch(model, muon, staged)
        elif to == "dcp":
            write_dcp(model, muon, staged)
        else:
            if config is None:
                config = {"optimizer": {"type": "DsMuon", "params": dict(settings or {})}}
            write_universal(model, muon, staged, config)
        _move_into_place(staged, dst, scratch)
        latest = os.path.join(scratch, "latest_universal")
        if os.path.isfile(latest):
            os.replace(latest, os.path.join(parent, "latest_universal"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return dst
