"""``engine.load_checkpoint`` for a ds_muon engine: refuse a checkpoint whose groups differ, before anything loads.

DeepSpeed loads a ZeRO checkpoint's flat fp32 partitions and optimizer state *by position*: a checkpoint
written by an optimizer that grouped the tensors otherwise (DeepSpeed's own ``"type": "muon"`` sorts its
Muon group, largest first) loads without a word and hands tensors other tensors' weights and momentum.
The checkpoint says what it holds: ``param_shapes`` in the model-states file (the names and shapes of
every group, in partition order, from ``engine._get_zero_param_shapes()``) and, for universal
checkpoints, the saved param groups (ds_muon's record ``param_names``) and one folder per tensor.
:func:`check_checkpoint` compares them with the engine's own and raises ``ValueError`` naming the first
tensor that differs and the conversion to run.  Every rank reads the same files, so every rank raises,
and it runs before DeepSpeed's ``load_checkpoint`` (which loads the module weights first) touches anything.
DeepSpeed unpickles every file of the checkpoint fully; each is read weights-only here first
(:mod:`.safe_load`), so one holding code is refused, naming it, before any of it runs.
"""

from __future__ import annotations

import functools
import glob
import os
from typing import List, Optional, Sequence, Tuple

import torch

from .safe_load import check_folder, load

CONVERT_HINT = ("convert it by tensor name with `ds-muon convert {src} OUT --model MODULE:FACTORY` (or "
                "ds_muon.convert.convert) and load OUT with \"checkpoint\": {{\"load_universal\": true}} "
                "(docs/CHECKPOINTS.md)")


def resolve_tag(load_dir: str, tag, universal: bool) -> Optional[str]:
    """The tag DeepSpeed's ``load_checkpoint`` will read (``latest`` / ``latest_universal`` when None)."""
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest_universal" if universal else "latest")
    if not os.path.isfile(latest):
        return None  # DeepSpeed warns (or raises) about this itself
    with open(latest) as f:
        return f.read().strip()


def first_difference(ours: Sequence[Sequence[Tuple[str, tuple]]],
                     theirs: Sequence[Sequence[Tuple[str, tuple]]]) -> Optional[str]:
    """Where two lists of groups of (name, shape) first differ, in words; None when equal."""
    for gi in range(max(len(ours), len(theirs))):
        a = list(ours[gi]) if gi < len(ours) else []
        b = list(theirs[gi]) if gi < len(theirs) else []
        for k in range(max(len(a), len(b))):
            x = a[k] if k < len(a) else None
            y = b[k] if k < len(b) else None
            if x is None or y is None or x[0] != y[0] or tuple(x[1]) != tuple(y[1]):
                def say(t):
                    return "nothing" if t is None else f"{t[0]} {list(t[1])}"
                return (f"param group {gi}, tensor {k}: the checkpoint has {say(y)}, this engine has {say(x)}"
                        f" ({len(b)} vs {len(a)} tensors in the group, {len(theirs)} vs {len(ours)} groups)")
    return None


def _shape_lists(param_shapes) -> List[List[Tuple[str, tuple]]]:
    return [[(n, tuple(s)) for n, s in g.items()] for g in (param_shapes or [])]


def _writer(model_state: dict) -> str:
    opt = (model_state.get("ds_config") or {}).get("optimizer") or {}
    kind = str(opt.get("type", "")) if isinstance(opt, dict) else ""
    if kind.lower() == "muon":
        return ' (it was written with DeepSpeed\'s built-in "type": "muon", which groups the tensors otherwise)'
    return f' (it was written with "type": "{kind}")' if kind else ""


def _model_state_file(engine, load_dir: str, tag: str) -> Optional[str]:
    own = engine._get_ckpt_name(load_dir, tag)
    if os.path.isfile(own):
        return own
    found = sorted(glob.glob(os.path.join(load_dir, tag, "*model_states.pt")))
    return found[0] if found else None


def _refuse(src: str, why: str) -> None:
    raise ValueError(f"ds_muon: the DeepSpeed checkpoint {src} does not match this engine: {why}. Nothing was "
                     f"loaded; {CONVERT_HINT.format(src=src)}")


