"""PyTorch FSDP: where FSDP2 (``fully_shard``) and FSDP1 (``FullyShardedDataParallel``) keep shards.

Nothing here steps anything; each binder only *describes* what a rank holds
(:class:`~ds_muon.layout.ParamBinding`), and the optimizer does the rest.

FSDP2
    Parameters are DTensors sharded ``Shard(0)`` over the shard dimension of their
    mesh (HSDP: ``(Replicate(), Shard(0))``).  A rank holds a contiguous row range
    (uneven, possibly empty) = a contiguous range of the row-major flattening.
    Updates go into ``p.to_local()``, a view of the storage FSDP all-gathers from.
    The Layout's group is the shard dimension's process group, so HSDP replicas
    each plan the same homes within their own shard group.

FSDP1, ``use_orig_params=False``
    The optimizer steps 1-D ``FlatParameter`` shards (padded) that mix weights,
    biases and norms.  ``_shard_param_infos`` says where each original tensor's
    slice sits; the :mod:`~ds_muon.param_groups` rules pick Muon or AdamW per
    original tensor; the AdamW slices become the binding's ``adam_ranges``.

FSDP1, ``use_orig_params=True``
    The optimizer steps the original parameters, now 1-D views of the local shard
    (size 0 where the rank holds none of it).  Their original shapes live only in
    the owning ``FlatParameter``, found through the wrapped model
    (``Muon(..., model=fsdp_model)``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..layout import MatrixSlot, ParamBinding, Piece, matrix_shape
from ..param_groups import HEAD_NAMES, is_muon_param, muon_param_groups, split_params, stores_in_out
from ..tagging import block_slots, is_tagged, is_transposed, transposed
from ..experts import apply_plan, check_matrix_dims, check_routers, mark_routers, stack_plan

FSDP_PREFIX = "_fsdp_wrapped_module."


# -- FSDP2 ----------------------------------------------------------------------
def is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(t, DTensor)


def _dtensor_flat(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (param, grad or state made ``zeros_like`` it), flat, as a view."""
    if not is_dtensor(t):
        raise TypeError(
            f"ds_muon: expected a DTensor shard (FSDP2) but got a plain tensor of shape {tuple(t.shape)}; "
            "optimizer state of FSDP2 parameters must stay DTensors: load it with "
            "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict"
        )
    local = t.to_local()
    return local.view(-1) if local.is_contiguous() else local.reshape(-1)


def _fsdp2_shard_dim(param, name: str) -> Optional[int]:
    """The mesh dimension that shards ``param`` by rows, None when it is replicated on every dim."""
    from torch.distributed.tensor import Replicate, Shard

    shard_dims = []
    for mesh_dim, pl in enumerate(param.placements):
        if type(pl) is Shard and pl.dim == 0:
            shard_dims.append(mesh_dim)
        elif not isinstance(pl, Replicate):
            raise NotImplementedError(
                f"ds_muon: {name} is a DTensor placed {tuple(param.placements)} on mesh dims "
                f"{param.device_mesh.mesh_dim_names or param.device_mesh.ndim}; ds_muon supports FSDP2/HSDP "
                f"row sharding only (Shard(0), optionally with Replicate()), not {pl}. Put this tensor in an "
                "AdamW group (use_muon=False) or shard it with fully_shard's default placement"
            )
    if len(shard_dims) > 1:
        raise NotImplementedError(
            f"ds_muon: {name} is sharded by rows on {len(shard_dims)} mesh dims {tuple(param.placements)}; "
            "ds_muon supports one Shard(0) mesh dim (FSDP2, or HSDP's (Replicate(), Shard(0)))"
        )
    return shard_dims[0] if shard_dims else None


