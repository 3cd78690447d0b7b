"""NorMuon's second moment ``v``: where it lives, its update at home, and how every rank gets it.

``v`` is state of each logical matrix, one float32 per output neuron (:mod:`ds_muon.rules.normuon`).
It lives in the optimizer state as ``state[param]["normuon_v"]``: a float32 1-D tensor holding the
whole ``v`` of every matrix slot of the tensor's binding, end to end in slot order.  Every rank
lists every matrix of a tensor (pieces or not: FSDP1 flat parameters, ZeRO flat partitions list
all theirs), so the key and its shape are the same on every rank, and the tensor is the *whole*
moment, not a shard: a state dict loads at any world size and under any plan of homes, and DCP
saves it once (a replicated plain tensor).  It is small: ``rows`` floats per ``rows × cols`` matrix.

During a step each home normalizes its normuon matrices right after NS, before the scatter
(:meth:`RowMoments.at_home`), reading and writing its own copy of ``v``.  The new moments of an
exchange then reach every other rank with one ``all_reduce(SUM)`` over the exchange's group
(:meth:`RowMoments.share_start` / :meth:`Shared.finish`): the first home of each matrix puts its
``v`` in, every other rank zeros, and ``x + 0 == x`` exactly, so every rank ends with the home's
bits.  No collective runs where nobody needs one (one process; every rank a home of every such
matrix, as in ``mode="duplicated"``).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from ...rules.normuon import neurons, normalize
from .layout import Layout, MatrixSlot, ParamBinding

KEY = "normuon_v"


def is_normuon(group: Optional[dict]) -> bool:
    return group is not None and group.get("variant", "muon") == "normuon"


def _slot_neurons(slot: MatrixSlot) -> int:
    return neurons(slot.matrix_shape, slot.transposed)


def moment_length(binding: ParamBinding) -> int:
    """Entries of ``normuon_v`` for the tensor of ``binding``: the neurons of each of its matrices."""
    return sum(_slot_neurons(s) for s in binding.matrices)


def _offset(binding: ParamBinding, slot: MatrixSlot) -> int:
    """Where ``slot``'s moment starts in its tensor's ``normuon_v`` (offsets made once per binding: a flat
    partition lists thousands of matrices)."""
    offsets = binding.__dict__.get("_normuon_offsets")
    if offsets is None:
        offsets, off = {}, 0
        for s in binding.matrices:
            offsets[id(s)] = off
            off += _slot_neurons(s)
        binding.__dict__["_normuon_offsets"] = offsets
    return offsets[id(slot)]


def moment_of(layout: Layout, i: int, state: Mapping) -> torch.Tensor:
    """This rank's copy of matrix ``i``'s ``v`` (a view into its tensor's state)."""
    b, slot = layout.local[i]
    off = _offset(b, slot)
    return state[b.param][KEY][off:off + _slot_neurons(slot)]


def new_moment(binding: ParamBinding, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(moment_length(binding), dtype=torch.float32, device=like.device)


def check_moments(groups: List[dict], state: Mapping, bindings: Mapping[int, ParamBinding], name) -> None:
    """Before the step writes anything: every normuon tensor's ``v`` holds its matrices' neurons,
    as float32 (a state dict of another model, or edited state, would otherwise fail mid-step)."""
    for gi, g in enumerate(groups):
        if not (g["use_muon"] and is_normuon(g)):
            continue
        for pi, p in enumerate(g["params"]):
            v, b = state.get(p, {}).get(KEY), bindings.get(id(p))
            if v is None or b is None:
                continue
            if v.dim() != 1 or v.numel() != moment_length(b) or v.dtype != torch.float32:
                raise ValueError(moment_refusal(name(gi, pi), v, b, "nothing was changed"))


def moment_refusal(who: str, v, binding: ParamBinding, what: str) -> str:
    """The refusal of a ``v`` that does not fit ``binding``'s matrices (the step's and the load's)."""
    dtype, shape = (v.dtype, tuple(v.shape)) if torch.is_tensor(v) else (type(v).__name__, (len(v),))
    return (f"ds_muon: {who}: its NorMuon second moment {KEY!r} is {dtype} of shape {shape} but its matrices need "
            f"float32 of shape ({moment_length(binding)},) (one per output neuron); {what}. The state comes from "
            "another model, tensor order, ZeRO stage or grouping: load the state of this model and layout "
            f"(ds_muon.convert / `ds-muon convert` moves it by tensor name), or drop the key "
            f"(opt.state[param].pop({KEY!r})) to restart the moment at zero")


def check_loaded_moments(groups: List[dict], saved_groups: List[dict], saved_state: Mapping,
                         bindings: Mapping[int, ParamBinding], name, defaults: Mapping) -> None:
    """At load, before anything is assigned: the step's :func:`check_moments` on the saved ``v`` of each
    tensor (matched in order, as torch's load matches them) whose saved group runs NorMuon.  The load casts
    ``v`` to float32, so only its length can be wrong here (its rank and dtype kind: state_check)."""
    if len(saved_groups) != len(groups):
        return  # torch's own check names this
    for gi, (g, saved) in enumerate(zip(groups, saved_groups)):
        if not (g["use_muon"] and saved.get("variant", defaults.get("variant", "muon")) == "normuon"):
            continue
        for pi, (p, sid) in enumerate(zip(g["params"], saved["params"])):
            st, b = saved_state.get(sid), bindings.get(id(p))
            v = st.get(KEY) if isinstance(st, Mapping) else None
            if v is None or b is None:
                continue
            n = v.numel() if torch.is_tensor(v) else len(v)
            if n != moment_length(b):
                raise ValueError(moment_refusal(name(gi, pi), v, b, "nothing was loaded"))


class Shared:
    """One exchange's new moments on their way to every rank (:meth:`RowMoments.share_start`)."""

    def __init__(self, work, buffer: torch.Tensor, places: List[Tuple[torch.Tensor, int, int]]):
        self.work, self.buffer, self.places = work, buffer, places

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        for v, off, n in self.places:
            v.copy_(self.buffer[off:off + n])


class RowMoments:
    """The step's calls into NorMuon (stateless: ``v`` is in the optimizer's state)."""

    @staticmethod
    def matrices(layout: Layout, active: Iterable[int], group_of: Mapping[int, dict]) -> List[int]:
        """The normuon matrices among ``active``."""
        return [i for i in active if is_normuon(group_of.get(id(layout.local[i][0].param)))]

    @staticmethod
    def at_home(layout: Layout, ex, results: Dict, group_of: Mapping[int, dict], state: Mapping) -> None:
        """NorMuon on each normuon matrix of this home's ``results`` (``{stack key: [k, rows, cols]}``,
        in place), one matrix at a time, and this rank's ``v`` of each updated."""
        stacks = getattr(ex, "stacks", None)
        if not stacks:
            return  # nothing at home (a team's exchange never holds normuon matrices: see compile)
        for key, idx in stacks.items():
            out = results.get(key)
            if out is None:
                continue
            for pos, i in enumerate(idx):
                g = group_of.get(id(layout.local[i][0].param))
                if not is_normuon(g):
                    continue
                v = moment_of(layout, i, state)
                o, v_new = normalize(out[pos], v, g["normuon_beta2"], layout.local[i][1].transposed)
                out[pos].copy_(o)
                v.copy_(v_new)

    @staticmethod
    def share_start(layout: Layout, ex, group_of: Mapping[int, dict], state: Mapping) -> Optional[Shared]:
        """Issue the all_reduce that gives every rank of ``ex``'s group its homes' new moments
        (None when no rank lacks one)."""
        mats = RowMoments.matrices(layout, ex.active, group_of)
        if not mats or layout.world_size == 1:
            return None
        r = layout.rank
        lacking = [i for i in mats if len(ex.homes[i]) < layout.world_size]
        if not lacking:
            return None  # every rank computed every moment itself
        views = [moment_of(layout, i, state) for i in lacking]
        sizes = [v.numel() for v in views]
        buf = torch.zeros(sum(sizes), dtype=torch.float32, device=ex.device)
        places, off = [], 0
        for i, v, n in zip(lacking, views, sizes):
            if ex.homes[i][0] == r:
                buf[off:off + n].copy_(v)
            elif r not in ex.homes[i]:
                places.append((v, off, n))
            off += n
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=ex.group, async_op=True)
        return Shared(work, buf, places)


def agree_after_load(layouts: Iterable[Layout], group_of: Mapping[int, dict], state: Mapping, done: set) -> None:
    """After a load, every rank's ``v`` of each normuon matrix made the same: the max over the layout's
    group, one all_reduce per layout not in ``done`` (then added to it).  ``v`` ≥ 0, and a rank that
    loaded none (FSDP1's ``optim_state_dict_to_load`` gives ``{}`` to a rank holding no element of a
    tensor, so its ``v`` is made anew as zeros) would otherwise feed zeros to NorMuon where it is the
    home; the ranks that loaded it hold the same saved values, so the max is those values, exactly."""
    for layout in layouts:
        if id(layout) in done:
            continue
        done.add(id(layout))
        mats = [i for i, (b, _) in enumerate(layout.local) if is_normuon(group_of.get(id(b.param)))]
        if not mats or layout.world_size == 1:
            continue
        views = [moment_of(layout, i, state) for i in mats]
        buf = torch.cat(views)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=layout.group)
        off = 0
        for v in views:
            v.copy_(buf[off:off + v.numel()])
            off += v.numel()


