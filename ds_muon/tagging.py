"""Tags that tell ds_muon what a tensor's shape alone does not: split row blocks,
tensor-parallel shards, stacks of expert matrices, and the process group (domain)
a tensor's replicas live in.

Tags are attributes on the tensor, so they survive being put into param groups;
each helper returns the tensor it tagged.  Binders read them through
:func:`logical_blocks`, :func:`block_slots` and :func:`tp_slots`; the optimizer
reads :func:`domain_of`.  What each stack supports is in ``docs/ADVANCED.md``.

* :func:`split_rows` — the rows of a weight are independent matrices (a fused
  ``[q | k | v]`` projection with GQA sizes, or one block per head).  Each block
  is its own Newton–Schulz task with its own home and its own scale factor.
* :func:`tensor_parallel` — the tensor is this rank's shard of a Megatron/TE
  weight split over a tensor-parallel group along ``partition_dim`` 0
  (column-parallel: a row range) or 1 (row-parallel: a column block).  The
  logical matrix, and so the scale factor, is the global one.
* :func:`expert_weight` — a 3-D ``[E, out, in]`` tensor is ``E`` matrices.
* :func:`transposed` — a 2-D weight (or expert stack) stored ``[in, out]``; its
  scale factor is read from ``[out, in]``.
* :func:`domain` — the tensor's replicas live in ``group`` (expert data-parallel
  group) rather than the optimizer's ``process_group``; each domain gets its own
  Layout, plan and fused exchange.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .layout import MatrixSlot, Piece, global_shape, matrix_shape, slots_in_range

SPLIT_ROWS = "_ds_muon_split_rows"  # tuple of (label, rows)
TENSOR_PARALLEL = "_ds_muon_tp"  # (tp group, partition_dim)
EXPERTS = "_ds_muon_experts"  # True: dim 0 indexes matrices
DOMAIN = "_ds_muon_domain"  # process group of the tensor's replicas / shards
TRANSPOSED = "_ds_muon_transposed"  # True: stored as [in, out] (GPT-2's Conv1D)

Block = Tuple[str, Tuple[int, int], int]  # key, 2-D shape, start in the tensor's row-major flattening


def _what(param) -> str:
    return f"a tensor of shape {global_shape(param)}"


def split_rows(param: torch.Tensor, sizes: Union[Sequence[int], Dict[str, int]], names: Optional[Sequence[str]] = None):
    """Orthogonalize row blocks of ``param`` independently: ``sizes`` rows each, top to bottom.

    ``sizes`` is a list of row counts (blocks are labelled ``0, 1, …`` unless
    ``names`` are given) or a dict ``{label: rows}`` in order, e.g. a fused GQA
    projection ``{"q": 32, "k": 8, "v": 8}``.  The sizes must add up to the rows
    of the matrix Muon sees (``shape[0]``; ``shape[1]`` of an :func:`expert_weight`,
    whose every expert is split alike; the *global* rows of a
    :func:`tensor_parallel` shard).  Returns ``param``.
    """
    if getattr(param, TRANSPOSED, False):
        raise NotImplementedError(f"ds_muon.split_rows: {_what(param)} is stored [in, out] (ds_muon.transposed): "
                                  "its rows are inputs, not blocks of outputs")
    if isinstance(sizes, dict):
        if names is not None:
            raise ValueError("ds_muon.split_rows: give labels either as dict keys or as names=, not both")
        labels, counts = [str(k) for k in sizes], list(sizes.values())
    else:
        counts = list(sizes)
        labels = [str(n) for n in names] if names is not None else [str(i) for i in range(len(counts))]
    if len(labels) != len(counts):
        raise ValueError(f"ds_muon.split_rows: {len(labels)} names for {len(counts)} blocks")
    if len(set(labels)) != len(labels):
        raise ValueError(f"ds_muon.split_rows: block names {labels} repeat")
    if not counts or any(not isinstance(c, int) or isinstance(c, bool) or c <= 0 for c in counts):
        raise ValueError(f"ds_muon.split_rows: sizes must be positive ints, got {list(counts)} for {_what(param)}")
    if len(global_shape(param)) < 2:
        raise ValueError(f"ds_muon.split_rows: {_what(param)} is not a matrix")
    setattr(param, SPLIT_ROWS, tuple(zip(labels, counts)))
    return param


def tensor_parallel(param: torch.Tensor, group, partition_dim: int, domain_group=None):
    """``param`` is this rank's shard of a weight split evenly over the tensor-parallel ``group``.

    ``partition_dim=0``: column-parallel (Megatron ``ColumnParallelLinear``, TE
    ``parallel_mode="column"``): the rank holds rows ``[k·m, (k+1)·m)`` of the
    global ``[m·tp, n]`` weight, ``k`` its rank in ``group``.  ``partition_dim=1``:
    row-parallel: it holds columns ``[k·n, (k+1)·n)`` of the global ``[m, n·tp]``.
    ``domain_group`` is the process group spanning tensor × data parallelism in
    which the optimizer plans homes and exchanges (default: the optimizer's
    ``process_group``, i.e. the world); it must contain ``group``.  Returns ``param``.
    """
    if partition_dim not in (0, 1):
        raise ValueError(f"ds_muon.tensor_parallel: partition_dim must be 0 (column-parallel) or 1 "
                         f"(row-parallel), got {partition_dim!r} for {_what(param)}")
    if param.ndim != 2:
        raise ValueError(f"ds_muon.tensor_parallel: {_what(param)}; tensor-parallel shards must be 2-D "
                         "Linear weights")
    if getattr(param, EXPERTS, False):
        raise NotImplementedError("ds_muon.tensor_parallel: expert weights split over tensor parallelism are not "
                                  "supported")
    setattr(param, TENSOR_PARALLEL, (group, partition_dim))
    if domain_group is not None:
        setattr(param, DOMAIN, domain_group)
    return param


def expert_weight(param: torch.Tensor, domain_group=None):
    """A 3-D (or higher) ``[E, out, in…]`` expert weight: ``E`` matrices ``[out, prod(in…)]``.

    ``domain_group``: the expert data-parallel group that holds replicas (or
    shards) of these experts, when it differs from the optimizer's
    ``process_group``.  Returns ``param``.
    """
    if len(global_shape(param)) < 3:
        raise ValueError(f"ds_muon.expert_weight: {_what(param)}; an expert stack is [E, out, in]")
    if getattr(param, TENSOR_PARALLEL, None) is not None:
        raise NotImplementedError("ds_muon.expert_weight: expert weights split over tensor parallelism are not "
                                  "supported")
    setattr(param, EXPERTS, True)
    if domain_group is not None:
        setattr(param, DOMAIN, domain_group)
    return param


def transposed(param: torch.Tensor):
    """A 2-D weight stored as ``[in, out]`` (GPT-2's ``Conv1D``), or an :func:`expert_weight`
    stack stored ``[E, in, out]``: its scale factor is read from ``[out, in]``.
    Newton–Schulz needs nothing (orthogonalizing Gᵀ gives the transpose).
    :func:`ds_muon.muon_param_groups` tags ``Conv1D`` weights itself.  Returns ``param``."""
    if len(global_shape(param)) != 2 and not getattr(param, EXPERTS, False):
        raise ValueError(f"ds_muon.transposed: {_what(param)}; a transposed weight is a 2-D [in, out] matrix "
                         "(tag a stack [E, in, out] ds_muon.expert_weight first)")
    if getattr(param, SPLIT_ROWS, None) is not None:
        raise NotImplementedError("ds_muon.transposed: row blocks of an [in, out] weight would split the wrong "
                                  "axis; split_rows and transposed do not combine")
    setattr(param, TRANSPOSED, True)
    return param


def is_transposed(param: torch.Tensor) -> bool:
    return bool(getattr(param, TRANSPOSED, False))


def domain(param: torch.Tensor, group):
    """Put ``param`` (Muon or AdamW) in the domain of process group ``group``: its replicas or
    shards live on the ranks of ``group`` (expert data parallelism).  Returns ``param``."""
    setattr(param, DOMAIN, group)
    return param


def domain_of(param: torch.Tensor, default=None):
    """The process group a tensor's replicas live in: its :func:`domain` tag, else ``default``."""
    return getattr(param, DOMAIN, default)


def is_tagged(param: torch.Tensor) -> bool:
    """Does ``param`` carry a tag that changes which matrices it holds?"""
    return any(getattr(param, a, None) is not None for a in (SPLIT_ROWS, TENSOR_PARALLEL)) or bool(
        getattr(param, EXPERTS, False))


def clear_tags(param: torch.Tensor) -> torch.Tensor:
    for a in (SPLIT_ROWS, TENSOR_PARALLEL, EXPERTS, DOMAIN):
        if hasattr(param, a):
            delattr(param, a)
    return param


# -- tags that travel with param groups ---------------------------------------------
SHAPE_TAGS = (SPLIT_ROWS, EXPERTS, TRANSPOSED)  # which matrices a tensor holds, and how each scales


def shape_tags(param: torch.Tensor) -> Optional[dict]:
    """The tensor's shape tags as plain values, with its shape (None when untagged): what
    :func:`ds_muon.muon_param_groups` records in a group as ``param_tags``."""
    tags = {a: getattr(param, a) for a in SHAPE_TAGS if getattr(param, a, None)}
    return {"shape": tuple(global_shape(param)), **tags} if tags else None


def restore_tags(param: torch.Tensor, recorded: Optional[dict]) -> None:
    """Put recorded tags back on a tensor a stack swapped in for the tagged one (FSDP2's
    ``fully_shard`` or accelerate after the optimizer was built), so a fused expert stack is
    not silently one matrix.  Only on an untagged tensor of the recorded shape: a flat
    partition (DeepSpeed) or a tensor the user re-tagged is left as it is."""
    if not recorded or any(getattr(param, a, None) for a in SHAPE_TAGS):
        return
    if tuple(global_shape(param)) != tuple(recorded["shape"]):
        return
    for a in SHAPE_TAGS:
        if a in recorded:
            setattr(param, a, recorded[a])


# -- what binders use -------------------------------------------------------------
def logical_blocks(param: torch.Tensor, name: str, shape: Optional[Sequence[int]] = None) -> List[Block]:
    """The logical matrices of a tensor of global ``shape`` (default ``param.shape``).

    Each is ``(key, (rows, cols), start)``: a contiguous range of the tensor's
    row-major flattening.  An untagged tensor is one matrix keyed ``name`` with
    its own shape (conv weights stay ``[out, in·k·k]``); blocks are keyed
    ``name[label]``, experts ``name[e]``.
    """
    shape = tuple(int(s) for s in (global_shape(param) if shape is None else shape))
    split = getattr(param, SPLIT_ROWS, None)
    if getattr(param, EXPERTS, False):
        if len(shape) < 3:
            raise ValueError(f"ds_muon: {name} is tagged expert_weight but has shape {shape}; expected [E, out, in]")
        mshape = (shape[1], math.prod(shape[2:]))
        size = mshape[0] * mshape[1]
        bases = [(f"{name}[{e}]", e * size) for e in range(shape[0])]
    else:
        if split is None:
            return [(name, shape, 0)]
        mshape = matrix_shape(shape)
        bases = [(name, 0)]
    if split is None:
        return [(k, mshape, s) for k, s in bases]
    total = sum(n for _, n in split)
    if total != mshape[0]:
        raise ValueError(
            f"ds_muon: {name}: split_rows sizes {[n for _, n in split]} add up to {total} rows but the matrix "
            f"has {mshape[0]} (shape {shape}{', per expert' if getattr(param, EXPERTS, False) else ''})")
    out = []
    for key, start in bases:
        r0 = 0
        for label, n in split:
            out.append((f"{key}[{label}]", (n, mshape[1]), start + r0 * mshape[1]))
            r0 += n
    return out


def block_slots(param: torch.Tensor, name: str, lo: int, hi: int, local_offset: int = 0,
                shape: Optional[Sequence[int]] = None) -> List[MatrixSlot]:
    """Slots for a rank holding ``[lo, hi)`` of the tensor's global flattening at ``local_offset``
    of its flat local data (pieces clipped to each block; None where it holds none of one)."""
    blocks = logical_blocks(param, name, shape)
    if hi <= lo:
        slots = [MatrixSlot(k, tuple(s), None, 0) for k, s, _ in blocks]
    else:
        slots = slots_in_range(blocks, lo, hi)
    for s in slots:
        if s.piece is not None:
            s.local_offset += local_offset
        s.transposed = is_transposed(param)
    return slots


def tp_slots(param: torch.Tensor, name: str) -> List[MatrixSlot]:
    """This rank's slots of a :func:`tensor_parallel` shard (global shapes, TP pieces)."""
    group, pdim = getattr(param, TENSOR_PARALLEL)
    if not (dist.is_available() and dist.is_initialized()):
        tp, k = 1, 0
    else:
        tp, k = dist.get_world_size(group), dist.get_rank(group)
    if k < 0:
        raise ValueError(f"ds_muon: {name} is tagged tensor_parallel with a group this rank is not in")
    if param.ndim != 2:
        raise ValueError(f"ds_muon: {name}: tensor-parallel shard of shape {tuple(param.shape)}; expected 2-D")
    if not param.is_contiguous():
        raise ValueError(f"ds_muon: {name}: the tensor-parallel shard is not contiguous; Muon updates it in place "
                         "through a flat view")
    m, n = (int(s) for s in param.shape)
    if pdim == 0:  # column-parallel: rows [k·m, (k+1)·m) of [m·tp, n] — a contiguous range
        gshape = (m * tp, n)
        return block_slots(param, name, k * m * n, (k + 1) * m * n, 0, gshape)
    gshape = (m, n * tp)  # row-parallel: columns [k·n, (k+1)·n) of every row
    c0, c1 = k * n, (k + 1) * n
    slots = []
    for key, bshape, start in logical_blocks(param, name, gshape):
        rows, cols = matrix_shape(bshape)
        r0 = start // cols
        piece = Piece.block((rows, cols), 0, rows, c0, c1) if n > 0 and rows > 0 else None
        slots.append(MatrixSlot(key, tuple(bshape), piece if piece and piece.numel else None,
                                r0 * n if piece and piece.numel else 0, transposed=is_transposed(param)))
    return slots
