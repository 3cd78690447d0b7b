"""Tags that tell ds_muon what a tensor's shape alone does not: split row blocks,
tensor-parallel shards, stacks of expert matrices, and the process group (domain)
a tensor's replicas live in.

Tags are attributes on the tensor, so they survive being put into param groups;
each helper returns the tensor it tagged.  Adapters turn them into matrix slots
through :mod:`ds_muon.engine.exchange.slots`; the optimizer reads :func:`domain_of`.  What each
stack supports is in ``docs/ADVANCED.md``.

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
* :func:`row_axes` — an N-D weight whose rows are its first ``k`` axes (``wo: [H, hd, D]`` applied as
  one ``[H·hd, D]`` matrix), per expert for a stack.
* :func:`domain` — the tensor's replicas live in ``group`` (expert data-parallel
  group) rather than the optimizer's ``process_group``; each domain gets its own
  Layout, plan and fused exchange.
* :func:`fused_blocks` — blocks of a fused projection that are not row ranges: column
  blocks of an ``[in, out]`` weight (GPT-2's ``c_attn``), rows interleaved per head
  (GPT-NeoX's ``query_key_value``), columns interleaved (gpt-oss's ``gate_up_proj``).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Union

import torch

from ..tensors.shape import global_shape
from ..tensors.shape import matrix_shape
from ..tensors.tag_keys import BLOCKS, DOMAIN, EXPERTS, ROW_AXES, SPLIT_ROWS, TENSOR_PARALLEL, TRANSPOSED, row_axes_of


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


def _run(spec, extent: int, what: str, label: str):
    """``(start, length, count, period)`` from ``None`` (all), ``(start, length)`` or the full form."""
    if spec is None:
        return (0, extent, 1, extent)
    spec = tuple(int(v) for v in spec)
    if len(spec) == 2:
        spec = spec + (1, spec[1])
    if len(spec) != 4:
        raise ValueError(f"ds_muon.fused_blocks: block {label!r}: {what} must be None, (start, length) or "
                         f"(start, length, count, period), got {spec}")
    start, length, count, period = spec
    if start < 0 or length <= 0 or count <= 0 or (count > 1 and period < length) or \
            start + (count - 1) * period + length > extent:
        raise ValueError(f"ds_muon.fused_blocks: block {label!r}: {what} {spec} do not fit in {extent} "
                         "(runs must be positive, apart by at least their length, inside the matrix)")
    return (start, length, count, period if count > 1 else length)


def _mask(run, extent: int) -> torch.Tensor:
    start, length, count, period = run
    m = torch.zeros(extent, dtype=torch.bool)
    for i in range(count):
        m[start + i * period:start + i * period + length] = True
    return m


def fused_blocks(param: torch.Tensor, blocks: Dict[str, tuple]):
    """Orthogonalize blocks of a fused weight apart: ``{label: (rows, cols)}``, each of ``rows`` and
    ``cols`` ``None`` (all), ``(start, length)`` or ``(start, length, count, period)`` (``count``
    runs of ``length``, ``period`` apart: rows interleaved per head, columns interleaved).

    Rows and columns are those of the matrix as stored (``[in, out]`` for a :func:`transposed`
    weight, whose output blocks are columns; per expert for an :func:`expert_weight` stack).
    The blocks must partition the matrix.  Keys are ``name[label]`` (``name[e][label]``).
    Returns ``param``.
    """
    shape = global_shape(param)
    if len(shape) < 2:
        raise ValueError(f"ds_muon.fused_blocks: {_what(param)} is not a matrix")
    if getattr(param, SPLIT_ROWS, None) is not None or getattr(param, TENSOR_PARALLEL, None) is not None:
        raise NotImplementedError("ds_muon.fused_blocks: a tensor tagged split_rows or tensor_parallel cannot "
                                  "also take fused blocks")
    experts = bool(getattr(param, EXPERTS, False))
    rows, cols = matrix_shape(shape[1:] if experts else shape, row_axes_of(param))
    spec = []
    for label, (r, c) in dict(blocks).items():
        spec.append((str(label), _run(r, rows, "rows", label), _run(c, cols, "cols", label)))
    if len({lab for lab, _, _ in spec}) != len(spec) or not spec:
        raise ValueError(f"ds_muon.fused_blocks: block labels {[lab for lab, _, _ in spec]} repeat or are none")
    masks = [(_mask(r, rows), _mask(c, cols)) for _, r, c in spec]
    total = sum(int(mr.sum()) * int(mc.sum()) for mr, mc in masks)
    overlap = any(bool((a[0] & b[0]).any()) and bool((a[1] & b[1]).any())
                  for i, a in enumerate(masks) for b in masks[i + 1:])
    if total != rows * cols or overlap:
        raise ValueError(f"ds_muon.fused_blocks: the blocks {dict(blocks)} do not partition the [{rows}, {cols}] "
                         f"matrix of {_what(param)} (every element must be in exactly one block)")
    setattr(param, BLOCKS, tuple(spec))
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
    """A 2-D weight stored as ``[in, out]`` (GPT-2's ``Conv1D``), an :func:`expert_weight`
    stack stored ``[E, in, out]``, or an N-D weight stored ``[in, out…]`` (one ``[in, prod(out…)]``
    matrix: an einsum's ``[D, H, hd]``): its scale factor is read from ``[out, in]``.
    Newton–Schulz needs nothing (orthogonalizing Gᵀ gives the transpose).
    :func:`ds_muon.muon_param_groups` tags ``Conv1D`` weights itself.  Returns ``param``."""
    if len(global_shape(param)) < 2:
        raise ValueError(f"ds_muon.transposed: {_what(param)}; a transposed weight is an [in, out] matrix "
                         "(tag a stack [E, in, out] ds_muon.expert_weight first)")
    if getattr(param, SPLIT_ROWS, None) is not None and getattr(param, BLOCKS, None) is None:
        raise NotImplementedError("ds_muon.transposed: row blocks of an [in, out] weight would split the wrong "
                                  "axis; split_rows and transposed do not combine")
    setattr(param, TRANSPOSED, True)
    return param


def row_axes(param: torch.Tensor, k: int):
    """The matrix ``param`` holds is ``[prod(shape[:k]), prod(shape[k:])]`` (per member of an
    :func:`expert_weight` stack: of ``shape[1:]``), not ``[shape[0], rest]``: ``wo: [H, hd, D]`` that
    ``einsum("bhsk,hkd->bsd", a, wo)`` applies as one ``[H·hd, D]`` matrix is ``row_axes(wo, 2)`` and
    :func:`transposed` (its rows are inputs).  The matrix is a contiguous view of the stored elements, so
    every stack holds it as it holds ``[shape[0], rest]``.  :func:`ds_muon.muon_param_groups` tags the
    layouts the traced forward applies so.  Returns ``param``."""
    shape = global_shape(param)
    axes = len(shape) - (1 if getattr(param, EXPERTS, False) else 0)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < axes:
        raise ValueError(f"ds_muon.row_axes: k={k!r} for {_what(param)}; the rows are 1 to {axes - 1} leading "
                         "axes (after the expert axis of a stack: tag ds_muon.expert_weight first)")
    if getattr(param, TENSOR_PARALLEL, None) is not None and k != 1:
        raise NotImplementedError("ds_muon.row_axes: a tensor_parallel shard is a 2-D matrix already")
    if getattr(param, SPLIT_ROWS, None) is not None or getattr(param, BLOCKS, None) is not None:
        raise NotImplementedError(f"ds_muon.row_axes: tag {_what(param)} row_axes before split_rows or "
                                  "fused_blocks, whose blocks are rows and columns of that matrix")
    setattr(param, ROW_AXES, k if k != 1 else None)
    return param


def domain(param: torch.Tensor, group):
    """Put ``param`` (Muon or AdamW) in the domain of process group ``group``: its replicas or
    shards live on the ranks of ``group`` (expert data parallelism).  Returns ``param``."""
    setattr(param, DOMAIN, group)
    return param


# -- tags that travel with param groups ---------------------------------------------