def _fsdp1_flat(p: torch.Tensor) -> bool:
    """An FSDP1 FlatParameter, or (``use_orig_params=True``) an original parameter viewed into one."""
    return hasattr(p, "_fqns") or getattr(p, "_fsdp_flattened", False)


def fsdp1_moments(state_dict: dict, groups: List[dict]) -> dict:
    """``state_dict`` with the ``v`` of each FSDP1 flat parameter as a tuple of Python floats (exact: a
    float32 widens to a float losslessly).  FSDP1's ``FSDP.optim_state_dict`` (and DCP over FSDP1) all-gathers
    every state tensor with a dimension as a shard of its flat parameter; ``v`` is whole on every rank, so it
    must travel as FSDP1's "non-tensor state", which it copies to every original parameter of the flat one
    and, loading, takes back when they agree.  :func:`split_moments` turns it into a tensor again.  Other
    tensors' state is left alone (the same dict objects torch returns)."""
    params = [p for g in groups for p in g["params"]]
    state = state_dict["state"]
    for i, p in enumerate(params):
        st = state.get(i)
        if st is not None and KEY in st and torch.is_tensor(st[KEY]) and _fsdp1_flat(p):
            st = state[i] = dict(st)
            st[KEY] = tuple(st[KEY].tolist())
    return state_dict


