"""No wrapper, or DDP: every rank holds every matrix whole; and tensor-parallel shards.

:class:`LocalAdapter` describes both.  A :func:`~ds_muon.models.tags.tensor_parallel` shard
is a plain tensor holding a row range or column block of the global weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..engine.exchange.layout import MatrixSlot, ParamBinding, Piece
from ..engine.exchange.slots import block_slots, tp_slots
from ..tensors.tag_keys import TENSOR_PARALLEL, domain_of, is_tagged, is_transposed
from .base import BindContext, single_process


class LocalAdapter:
    """Tensors every rank of the optimizer's group holds whole (no wrapper, DDP, DeepSpeed
    stage 0), or holds a tensor-parallel shard of; a :func:`~ds_muon.domain` tag narrows the group."""

    applies_in_step = False
    data_parallel_group = None

    def bind(self, param: torch.Tensor, name: str, context: BindContext) -> ParamBinding:
        return bind_replicated(param, name, context.process_group)

    def grad_final_at_hook(self, param: torch.Tensor, context: BindContext) -> bool:
        """Only in one process: DDP (or a hand-written all-reduce) averages gradients after the hook."""
        return single_process(context.process_group)


def bind_replicated(param: torch.Tensor, name: str, group=None) -> ParamBinding:
    """Each rank of ``group`` holds the full tensor, ``[0, numel)`` of its flattening.

    A :func:`~ds_muon.domain` tag replaces ``group``; split-row and expert tags make
    one slot per logical matrix (see :mod:`ds_muon.engine.exchange.slots`).
    """
    group = domain_of(param, group)
    if getattr(param, TENSOR_PARALLEL, None) is not None:
        return bind_tensor_parallel(param, name, group)
    order = memory_order(param, name)
    piece = Piece(0, param.numel())
    if order is COPIED:
        if is_tagged(param):
            raise NotImplementedError(
                f"ds_muon: {name} (shape {tuple(param.shape)}, strides {param.stride()}) is tagged (split rows / "
                "experts) and has no flat view; make the parameter contiguous")
        return ParamBinding(param=param, flat=lambda t: t.reshape(-1), group=group, copied=True,
                            matrices=[MatrixSlot(name, tuple(param.shape), piece, 0, transposed=is_transposed(param))])
    if order is None:
        slots = (block_slots(param, name, 0, param.numel()) if is_tagged(param)
                 else [MatrixSlot(name, tuple(param.shape), piece, 0, transposed=is_transposed(param))])
        return ParamBinding(param=param, flat=lambda t: t.reshape(-1), matrices=slots, group=group)
    if is_tagged(param):
        raise NotImplementedError(
            f"ds_muon: {name} (shape {tuple(param.shape)}, strides {param.stride()}) is tagged (split rows / experts) "
            "and not contiguous; make the parameter contiguous")
    # the matrix in memory order: [d0, prod(other dims in memory order)], a column
    # permutation of the logical [d0, prod(d1..)] (see memory_order)
    shape = tuple(param.shape[d] for d in order)
    return ParamBinding(param=param, flat=_memory_order_flat(order),
                        matrices=[MatrixSlot(name, shape, piece, 0, transposed=is_transposed(param))], group=group)


COPIED = "copied"  # memory_order's answer for a tensor with no flat view


def memory_order(param: torch.Tensor, name: str):
    """None for a contiguous tensor; for a dense tensor stored in another dimension order
    with dim 0 outermost (``channels_last`` conv weights: ``[O, I, kh, kw]`` stored as
    ``[O, kh, kw, I]``), that order.  Anything else raises ValueError.

    Muon then orthogonalizes ``[O, kh*kw*I]``, a column permutation of the logical
    ``[O, I*kh*kw]``: orthogonalization commutes with column permutations, so the update
    equals the contiguous model's up to rounding (not bitwise).

    :data:`COPIED` for any other layout (a strided slice such as ``w[..., 0]``, strides
    ``(10, 2)``): no flat view exists, so the step reads a row-major copy and copies the
    result back; the update is then bitwise the contiguous tensor's.
    """
    if param.is_contiguous():
        return None
    sizes, strides = param.shape, param.stride()
    order = sorted(range(param.ndim), key=lambda d: (-strides[d], d))
    expected = 1
    dense = True
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != expected:
            dense = False
        expected *= sizes[d]
    if not dense or order[0] != 0 and sizes[0] != 1:
        return COPIED  # no flat view: Muon reads a copy and copies the result back (as torch.optim steps it)
    if order[0] != 0:
        order.remove(0)
        order.insert(0, 0)
    return tuple(order)


def _memory_order_flat(order):
    """``flat`` for a permuted binding: a view of the parameter and of tensors laid out
    like it (momentum buffers: ``zeros_like`` keeps the layout, and the optimizer
    re-lays loaded ones); a copy, good for reading only, of others (a contiguous grad)."""
    return lambda t: t.permute(order).reshape(-1)


def bind_tensor_parallel(param: torch.Tensor, name: str, group=None) -> ParamBinding:
    """A :func:`~ds_muon.tensor_parallel` shard: a row range (column-parallel) or column block
    (row-parallel) of the global weight; ``group`` spans tensor × data parallelism."""
    group = domain_of(param, group)
    tp_group = getattr(param, TENSOR_PARALLEL)[0]
    if dist.is_available() and dist.is_initialized() and tp_group is not None:
        outer = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        inner = set(dist.get_process_group_ranks(tp_group))
        if not inner <= outer:
            raise ValueError(
                f"ds_muon: {name}: its tensor-parallel group (ranks {sorted(inner)}) is not inside the group the "
                f"optimizer plans it in (ranks {sorted(outer)}); pass tensor_parallel(..., domain_group=) the "
                "group spanning tensor and data parallelism")
    return ParamBinding(param=param, flat=lambda t: t.reshape(-1), matrices=tp_slots(param, name), group=group)