def bind_fsdp2(param, name: str) -> ParamBinding:
    """A DTensor parameter sharded ``Shard(0)`` (FSDP2/HSDP): this rank's row range."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if param.ndim < 2:
        raise ValueError(
            f"ds_muon: {name} has shape {tuple(param.shape)}; Muon needs matrices (ndim >= 2). Put it in an "
            "AdamW group (use_muon=False), e.g. with ds_muon.muon_param_groups(model)"
        )
    shard_dim = _fsdp2_shard_dim(param, name)
    mesh = param.device_mesh
    local = param.to_local()
    if not local.is_contiguous():
        raise ValueError(
            f"ds_muon: the local shard of {name} is not contiguous (strides {local.stride()}); Muon updates "
            "it in place through a flat view"
        )
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, param.placements)
    if tuple(local_shape) != tuple(local.shape):
        raise ValueError(
            f"ds_muon: {name}: the DTensor's placements say the local shard is {tuple(local_shape)} but it "
            f"is {tuple(local.shape)}; the shard does not match its metadata"
        )
    _, cols = matrix_shape(param.shape)
    rows_local = int(local_shape[0])
    piece = Piece(int(offset[0]) * cols, rows_local * cols) if rows_local * cols > 0 else None
    group = mesh.get_group(shard_dim if shard_dim is not None else 0)
    if is_tagged(param):  # split rows / experts: blocks clipped to this rank's row range
        lo = int(offset[0]) * cols
        return ParamBinding(param, _dtensor_flat, block_slots(param, name, lo, lo + rows_local * cols), group=group)
    return ParamBinding(param, _dtensor_flat, [MatrixSlot(name, tuple(param.shape), piece, 0, transposed=is_transposed(param))],
                        group=group)


# -- FSDP1 ----------------------------------------------------------------------
def is_flat_param(t) -> bool:
    try:
        from torch.distributed.fsdp._flat_param import FlatParameter
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, FlatParameter)


def is_fsdp1_model(model) -> bool:
    if model is None:
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return any(isinstance(m, FSDP) for m in model.modules())


def _flat1(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


class _Fsdp1Index:
    """Every FlatParameter under a model: its FSDP module's name and process group, and, with
    ``use_orig_params=True``, which original parameter is which index of which FlatParameter."""

    def __init__(self, model: nn.Module):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        self.flat: Dict[int, Tuple[object, str, object]] = {}  # id(flat) -> (flat, prefix, group)
        self.orig: Dict[int, Tuple[object, int, str, object]] = {}  # id(param) -> (flat, i, prefix, group)
        for mod_name, mod in model.named_modules():
            if not isinstance(mod, FSDP) or mod._handle is None:
                continue
            flat = mod._handle.flat_param
            prefix = mod_name.replace(FSDP_PREFIX, "").replace("_fsdp_wrapped_module", "").strip(".")
            prefix = prefix + "." if prefix else ""
            self.flat[id(flat)] = (flat, prefix, mod.process_group)
            for i, p in enumerate(flat._params or ()):
                self.orig[id(p)] = (flat, i, prefix, mod.process_group)


def _index(optimizer, param) -> Optional[_Fsdp1Index]:
    """The FSDP1 index of ``optimizer.model``, cached; rebuilt when it does not know ``param``."""
    model = getattr(optimizer, "model", None)
    if model is None:
        return None
    cached = getattr(optimizer, "_ds_muon_fsdp1_index", None)
    if cached is not None and cached[0] is model and (id(param) in cached[1].flat or id(param) in cached[1].orig):
        return cached[1]
    if not is_fsdp1_model(model):
        return None
    index = _Fsdp1Index(model)
    optimizer._ds_muon_fsdp1_index = (model, index)
    return index


def _group_options(optimizer, param) -> dict:
    for g in optimizer.param_groups:
        if any(p is param for p in g["params"]):
            return g
    return {}


def original_is_muon(flat, i: int, head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw") -> bool:
    """The :func:`~ds_muon.param_groups.split_params` rule for original tensor ``i`` of a FlatParameter.

    A tensor shared by several modules (tied weights) takes Muon only if every
    module that uses it would give it Muon (a weight tied to an embedding is AdamW).
    """
    info = flat._param_infos[i]
    shape = tuple(flat._shapes[i])
    if not is_muon_param(info.param_name, shape, info.module_name, info.module, head_names, routers):
        return False
    for s in flat._shared_param_infos:
        if s.prim_module is info.module and s.prim_param_name == info.param_name:
            if not is_muon_param(s.param_name, shape, s.module_name, s.module, head_names, routers):
                return False
    return True


def _shard_piece(flat, i: int, name: str) -> Tuple[Optional[Piece], int]:
    """(piece of original tensor i this rank holds, its offset in the local flat shard)."""
    si = flat._shard_param_infos[i]
    if not si.in_shard or not si.numel_in_shard:
        return None, 0
    if si.intra_param_end_idx - si.intra_param_start_idx + 1 != si.numel_in_shard:  # end is inclusive
        raise ValueError(f"ds_muon: {name}: FSDP shard metadata is inconsistent ({si})")
    return Piece(int(si.intra_param_start_idx), int(si.numel_in_shard)), int(si.offset_in_shard)


def _tag_carrier(flat, i: int, key: str) -> Optional[torch.Tensor]:
    """A meta tensor tagged as :func:`ds_muon.muon_param_groups` tags original tensor ``i`` when it
    is a fused expert stack or a ``Conv1D`` weight (FSDP1 hides or flattens the parameter itself);
    None for any other tensor.
    Raises for a 3+-D tensor it cannot describe exactly."""
    info = flat._param_infos[i]
    shape = tuple(int(s) for s in flat._shapes[i])
    try:
        plan = stack_plan(info.module, info.param_name, shape, key)
    except NotImplementedError as e:
        raise NotImplementedError(f"{e}. Under FSDP1 the tags must be set before wrapping, with "
                                  "use_orig_params=True (use_orig_params=False hides the parameter)") from None
    if plan is None:
        check_matrix_dims(key, shape, info.module)
        if stores_in_out(info.module, info.param_name):  # GPT-2's Conv1D: the scale factor reads [out, in]
            return transposed(torch.empty(shape, device="meta"))
        return None
    if plan.transposed:
        raise NotImplementedError(
            f"ds_muon: {key} {shape} is an expert stack stored [E, in, out] under FSDP1, which hides the "
            "parameter that would carry its scale factor's orientation. Use FSDP2 (fully_shard), or "
            "use_orig_params=True with ds_muon.expert_weight(p) and ds_muon.transposed(p) tagged before wrapping")
    return apply_plan(torch.empty(shape, device="meta"), plan)


def bind_fsdp1_flat(flat, name: str, group=None, head_names: Sequence[str] = HEAD_NAMES,
                    prefix: Optional[str] = None, routers: str = "adamw") -> ParamBinding:
    """One FSDP1 FlatParameter shard: a MatrixSlot per original Muon tensor, AdamW ranges for the rest.

    Every rank lists every matrix (piece None where it holds none of it).  Keys are
    ``prefix + fqn`` (the model's own names when the model is known) so every rank
    names them alike.
    """
    if not hasattr(flat, "_shard_param_infos"):
        raise ValueError(f"ds_muon: {name} is an FSDP1 FlatParameter that is not sharded yet; build the "
                         "optimizer after wrapping the model with FullyShardedDataParallel")
    base = prefix if prefix is not None else f"{name}:"
    matrices: List[MatrixSlot] = []
    adam: List[Tuple[int, int]] = []
    for i, fqn in enumerate(flat._fqns):
        key = base + fqn
        piece, offset = _shard_piece(flat, i, key)
        if original_is_muon(flat, i, head_names, routers):
            carrier = _tag_carrier(flat, i, key)
            if carrier is not None:  # one matrix per expert (and gate/up blocks), clipped to this shard
                lo = 0 if piece is None else piece.offset
                hi = lo if piece is None else lo + piece.numel
                matrices.extend(block_slots(carrier, key, lo, hi, offset, carrier.shape))
                continue
            matrices.append(MatrixSlot(key, tuple(flat._shapes[i]), piece, offset))
        elif piece is not None:
            adam.append((offset, piece.numel))
    merged: List[Tuple[int, int]] = []
    for off, n in sorted(adam):  # neighbours (ln.weight, ln.bias) become one slice
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((off, n))
    return ParamBinding(flat, _flat1, matrices, adam_ranges=merged, group=group)


def bind_fsdp1_orig(param, name: str, flat, i: int, group=None) -> ParamBinding:
    """An original parameter under FSDP1 ``use_orig_params=True``: a 1-D view of its local slice."""
    shape = tuple(flat._shapes[i])
    if len(shape) < 2:
        raise ValueError(
            f"ds_muon: {name} (original shape {shape}) is in a Muon group; Muon needs matrices. Build groups "
            "with ds_muon.integrations.fsdp.fsdp_param_groups(fsdp_model), or with "
            "ds_muon.muon_param_groups(model) before wrapping"
        )
    piece, _ = _shard_piece(flat, i, name)
    held = 0 if piece is None else piece.numel
    if param.numel() != held:
        raise ValueError(
            f"ds_muon: {name} has {param.numel()} local elements but FSDP's metadata says this rank holds "
            f"{held} of it; step the optimizer only while FSDP parameters are sharded (not inside "
            "summon_full_params)"
        )
    tagged = param if is_tagged(param) else _tag_carrier(flat, i, name)
    if tagged is not None:  # split rows / experts: blocks clipped to this rank's range
        lo = 0 if piece is None else piece.offset
        return ParamBinding(param, _flat1, block_slots(tagged, name, lo, lo + held, 0, shape), group=group)
    return ParamBinding(param, _flat1, [MatrixSlot(name, shape, piece, 0, transposed=is_transposed(param))],
                        group=group)


# -- dispatch -------------------------------------------------------------------
def fsdp_binder(optimizer, param, name: str) -> Optional[ParamBinding]:
    """The FSDP binding for ``param``, or None when FSDP does not own it."""
    if is_dtensor(param):
        return bind_fsdp2(param, name)
    index = _index(optimizer, param) if (is_flat_param(param) or getattr(param, "_fsdp_flattened", False)) else None
    if is_flat_param(param):
        options = _group_options(optimizer, param)
        head_names = tuple(options.get("head_names", HEAD_NAMES))
        routers = options.get("routers", "adamw")
        if index is not None and id(param) in index.flat:
            _, prefix, group = index.flat[id(param)]
            return bind_fsdp1_flat(param, name, group, head_names, prefix, routers)
        return bind_fsdp1_flat(param, name, optimizer.process_group, head_names, routers=routers)
    if getattr(param, "_fsdp_flattened", False):
        entry = None if index is None else index.orig.get(id(param))
        if entry is None:
            raise ValueError(
                f"ds_muon: {name} (now of shape {tuple(param.shape)}) was flattened by FSDP1 "
                "(use_orig_params=True) and its original shape is known only to the wrapped model: pass "
                "Muon(..., model=fsdp_model), the FullyShardedDataParallel root that owns it"
            )
        flat, i, _, group = entry
        return bind_fsdp1_orig(param, name, flat, i, group)
    return None


# -- param groups ---------------------------------------------------------------
def fsdp_param_groups(model: nn.Module, lr: float = 0.02, adam_lr: float = 3e-4, weight_decay: float = 0.0,
                      adam_weight_decay: float = 0.0, head_names: Sequence[str] = HEAD_NAMES,
                      routers: str = "adamw", **muon_options) -> List[dict]:
    """:func:`ds_muon.muon_param_groups` for a model already wrapped by FSDP1 (or FSDP2).

    FSDP1 hides the original shapes (``use_orig_params=False``: 1-D FlatParameters;
    ``True``: 1-D views), so the shape rule cannot see them.  Here every FlatParameter
    goes to the Muon group, which carries ``adam_lr``/``adam_weight_decay`` for its
    non-matrix slices, and original parameters are split by their original shapes.
    FSDP2 keeps global shapes, so it is plain ``muon_param_groups``.  Fused expert stacks
    are described from their module when the optimizer binds them (FSDP1 hides or
    flattens the tensors); ``routers`` is kept in the group for that.
    """
    if not is_fsdp1_model(model):
        return muon_param_groups(model, lr, adam_lr, weight_decay, adam_weight_decay, head_names, routers=routers,
                                 **muon_options)
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    check_routers(routers)
    mark_routers(model)
    index = _Fsdp1Index(model)
    rule_muon, _ = split_params(model, head_names, routers)
    rule_muon = {id(p) for _, p in rule_muon}
    muon, adam = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = clean_tensor_name(name)
        if is_flat_param(p):
            prefix = index.flat[id(p)][1] if id(p) in index.flat else ""
            for i, fqn in enumerate(p._fqns):  # raises now for a 3+-D tensor binding could not describe
                if original_is_muon(p, i, head_names, routers):
                    _tag_carrier(p, i, prefix + fqn)
            muon.append((name, p))
        elif id(p) in index.orig:
            flat, i, _, _ = index.orig[id(p)]
            is_muon = original_is_muon(flat, i, head_names, routers)
            if is_muon and not is_tagged(p):
                _tag_carrier(flat, i, name)  # raises now for a 3+-D tensor it cannot describe
            (muon if is_muon else adam).append((name, p))
        else:
            (muon if id(p) in rule_muon else adam).append((name, p))
    groups = []
    if muon:
        g = {"params": [p for _, p in muon], "param_names": [n for n, _ in muon], "use_muon": True, "lr": lr,
             "weight_decay": weight_decay, **muon_options}
        if any(is_flat_param(p) for _, p in muon):
            g.update(adam_lr=adam_lr, adam_weight_decay=adam_weight_decay)
            if tuple(head_names) != HEAD_NAMES:
                g["head_names"] = tuple(head_names)
            if routers != "adamw":
                g["routers"] = routers
        groups.append(g)
    if adam:
        groups.append({"params": [p for _, p in adam], "param_names": [n for n, _ in adam], "use_muon": False,
                       "lr": adam_lr, "weight_decay": adam_weight_decay})
    if not groups:
        raise ValueError("fsdp_param_groups: the model has no trainable parameters")
    return groups