def split_moments(state_dict: Mapping) -> Tuple[Dict, dict]:
    """``({saved id: v}, the state dict without them)`` (a shallow copy; the caller's is not touched).
    torch's ``load_state_dict`` casts every floating-point state tensor to its parameter's dtype;
    ``v`` must stay float32 (a bfloat16 model's moment would lose its bits), so it goes round it."""
    moments = {pid: st[KEY] for pid, st in state_dict["state"].items() if isinstance(st, Mapping) and KEY in st}
    if not moments:
        return {}, state_dict
    out = dict(state_dict)
    out["state"] = {pid: ({k: v for k, v in st.items() if k != KEY} if pid in moments else st)
                    for pid, st in state_dict["state"].items()}
    return moments, out


def restore_moments(groups: List[dict], saved_groups: List[dict], moments: Mapping, state) -> None:
    """Put the moments :func:`split_moments` kept into ``state``, matched to the parameters as torch's
    load matches them (in order), as float32 copies on each parameter's device."""
    if not moments:
        return
    saved_ids = [pid for g in saved_groups for pid in g["params"]]
    params = [p for g in groups for p in g["params"]]
    for pid, p in zip(saved_ids, params):
        v = moments.get(pid)
        if v is not None:  # (a tuple: an FSDP1 flat parameter's, see fsdp1_moments)
            v = torch.as_tensor(v, dtype=torch.float32) if not torch.is_tensor(v) else v.detach()
            state[p][KEY] = v.to(device=p.device, dtype=torch.float32, copy=True)
