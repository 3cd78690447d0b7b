"""PyTorch FSDP1 (``FullyShardedDataParallel``): flat parameters and the original tensors in them.

``use_orig_params=False``
    The optimizer steps 1-D ``FlatParameter`` shards (padded) that mix weights,
    biases and norms.  ``_shard_param_infos`` says where each original tensor's
    slice sits; the :mod:`~ds_muon.models.decide` rules pick Muon or AdamW per
    original tensor (with the param group's ``head_names`` and ``routers``); the
    AdamW slices become the binding's ``adam_ranges``.

``use_orig_params=True``
    The optimizer steps the original parameters, now 1-D views of the local shard
    (size 0 where the rank holds none of it).  Their original shapes live only in
    the owning ``FlatParameter``, found through the wrapped model
    (``Muon(..., model=fsdp_model)``).

FSDP1 reduces gradients after the post-accumulate-grad hooks fire, so no gather leaves from
backward.  :func:`fsdp1_param_groups` builds param groups for a model already wrapped.
"""

from __future__ import annotations

import copy
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..engine.exchange.layout import MatrixSlot, ParamBinding, Piece
from ..engine.exchange.slots import block_slots
from ..tensors.tag_keys import is_tagged, is_transposed
from ..models.experts import apply_plan, check_matrix_dims, check_routers, stack_plan
from ..models.fused import apply_fused_plan
from ..models.meta import _tensor_memo, failure
from ..models.reading import param_decision, param_reason, read
from ..models.kinds import HIDDEN_MATRIX
from ..models.module_types import stores_in_out
from ..models.names import HEAD_NAMES
from ..models.tags import transposed
from ..models.trace import Trace, trace as trace_forward
from .base import BindContext
from .fsdp1_checkpoint import check_gathered_keys

FSDP_PREFIX = "_fsdp_wrapped_module."
FLAT_REASON = "FSDP1 flat parameter"  # its matrices take Muon, the rest of it AdamW (adam_ranges)


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


class Fsdp1Adapter:
    """FSDP1 ``FlatParameter`` shards, and original parameters flattened by ``use_orig_params=True``.

    Keeps the index of the last model it read (rebuilt when it does not know a tensor)."""

    applies_in_step = False
    data_parallel_group = None

    def __init__(self):
        self._indexed: Optional[Tuple[nn.Module, _Fsdp1Index]] = None

    def bind(self, param: torch.Tensor, name: str, context: BindContext) -> ParamBinding:
        index = self._index(context.model, param)
        if is_flat_param(param):
            head_names = tuple(context.options.get("head_names", HEAD_NAMES))
            routers = context.options.get("routers", "adamw")
            if index is not None and id(param) in index.flat:
                _, prefix, group = index.flat[id(param)]
                return bind_fsdp1_flat(param, name, group, head_names, prefix, routers)
            return bind_fsdp1_flat(param, name, context.process_group, head_names, routers=routers)
        entry = None if index is None else index.orig.get(id(param))
        if entry is None:
            raise ValueError(
                f"ds_muon: {name} (now of shape {tuple(param.shape)}) was flattened by FSDP1 "
                "(use_orig_params=True) and its original shape is known only to the wrapped model: pass "
                "Muon(..., model=fsdp_model), the FullyShardedDataParallel root that owns it"
            )
        flat, i, _, group = entry
        return bind_fsdp1_orig(param, name, flat, i, group)

    def grad_final_at_hook(self, param: torch.Tensor, context: BindContext) -> bool:
        return False

    def check_loaded(self, groups, state_dict, name, model) -> None:
        """Refuse a full optimizer state dict whose keys torch's CPU offload overwrote
        (:mod:`~ds_muon.integrations.fsdp1_checkpoint`), before anything loads."""
        check_gathered_keys(groups, state_dict, name, flat_owners(model))

    def _index(self, model: Optional[nn.Module], param) -> Optional[_Fsdp1Index]:
        """The FSDP1 index of ``model``, cached; rebuilt when it does not know ``param``."""
        if model is None:
            return None
        cached = self._indexed
        if cached is not None and cached[0] is model and (id(param) in cached[1].flat or id(param) in cached[1].orig):
            return cached[1]
        if not is_fsdp1_model(model):
            return None
        index = _Fsdp1Index(model)
        self._indexed = (model, index)
        return index


def flat_owners(model) -> Dict[int, int]:
    """``{id(original parameter): id(its FlatParameter)}`` for the tensors FSDP1
    (``use_orig_params=True``) flattened in ``model``; empty for any other model."""
    if not is_fsdp1_model(model):
        return {}
    return {pid: id(entry[0]) for pid, entry in _Fsdp1Index(model).orig.items()}