def check_checkpoint(engine, muon, load_dir: str, tag=None, load_optimizer_states: bool = True,
                     load_module_only: bool = False) -> None:
    """ValueError, before anything is loaded, when the checkpoint ``engine.load_checkpoint(load_dir, tag)`` would
    read holds other groups, tensors or shapes than the engine, or (ZeRO, optimizer states) another DP world size."""
    universal = bool(engine.load_universal_checkpoint())
    tag = resolve_tag(load_dir, tag, universal)
    if tag is None or not engine.zero_optimization():
        return
    src = os.path.join(load_dir, tag)
    if os.path.isdir(src):
        check_folder(src)  # DeepSpeed's load unpickles every file fully: each is read as data first (safe_load)
    ours = _shape_lists(engine._get_zero_param_shapes())
    if universal:
        return check_universal(src, muon, ours, load_module_only or not load_optimizer_states,
                               bool(engine.zero_optimization_partition_weights()))
    path = _model_state_file(engine, load_dir, tag)
    if path is None:
        return  # DeepSpeed names the missing file
    saved = load(path, mmap=True)
    theirs = _shape_lists(saved.get("param_shapes"))
    diff = first_difference(ours, theirs) if theirs else None
    if diff:
        _refuse(src, diff + _writer(saved))
    saved_w = saved.get("dp_world_size")
    if load_optimizer_states and not load_module_only and saved_w is not None and saved_w != engine.seq_dp_world_size:
        _refuse(src, f"it was written at data-parallel world size {saved_w} and this engine runs at "
                     f"{engine.seq_dp_world_size} (ZeRO partitions are per world size; DeepSpeed would raise only "
                     "after loading the module weights)")


def universal_version(src: str):
    """The ``ds_version`` in a universal checkpoint's ``zero/optimizer_state.pt`` (None where it has none)."""
    sd = load(os.path.join(src, "zero", "optimizer_state.pt"))
    return sd.get("ds_version")


def check_universal(src: str, muon, ours: List[List[Tuple[str, tuple]]], weights_only: bool = False,
                    zero3: bool = True) -> None:
    """A universal checkpoint holds every tensor of the engine in its shape and, for the optimizer state,
    groups saved with the same tensor names (DeepSpeed copies each saved group's settings into the group of
    the same index) and a momentum for each Muon tensor."""
    from .deepspeed_universal import universal_groups

    zero = os.path.join(src, "zero")
    if not os.path.isdir(zero):
        _refuse(src, "it has no zero/ folder, so it is not a universal checkpoint (make one with "
                     "ds_muon.integrations.deepspeed_universal.zero_to_universal)")
    for gi, group in enumerate(ours):
        for name, shape in group:
            f = os.path.join(zero, name, "fp32.pt")
            if not os.path.isfile(f):
                _refuse(src, f"param group {gi}: tensor {name} {list(shape)} has no {os.path.relpath(f, src)}")
            saved = load(f, mmap=True)
            saved = saved["param"] if isinstance(saved, dict) else saved
            if tuple(saved.shape) != tuple(shape):
                _refuse(src, f"param group {gi}: tensor {name} is {list(saved.shape)} there and {list(shape)} here")
    if weights_only:
        return
    saved_groups = universal_groups(src)
    if not universal_version(src) and not zero3:
        _refuse(src, "its zero/optimizer_state.pt has no ds_version (a ZeRO-3 checkpoint converted by an older "
                     "ds_muon), which DeepSpeed's ZeRO-1/2 universal load asserts on; convert the ZeRO-3 tag folder "
                     "again with ds_muon.integrations.deepspeed_universal.zero_to_universal")
    now = [g.get("param_names") for g in muon.param_groups]
    theirs = [g.get("param_names") for g in saved_groups]
    if len(saved_groups) != len(muon.param_groups) or any(t is None for t in theirs):
        unnamed = " that do not record their tensors' names" if any(t is None for t in theirs) else ""
        _refuse(src, f"it saved {len(saved_groups)} param groups{unnamed} and this engine has "
                     f"{len(muon.param_groups)} ds_muon groups (DeepSpeed copies each saved group's settings into "
                     "the group of the same index)")
    diff = first_difference([[(n, ()) for n in g or []] for g in now], [[(n, ()) for n in g or []] for g in theirs])
    if diff:
        _refuse(src, diff.replace(" []", ""))
    for g in muon.param_groups:
        if g.get("use_muon"):
            for name in g.get("param_names") or []:
                if not os.path.isfile(os.path.join(zero, name, "momentum_buffer.pt")):
                    _refuse(src, f"Muon tensor {name} has no momentum_buffer.pt (its momentum would restart at zero)")
    if any(g.get("use_muon") and g.get("variant") == "normuon" for g in muon.param_groups) and \
            not os.path.isdir(os.path.join(src, "normuon_v")):
        _refuse(src, "this engine runs NorMuon (variant='normuon') and the checkpoint has no normuon_v/ folder "
                     "(its second moment would restart at zero)")


