"""DeepSpeed's universal checkpoint layout, for every optimizer state key (Muon's momentum too).

DeepSpeed's universal layout keeps one folder per parameter name, ``zero/<name>/<key>.pt``, so a
checkpoint written at one world size (and ZeRO stage) loads at any other with
``"checkpoint": {"load_universal": true}``.  DeepSpeed 0.19.8's converter
(``deepspeed/checkpoint/ds_to_universal.py``) names the AdamW keys: ``extract_zero_shards`` reads
``state[group]["exp_avg"]`` of every param group, so any group whose state is a Muon momentum
(ds_muon's Muon group, DeepSpeed's own ``"type": "muon"`` group) stops it with ``KeyError:
'exp_avg'`` (deepspeed#8608), and its merge and ZeRO-3 loader copy only ``fp32``, ``exp_avg`` and
``exp_avg_sq``.  :func:`zero_to_universal` is the same conversion over whatever keys each group's
state holds, built from DeepSpeed's own reader (``DeepSpeedCheckpoint``), fragment writer and merge;
:func:`load_zero3_universal` is ZeRO-3's universal load over those keys (ZeRO-1/2's already reads
whatever files a parameter's folder holds).  NorMuon's ``normuon_v`` is no per-element key: it goes to
``normuon_v/group<i>.pt`` beside ``zero/``, one file per flat partition (:func:`load_moments` puts it back,
at ZeRO-1/2 through ds_muon's wrapper of the engine's universal load).  Tensor and pipeline parallel checkpoints are left to
DeepSpeed's converter (ds_muon does not run under ZeRO with either).
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, List, Optional

import torch

from .safe_load import check_folder, load

FP32 = "fp32"
STEP = "step"


def _ds():
    from deepspeed.checkpoint import ds_to_universal as d2u

    return d2u


def _flat_keys(state: dict, flat: torch.Tensor) -> List[str]:
    """The per-element state keys of one flat partition (1-D tensors at least as long as it: the checkpoint reader
    strips the partition's alignment padding from the fp32 partition, not from the state), plus ``step``."""
    keys = [k for k, v in state.items()
            if k != MOMENT and torch.is_tensor(v) and v.dim() == 1 and v.numel() >= flat.numel()]
    return keys + ([STEP] if STEP in state else [])


MOMENT = "normuon_v"  # NorMuon's second moment (ds_muon.engine.exchange.row_moments): whole per matrix, not per element
MOMENTS_DIR = "normuon_v"  # beside zero/: one file per flat partition (ZeRO-1/2 group, ZeRO-3 sub-group)


def _dump_moments(states, output_folder: str) -> None:
    """NorMuon's ``v`` of each flat partition, ``normuon_v/group<i>.pt``.  It is one value per output neuron of
    every matrix of the partition, whole on every rank (not a fragment: DeepSpeed's per-element ``zero/<name>/``
    files have no place for it), and a partition's matrices do not depend on the world size (a ZeRO-1/2 group
    holds its param group's tensors, a ZeRO-3 sub-group its ``sub_group_size`` run), so it loads into the
    partition of the same index at any world size (:func:`load_moments`)."""
    for i, st in states:
        if isinstance(st, dict) and MOMENT in st:
            os.makedirs(os.path.join(output_folder, MOMENTS_DIR), exist_ok=True)
            torch.save(st[MOMENT].detach().float().clone(), os.path.join(output_folder, MOMENTS_DIR, f"group{i}.pt"))


def load_moments(flats: List[torch.Tensor], state, checkpoint_folder: str) -> None:
    """The ``v`` :func:`_dump_moments` wrote into ``state[flats[i]]`` (as float32 on the partition's device).
    A partition of another stage or grouping gets a ``v`` of another length: the step refuses it, naming it."""
    for i, flat in enumerate(flats):
        f = os.path.join(checkpoint_folder, MOMENTS_DIR, f"group{i}.pt")
        if os.path.isfile(f):
            state[flat][MOMENT] = load(f).to(flat.device, torch.float32)


def _extract_zero12(ckpt, temp_dir: str, dp_index: int, output_folder: str) -> None:
    d2u = _ds()
    from deepspeed.checkpoint.constants import (BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT, PARAM_SLICE_MAPPINGS,
                                                SINGLE_PARTITION_OF_FP32_GROUPS)

    sd = ckpt.get_zero_checkpoint_state(pp_index=0, tp_index=0, dp_index=dp_index)[OPTIMIZER_STATE_DICT]
    states, fp32_groups = sd[BASE_OPTIMIZER_STATE]["state"], sd[SINGLE_PARTITION_OF_FP32_GROUPS]
    if dp_index == 0:  # (whole on every rank)
        _dump_moments(states.items(), output_folder)
    for gi, mappings in enumerate(sd[PARAM_SLICE_MAPPINGS]):
        state = states.get(gi, {})
        flat = {FP32: fp32_groups[gi], **{k: state[k] for k in _flat_keys(state, fp32_groups[gi])}}
        for name, frag in mappings.items():
            for key, value in flat.items():
                d2u.dump_param_fragment(temp_dir, 0, dp_index, key, value, name, frag.start, frag.numel)


def _extract_zero3(optim_file: str, shapes: List[dict], temp_dir: str, dp_index: int, dp_degree: int,
                   output_folder: str) -> None:
    d2u = _ds()
    sd = load(optim_file)["optimizer_state_dict"]
    if dp_index == 0:
        _dump_moments(sd["optimizer_state_dict"]["state"].items(), output_folder)
    partitions = sd.get("ds_zero_partition_groups") or []
    for idx, sub_group in enumerate(shapes):
        fp32 = sd["fp32_flat_groups"][idx]
        state = sd["optimizer_state_dict"]["state"].get(idx, {})
        flat = {FP32: fp32, **{k: state[k] for k in _flat_keys(state, fp32)}}
        meta = partitions[idx] if idx < len(partitions) else {}
        count, rank = meta.get("partition_count", dp_degree), meta.get("partition_rank", dp_index)
        offset = 0
        for name, shape in sub_group.items():
            numel = d2u._shape_numel(shape)
            part, _ = d2u._zero_partitioned_param_info(numel, count)
            held = max(0, min(part, numel - rank * part))
            for key, value in flat.items():
                d2u.dump_param_fragment(temp_dir, 0, dp_index, key, value, name, offset, held)
            offset += part


def _merge(temp_dir: str, zero_dir: str, shapes: Dict[str, torch.Size]) -> None:
    d2u = _ds()
    from deepspeed.checkpoint.constants import PARAM

    for name, shape in shapes.items():
        base = os.path.join(temp_dir, name, "0")
        keys = sorted({f.rsplit(".", 1)[0] for f in os.listdir(base)}) if os.path.isdir(base) else []
        for key in keys:
            merged = d2u._merge_zero_shards(os.path.join(temp_dir, name), key, 1)[0]
            out = os.path.join(zero_dir, name, f"{key}.pt")
            d2u._save_checkpoint(out, merged if key == STEP else {PARAM: merged.view(shape)})


def _save_optimizer_state_stage3(optim_file: str, zero_dir: str) -> None:
    """``zero/optimizer_state.pt`` of a ZeRO-3 checkpoint, as DeepSpeed 0.19.8's ``_save_optimizer_state_stage3``
    writes it plus the ``ds_version`` its ZeRO-1/2 universal load asserts on (DeepSpeed keeps it one level
    up at ZeRO-3 and drops it): without it a ZeRO-3 checkpoint did not load at ZeRO-1/2."""
    from deepspeed.checkpoint.constants import DS_VERSION, OPTIMIZER_STATE_DICT, PARAM_GROUPS

    sd = load(optim_file)
    out = sd[OPTIMIZER_STATE_DICT]
    out[PARAM_GROUPS] = out[OPTIMIZER_STATE_DICT][PARAM_GROUPS]
    if not out.get(DS_VERSION) and sd.get(DS_VERSION):
        out[DS_VERSION] = sd[DS_VERSION]
    os.makedirs(zero_dir, exist_ok=True)
    torch.save(out, os.path.join(zero_dir, "optimizer_state.pt"))


def zero_to_universal(input_folder: str, output_folder: str) -> str:
    """DeepSpeed's ``ds_to_universal`` for a ZeRO-1/2/3 checkpoint folder (one tag), over every
    state key of every group; writes ``output_folder`` and ``latest_universal`` beside it (as DeepSpeed's
    converter does) and returns ``output_folder``.
    Load it with ``"checkpoint": {"load_universal": true}`` at any data-parallel world size.  DeepSpeed's
    reader unpickles fully, so every file of ``input_folder`` is read weights-only first (:mod:`.safe_load`)."""
    d2u = _ds()
    check_folder(input_folder)
    optim_files = d2u._get_optim_files(input_folder)
    zero3_files = d2u._filter_zero3_optim_files(optim_files)
    stage = d2u._get_zero_stage(zero3_files or optim_files)
    temp_dir = os.path.join(output_folder, "tmp")
    zero_dir = os.path.join(output_folder, "zero")
    args = type("Args", (), {"output_folder": output_folder})()
    if stage <= 2:
        from deepspeed.checkpoint import DeepSpeedCheckpoint

        ckpt = DeepSpeedCheckpoint(input_folder)
        if ckpt.tp_degree != 1 or ckpt.pp_degree != 1:
            raise NotImplementedError(f"ds_muon.integrations.deepspeed_universal: {input_folder} has tensor/pipeline parallel degree "
                                      f"{ckpt.tp_degree}/{ckpt.pp_degree}; use DeepSpeed's ds_to_universal for it")
        for dp in range(ckpt.dp_degree):
            _extract_zero12(ckpt, temp_dir, dp, output_folder)
        model_state = load(ckpt.mp_rank_files[0])
        shapes = {n: s for group in model_state["param_shapes"] for n, s in group.items()}
        _merge(temp_dir, zero_dir, shapes)
        d2u._save_optimizer_state(args, ckpt)
        model_files = ckpt.mp_rank_files
    else:
        model_files = d2u._get_zero3_model_state_files(input_folder)
        grid, tp, dp_degree = d2u._build_zero3_rank_grid(zero3_files)
        if tp != 1:
            raise NotImplementedError(f"ds_muon.integrations.deepspeed_universal: {input_folder} is tensor parallel ({tp}); use DeepSpeed's "
                                      "ds_to_universal for it")
        shapes_by_group = d2u._parse_model_states_stage3(model_files)
        for dp in range(dp_degree):
            _extract_zero3(grid[0][dp], shapes_by_group, temp_dir, dp, dp_degree, output_folder)
        _merge(temp_dir, zero_dir, {n: s for g in shapes_by_group for n, s in g.items()})
        _save_optimizer_state_stage3(zero3_files[0], zero_dir)
    shutil.rmtree(temp_dir, ignore_errors=True)
    for f in model_files:
        shutil.copy2(f, output_folder)
    root, tag = os.path.split(os.path.abspath(output_folder))
    with open(os.path.join(root, "latest_universal"), "w") as f:
        f.write(tag)
    return output_folder


def read_universal(folder: str) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{name: {key: tensor}}`` of a universal checkpoint (``fp32``, ``momentum_buffer``, ``exp_avg``, ...;
    ``step`` as saved), each tensor in the parameter's shape."""
    from deepspeed.checkpoint.constants import PARAM

    zero_dir = os.path.join(folder, "zero")
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for name in sorted(os.listdir(zero_dir)):
        path = os.path.join(zero_dir, name)
        if not os.path.isdir(path):
            continue
        out[name] = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".pt"):
                v = load(os.path.join(path, f))
                out[name][f[:-3]] = v[PARAM] if isinstance(v, dict) else v
    return out


