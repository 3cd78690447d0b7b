"""FSDP1 full optimizer state dicts whose state keys torch overwrote, refused at load.

torch's ``FSDP.optim_state_dict`` (FSDP1, ``use_orig_params=True``, sharded) all-gathers each state
key of a FlatParameter's original tensors into one buffer that it reuses for every key, and cuts the
tensors' results out of it as views.  With ``FullOptimStateDictConfig(offload_to_cpu=True)``, the
default, each view is "offloaded" with ``.cpu()``; on a model on CPU that returns the same view, not a
copy, so when the gather ends every key of every tensor of that FlatParameter holds the key gathered
last (``momentum_buffer``, in sorted order).  On a GPU ``.cpu()`` copies and nothing is lost; with
``offload_to_cpu=False`` torch clones each view.

ds_muon keeps every key on every tensor of a FlatParameter (FSDP1 gathers them together): the Muon
matrices hold zero ``exp_avg``/``exp_avg_sq`` placeholders, the AdamW tensors a zero
``momentum_buffer``.  So such a dict resumes the Muon matrices exactly (their key is the last) but
gives every AdamW tensor of the FlatParameter its zero placeholder as moments: a silently wrong
resume.  A genuine state never has all keys equal on every tensor of a FlatParameter unless all of
them are zero (no gradient ever reached that shard); the overwritten one has them equal always.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping

import torch

STATE_TENSORS = ("exp_avg", "exp_avg_sq", "momentum_buffer")  # the keys ds_muon keeps on every tensor


def check_gathered_keys(groups: List[dict], state_dict: Mapping, name: Callable[[int, int], str],
                        owners: Mapping[int, int]) -> None:
    """ValueError naming an AdamW tensor when, on this rank, every FSDP1 original tensor of one
    FlatParameter comes back with all its state keys bitwise equal (the signature of the overwrite
    above) and AdamW has stepped one of them: its moments were lost before the dict was saved.

    Matched to the parameters as torch's load matches them (in order); nothing is loaded."""
    if not owners:
        return
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if len(saved_groups) != len(groups) or any(len(s["params"]) != len(g["params"])
                                               for s, g in zip(saved_groups, groups)):
        return  # torch's own check names this
    by_flat: Dict[int, list] = {}  # this rank's loaded states, per FlatParameter
    adamw: Dict[int, tuple] = {}  # the first AdamW tensor of each FlatParameter, held here or not
    for gi, (g, s) in enumerate(zip(groups, saved_groups)):
        for pi, (p, saved_id) in enumerate(zip(g["params"], s["params"])):
            if id(p) not in owners:
                continue
            if not g["use_muon"]:
                adamw.setdefault(owners[id(p)], (gi, pi))
            st = saved_state.get(saved_id)
            if p.numel() and st:
                by_flat.setdefault(owners[id(p)], []).append((g["use_muon"], st))
    for flat, members in by_flat.items():
        if flat not in adamw:
            continue  # Muon matrices only: their momentum (the key gathered last) is whole
        keys = [[st[k] for k in STATE_TENSORS if torch.is_tensor(st.get(k)) and st[k].dim() > 0] for _, st in members]
        if any(len(ks) < 2 or any(not torch.equal(ks[0], k) for k in ks[1:]) for ks in keys):
            continue  # some tensor holds distinct keys: not overwritten
        zero = not any(bool(k.any()) for ks in keys for k in ks)
        if zero and not any(not muon and float(st.get("step", 0)) > 0 for muon, st in members):
            continue  # nothing stepped here yet: nothing to lose
        gi, pi = adamw[flat]
        raise ValueError(
            f"ds_muon: loaded state of {name(gi, pi)} (AdamW) and of every tensor this rank holds of its FSDP1 "
            "flat parameter: exp_avg, exp_avg_sq and momentum_buffer are bitwise the same. torch's "
            "FSDP.optim_state_dict (use_orig_params=True, FullOptimStateDictConfig(offload_to_cpu=True), its "
            "default, on a model on CPU) gathers every key into one reused buffer and its .cpu() does not copy, "
            "so each key holds the last one gathered (momentum_buffer): the AdamW moments of that flat parameter "
            "were lost when the dict was saved, and resuming from it would be silently wrong. Nothing was loaded. "
            "Save the optimizer again with FullOptimStateDictConfig(offload_to_cpu=False) (or a sharded state "
            "dict, torch.distributed.checkpoint, or a per-rank opt.state_dict())"
            + (". If these tensors truly never had a nonzero gradient (all their state is zero), drop their "
               "entries from state_dict['state'] to start them afresh: the same step" if zero else ""))