def is_flattened_by_fsdp1(param) -> bool:
    """A FlatParameter, or an original parameter FSDP1 (``use_orig_params=True``) flattened into one."""
    return is_flat_param(param) or bool(getattr(param, "_fsdp_flattened", False))


def original_is_muon(flat, i: int, head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw") -> bool:
    """The :func:`~ds_muon.models.reading.split_params` rule for original tensor ``i`` of a FlatParameter.

    A tensor shared by several modules (tied weights) takes Muon only if every
    module that uses it would give it Muon (a weight tied to an embedding is AdamW).
    """
    return original_reason(flat, i, head_names, routers).startswith(HIDDEN_MATRIX)


def original_reason(flat, i: int, head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw") -> str:
    """Why original tensor ``i`` of a FlatParameter takes Muon or AdamW (:func:`~ds_muon.models.reading.param_reason`;
    a tied tensor: the first AdamW reason of the modules that share it)."""
    info = flat._param_infos[i]
    shape = tuple(flat._shapes[i])
    # use_orig_params=True keeps the original tensors (flat._params), and with them the user's tags
    # (expert_weight, split_rows, ...): without it a tagged expert stack would read as a raw parameter
    param = flat._params[i] if getattr(flat, "_params", None) is not None else None
    reason = param_reason(info.param_name, shape, info.module_name, info.module, head_names, routers, param)
    for s in flat._shared_param_infos:
        if reason.startswith(HIDDEN_MATRIX) and s.prim_module is info.module and s.prim_param_name == info.param_name:
            reason = param_reason(s.param_name, shape, s.module_name, s.module, head_names, routers, param)
    return reason


def fused_plan_of(module_name: str, module, pname: str, shape):
    """The fused-projection plan the rules give an original tensor (None: not fused)."""
    return param_decision(pname, shape, module_name, module).plan


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
        fused = fused_plan_of(info.module_name, info.module, info.param_name, shape)
        if fused is not None:
            carrier = torch.empty(shape, device="meta")
            if stores_in_out(info.module, info.param_name):
                transposed(carrier)
            return apply_fused_plan(carrier, fused, key)
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
    mixed = False  # an AdamW tensor anywhere in the flat parameter, held here or not
    for i, fqn in enumerate(flat._fqns):
        key = base + fqn
        piece, offset = _shard_piece(flat, i, key)
        muon = original_is_muon(flat, i, head_names, routers)
        mixed = mixed or not muon
        if muon:
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
    return ParamBinding(flat, _flat1, matrices, adam_ranges=merged, group=group, mixed=mixed)


def bind_fsdp1_orig(param, name: str, flat, i: int, group=None) -> ParamBinding:
    """An original parameter under FSDP1 ``use_orig_params=True``: a 1-D view of its local slice."""
    shape = tuple(flat._shapes[i])
    if len(shape) < 2:
        raise ValueError(
            f"ds_muon: {name} (original shape {shape}) is in a Muon group; Muon needs matrices. Build groups "
            "with ds_muon.fsdp.fsdp_param_groups(fsdp_model), or with "
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


def unflattened_meta(model: nn.Module, index: Optional["_Fsdp1Index"] = None) -> nn.Module:
    """The model as it was before FSDP1 wrapped it, on the meta device: the wrapped modules copied without
    their ``FullyShardedDataParallel`` wrappers, each original tensor registered again at its original shape
    (from the FlatParameter's metadata; tied tensors tied again), so its forward can be read."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    index = index or _Fsdp1Index(model)
    memo: Dict[int, object] = _tensor_memo(model)
    wrappers = [m for m in model.modules() if isinstance(m, FSDP)]
    for f in reversed(wrappers):  # innermost first: an outer copy finds its inner wrappers already unwrapped
        memo[id(f)] = copy.deepcopy(f._fsdp_wrapped_module, memo)
    root = memo[id(model)] if id(model) in memo else copy.deepcopy(model, memo)
    for flat, _, _ in index.flat.values():
        made: Dict[Tuple[int, str], nn.Parameter] = {}
        for i, info in enumerate(flat._param_infos):
            shadow = memo.get(id(info.module))
            if shadow is None:
                raise LookupError(f"FSDP1: {info.module_name} was not copied")
            p = nn.Parameter(torch.empty(tuple(flat._shapes[i]), dtype=flat.dtype, device="meta"))
            _register(shadow, info.param_name, p)
            made[(id(info.module), info.param_name)] = p
        for s in flat._shared_param_infos:
            _register(memo[id(s.module)], s.param_name, made[(id(s.prim_module), s.prim_param_name)])
    return root


def _register(module: nn.Module, name: str, p: nn.Parameter) -> None:
    if name in module._parameters:
        del module._parameters[name]
    elif hasattr(module, name):
        delattr(module, name)
    module.register_parameter(name, p)


def fsdp1_groups(model: nn.Module, exclude, include, split_fused: bool, *args, **kwargs) -> Optional[List[dict]]:
    """:func:`fsdp1_param_groups` (``*args, **kwargs``) for a model FSDP1 wrapped: it hides the original shapes,
    read here from its flat parameters; None for any other model (the caller reads it itself)."""
    if not is_fsdp1_model(model):
        return None
    if exclude or include or not split_fused:
        raise NotImplementedError("muon_param_groups: exclude=, include= and split_fused=False need the model "
                                  "before FSDP1 wraps it (or use_orig_params=True after building the groups)")
    return fsdp1_param_groups(model, *args, **kwargs)


def fsdp1_param_groups(model: nn.Module, lr: float = 0.02, adam_lr: float = 3e-4, weight_decay: float = 0.0,
                       adam_weight_decay: float = 0.0, head_names: Sequence[str] = HEAD_NAMES,
                       routers: str = "adamw", example_inputs=None, **muon_options) -> List[dict]:
    """Param groups for a model wrapped by FSDP1 (what :func:`ds_muon.muon_param_groups` returns for one).

    FSDP1 hides the original shapes (``use_orig_params=False``: 1-D FlatParameters;
    ``True``: 1-D views), so the shape rule cannot see them.  Here every FlatParameter
    goes to the Muon group, which carries ``adam_lr``/``adam_weight_decay`` for its
    non-matrix slices, and original parameters are split by their original shapes.
    Fused expert stacks are described from their module when the optimizer binds them
    (FSDP1 hides or flattens the tensors); ``routers`` is kept in the group for that.
    """
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    check_routers(routers)
    index = _Fsdp1Index(model)
    try:  # the forward of the model before wrapping, read on a meta rebuild of it
        traced = trace_forward(unflattened_meta(model, index), example_inputs)
    except Exception as e:  # noqa: BLE001 - the rules decide alone, and say so
        traced = Trace(error=failure(e))
    # every original tensor's binding asks the rules read here (routers are marked there too)
    read_once = read(model, head_names=head_names, routers=routers, trace=traced)
    if traced.error and not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        warnings.warn(f"ds_muon.muon_param_groups: the FSDP1 model's forward could not be read ({traced.error}); "
                      "every original tensor is decided by the config, module types and names. Pass "
                      "example_inputs= (a tensor, tuple or dict for one forward)", UserWarning, stacklevel=3)
    rule = {i: d.reason for i, (_, d) in read_once.decided.items()}  # for tensors FSDP1 left alone
    muon, adam = [], []
    why = {}  # id -> reason, what Muon.summary() shows
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = clean_tensor_name(name)
        if is_flat_param(p):
            prefix = index.flat[id(p)][1] if id(p) in index.flat else ""
            for i, fqn in enumerate(p._fqns):  # raises now for a 3+-D tensor binding could not describe
                if original_is_muon(p, i, head_names, routers):
                    _tag_carrier(p, i, prefix + fqn)
            why[id(p)] = FLAT_REASON
            muon.append((name, p))
        elif id(p) in index.orig:
            flat, i, _, _ = index.orig[id(p)]
            why[id(p)] = original_reason(flat, i, head_names, routers)
            is_muon = why[id(p)].startswith(HIDDEN_MATRIX)
            if is_muon and not is_tagged(p):
                _tag_carrier(flat, i, name)  # raises now for a 3+-D tensor it cannot describe
            (muon if is_muon else adam).append((name, p))
        else:
            why[id(p)] = rule[id(p)]
            (muon if why[id(p)].startswith(HIDDEN_MATRIX) else adam).append((name, p))
    groups = []
    if muon:
        g = {"params": [p for _, p in muon], "param_names": [n for n, _ in muon], "use_muon": True, "lr": lr,
             "param_reasons": [why[id(p)] for _, p in muon], "weight_decay": weight_decay, **muon_options}
        if any(is_flat_param(p) for _, p in muon):
            g.update(adam_lr=adam_lr, adam_weight_decay=adam_weight_decay)
            if tuple(head_names) != HEAD_NAMES:
                g["head_names"] = tuple(head_names)
            if routers != "adamw":
                g["routers"] = routers
        groups.append(g)
    if adam:
        groups.append({"params": [p for _, p in adam], "param_names": [n for n, _ in adam], "use_muon": False,
                       "param_reasons": [why[id(p)] for _, p in adam], "lr": adam_lr,
                       "weight_decay": adam_weight_decay})
    if not groups:
        raise ValueError("fsdp_param_groups: the model has no trainable parameters")
    return groups