def universal_groups(folder: str) -> List[dict]:
    """The param groups saved beside a universal checkpoint (``zero/optimizer_state.pt``)."""
    sd = load(os.path.join(folder, "zero", "optimizer_state.pt"))
    groups = sd.get("param_groups")
    if groups is None:  # ZeRO-3 keeps them one level down
        groups = sd.get("optimizer_state_dict", {}).get("param_groups", [])
    return groups


def load_zero3_universal(zero3, checkpoint_folder: str) -> None:
    """ZeRO-3's universal load (``DeepSpeedZeroOptimizer_Stage3._load_universal_checkpoint`` with optimizer
    states) over every key a parameter's folder holds, with each group's own settings: DeepSpeed 0.19.8's loads
    ``exp_avg``/``exp_avg_sq`` only, reads ``step`` from sub-group 0 and gives every group group 0's settings."""
    zero_dir = os.path.join(checkpoint_folder, "zero")
    saved_groups = universal_groups(checkpoint_folder)
    for sub, fp16_group in enumerate(zero3.fp16_groups):
        fp32_param = zero3.fp32_partitioned_groups_flat[sub]
        names = [zero3.param_names[p] for p in fp16_group]
        keys = sorted(set.intersection(*[{f[:-3] for f in os.listdir(os.path.join(zero_dir, n)) if f.endswith(".pt")}
                                          for n in names])) if names else []
        step: Optional[object] = None
        for key in keys:
            if key == STEP:
                step = load(os.path.join(zero_dir, names[0], "step.pt"))
                continue
            flat = torch.zeros_like(fp32_param)
            offset = 0
            for p, n in zip(fp16_group, names):
                part = zero3.load_hp_checkpoint_state(os.path.join(zero_dir, n), key, param=p)
                flat.narrow(0, offset, part.numel()).copy_(part)
                offset += part.numel()
            if key == FP32:
                fp32_param.data.copy_(flat)
            else:
                zero3.optimizer.state[fp32_param][key] = flat
        if step is not None:
            zero3.optimizer.state[fp32_param][STEP] = step
    load_moments(list(zero3.fp32_partitioned_groups_flat), zero3.optimizer.state, checkpoint_folder)
    for group, saved in zip(zero3.optimizer.param_groups, saved_groups):
        for k, v in saved.items():
            if k != "params":
                group[k] = v
    for sub, fp32_param in enumerate(zero3.fp32_partitioned_groups_flat):
        if fp32_param.numel() > 0:
            zero3.fp16_partitioned_groups_flat[sub].data.copy_(fp32_param.data)
    for sub, flat16 in enumerate(zero3.fp16_partitioned_groups_flat):
        for part, q in zip(zero3.fp16_partitioned_groups[sub], zero3.unflatten(flat16, zero3.fp16_partitioned_groups[sub])):
            part.data = q.data
