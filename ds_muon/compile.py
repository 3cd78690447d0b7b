"""Plan: from a Layout's active matrices to compiled :class:`~ds_muon.exchange.Exchange` objects.

Per matrix: the dtypes that cross the wire (lossless by default: what NS would cast
to anyway), which matrices share one batched NS call (shape and NS settings), and
its home (:func:`~ds_muon.planner.plan_homes`, or every rank in the duplicated
baseline); then the matrices are cut into waves of about equal NS work.  The result
depends only on the layout, the active matrices and the settings, so the optimizer
compiles once per :func:`exchange_key` and reuses it every step.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, NamedTuple, Optional, Tuple

import torch

from .exchange import Exchange
from .groups import as_dtype
from .layout import Layout
from .newton_schulz import compute_dtype, input_dtype, newton_schulz, ns_flops, resolve_coefficients
from .planner import CostModel, MatrixTask, plan_homes


class NSSettings(NamedTuple):
    """A group's Newton–Schulz settings, in :func:`~ds_muon.newton_schulz.newton_schulz`'s order."""

    steps: int
    coefficients: object
    dtype: torch.dtype  # the dtype NS computes in (the method may pick it)
    eps: float
    method: str

    def run(self, stack: torch.Tensor) -> torch.Tensor:
        return newton_schulz(stack, *self).contiguous()


def _ns_fields(group: dict) -> tuple:
    return group["ns_steps"], group["ns_coefficients"], group["ns_dtype"], group["eps"], group["ns_method"]


def ns_settings(group: dict) -> NSSettings:
    steps, coefficients, dtype, eps, method = _ns_fields(group)
    return NSSettings(steps, coefficients, compute_dtype(method, as_dtype(dtype, "ns_dtype")), eps, method)


def exchange_key(layout: Layout, todo: List[int], param_groups) -> tuple:
    """What compiled exchanges depend on: the layout, its active matrices, and the NS
    settings of every Muon group (they pick dtypes and stacks, and may change between steps)."""
    return id(layout), tuple(todo), tuple(repr(_ns_fields(g)) for g in param_groups if g["use_muon"])


def compile_exchanges(layout: Layout, todo: List[int], group_of: Dict[int, dict], *, mode: str, planner: str,
                      cost_model: CostModel, comm_dtype: Optional[torch.dtype],
                      waves: int) -> List[Tuple[Exchange, Dict[Hashable, NSSettings]]]:
    """Plan homes and build one Exchange per (gather, scatter) dtype pair and wave; each
    comes with the NS settings of its stacks.  ``group_of`` maps a tensor's id to its group."""
    by_dtypes: Dict[tuple, List[int]] = {}
    stack_key: Dict[int, Hashable] = {}
    ns_of: Dict[Hashable, NSSettings] = {}
    ns_at: Dict[int, NSSettings] = {}
    device = None
    for i in todo:
        b, _ = layout.local[i]
        ns = ns_at[i] = ns_settings(group_of[id(b.param)])
        info = layout.matrices[i]
        mom_dtype = b.flat(b.param).dtype
        device = b.flat(b.param).device
        if comm_dtype is not None:
            dts = (comm_dtype, comm_dtype)
        else:  # lossless: NS casts its input to this dtype first anyway
            first = input_dtype(ns.dtype)
            dts = (first if first.itemsize <= mom_dtype.itemsize else mom_dtype, ns.dtype)
        by_dtypes.setdefault(dts, []).append(i)
        coeffs, _ = resolve_coefficients(ns.coefficients, ns.steps)
        skey = (info.rows, info.cols, ns.steps, coeffs, ns.dtype, ns.eps, ns.method)
        stack_key[i] = skey
        ns_of[skey] = ns
    compiled = []
    for (gdt, sdt), idx in by_dtypes.items():
        if mode == "duplicated":
            homes = {i: tuple(range(layout.world_size)) for i in idx}
        else:
            tasks = [
                MatrixTask(layout.matrices[i].rows, layout.matrices[i].cols, ns_at[i].steps, gdt.itemsize,
                           tuple(layout.matrices[i].held_numel(r) for r in range(layout.world_size)), ns_at[i].method)
                for i in idx
            ]
            plan = plan_homes(tasks, layout.world_size, planner, cost_model)
            homes = {i: (h,) for i, h in zip(idx, plan.homes)}
        cost = [ns_flops(layout.matrices[i].rows, layout.matrices[i].cols, ns_at[i].steps, ns_at[i].method) for i in idx]
        for wave in split_waves(idx, cost, waves):
            compiled.append((Exchange(layout, wave, homes, stack_key, gdt, sdt, device), ns_of))
    return compiled


def split_waves(idx: List[int], cost: List[float], waves: int) -> List[List[int]]:
    """Contiguous runs of the matrices in model order with about equal NS work (``cost``)
    each, so early waves hold the parameters the next forward needs first."""
    if waves <= 1 or len(idx) <= 1:
        return [list(idx)]
    total, out, cur, acc = sum(cost), [], [], 0.0
    for i, c in zip(idx, cost):
        cur.append(i)
        acc += c
        if acc >= total * (len(out) + 1) / waves and len(out) < waves - 1:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out