def guard_loads(engine, muon) -> None:
    """Wrap ``engine.load_checkpoint`` with :func:`check_checkpoint`; at ZeRO-3 also load universal checkpoints
    through :func:`ds_muon.integrations.deepspeed_universal.load_zero3_universal` (every state key, each group its own settings)."""
    if getattr(engine, "_ds_muon_guarded", False):
        return
    original = engine.load_checkpoint

    @functools.wraps(original)
    def load_checkpoint(load_dir, tag=None, load_module_strict=True, load_optimizer_states=True, *args, **kwargs):
        check_checkpoint(engine, muon, load_dir, tag, load_optimizer_states, kwargs.get("load_module_only", False))
        return original(load_dir, tag, load_module_strict, load_optimizer_states, *args, **kwargs)

    engine.load_checkpoint = load_checkpoint
    engine._ds_muon_guarded = True
    find_model_states_of_any_stage(engine)
    zero = engine.optimizer
    relink_state_fragments(zero)
    if engine.zero_optimization_partition_weights() and hasattr(zero, "_load_universal_checkpoint"):
        from .deepspeed_universal import load_zero3_universal

        own = zero._load_universal_checkpoint

        def load_universal(checkpoint_folder, load_optimizer_states, load_from_fp32_weights):
            if not load_optimizer_states:
                return own(checkpoint_folder, load_optimizer_states, load_from_fp32_weights)
            load_zero3_universal(zero, checkpoint_folder)

        zero._load_universal_checkpoint = load_universal
    elif hasattr(zero, "_load_universal_checkpoint") and hasattr(zero, "optimizer"):  # ZeRO-1/2
        from .deepspeed_universal import load_moments

        own12 = zero._load_universal_checkpoint

        def load_universal12(checkpoint_folder, load_optimizer_states, load_from_fp32_weights):
            out = own12(checkpoint_folder, load_optimizer_states, load_from_fp32_weights)
            if load_optimizer_states:  # NorMuon's v: one file per flat group, beside zero/ (DeepSpeed's loader skips it)
                load_moments([g["params"][0] for g in zero.optimizer.param_groups], zero.optimizer.state,
                             checkpoint_folder)
            return out

        zero._load_universal_checkpoint = load_universal12


def model_states_names(load_dir: str, tag: str, zero3: bool) -> List[str]:
    """The model-states files of a checkpoint tag the way a ZeRO-3 engine (``zero_pp_rank_0_mp_rank_*``,
    rank 0's: what DeepSpeed's universal load reads) or a ZeRO-1/2 engine (``mp_rank_*``) names them."""
    name = "zero_pp_rank_0_mp_rank_*_model_states.pt" if zero3 else "mp_rank_*_model_states.pt"
    return sorted(glob.glob(os.path.join(load_dir, str(tag), name)))


def find_model_states_of_any_stage(engine) -> None:
    """Let a universal load find the model-states file a checkpoint of another ZeRO stage wrote.

    A universal load takes the weights and optimizer state from ``zero/`` and only metadata (steps,
    scheduler, client state) from the model-states file, but DeepSpeed 0.19.8 looks that file up by
    its own stage's name: a ZeRO-3 engine for ``zero_pp_rank_0_mp_rank_00_model_states.pt``, ZeRO-1/2
    for ``mp_rank_00_model_states.pt``.  So a checkpoint converted at ZeRO-1/2 failed at ZeRO-3 (and
    the other way) with an empty ``AssertionError`` (``len(self.ckpt_list) > 0``).  Where the
    engine's name finds nothing, the other stage's is used."""
    own = engine._get_all_ckpt_names

    def names(checkpoints_path, tag):
        found = own(checkpoints_path, tag)
        if found or not engine.load_universal_checkpoint():
            return found
        return model_states_names(checkpoints_path, tag, not engine.zero_optimization_partition_weights())

    engine._get_all_ckpt_names = names


def _state_signature(zero) -> tuple:
    return tuple(sorted((id(flat), k, id(v)) for flat, st in zero.optimizer.state.items() for k, v in st.items()
                        if torch.is_tensor(v) and v.dim() > 0))


def relink_state_fragments(zero) -> None:
    """Keep DeepSpeed's per-parameter views of the optimizer state (``safe_get_full_optimizer_state``,
    ``safe_set_full_optimizer_state``, universal checkpoints) on the state the Muon holds.

    ZeRO-1/2 and ``BF16_Optimizer`` link those views once, after the *first* group's ``step()``; ds_muon
    creates a group's state when that group first steps, so AdamW's ``exp_avg`` was never linked and
    ``safe_get_full_optimizer_state(p, "exp_avg")`` raised.  Here the link is redone whenever the state's
    tensors change (new keys, a loaded state dict)."""
    own = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)
    if own is None or getattr(zero, "_ds_muon_relinks", False):
        return

    def link():
        sig = _state_signature(zero)
        if sig != getattr(zero, "_ds_muon_linked", None):
            zero._hp_optimizer_states_linked = False
            own()
            zero._ds_muon_linked = sig

    zero._lazy_init_hp_params_optimizer_state = link
    zero._ds_muon_relinks = True
