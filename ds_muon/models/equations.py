"""Which matrix an ``einsum`` (or ``tensordot``) applies with a parameter: read from its equation.

A research model may keep a weight as a bare tensor of any rank and apply it with an equation:
``einsum("bsd,dhk->bhsk", x, wq)`` with ``wq: [D, H, hd]``, ``einsum("ecd,edf->ecf", x, w)`` with an
expert stack ``w: [E, D, F]``.  Each of the parameter's axes plays one role:

* ``in``: contracted with another operand (absent from the output) — the matrix's input features;
* ``out``: kept in the output and in no other operand — its output features;
* ``stack``: kept in the output *and* shared with another operand (a batch-like axis: experts, heads
  applied per head) — one matrix per member.

So ``wq: [D, H, hd]`` above is one ``[H·hd, D]`` matrix (``h`` is not in ``x``: the heads are output
features of one map), stored ``[in, out…]``; ``einsum("bhsd,hdk->bhsk", x, w)`` with ``w: [H, D, K]``
is a stack of ``H`` matrices ``[K, D]`` (``h`` is in ``x``).  Muon orthogonalizes the matrix the equation
applies, and reads its shape scale from that ``[out, in]`` orientation.

The engine holds a tensor as ``[prod(shape[:k]), prod(shape[k:])]`` for any ``k`` (per stack member for an
expert stack, of ``shape[1:]``), ``[in, out]`` when tagged transposed.  :func:`layout` says whether the roles
fit that (an optional leading stack axis, then a run of axes of one role and a run of the other) and how; a
layout that does not (``[i, o, i]``, a stack axis between matrix axes) is reported, not forced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

IN, OUT, STACK = "in", "out", "stack"


@dataclass(frozen=True)
class Applied:
    """The roles of a parameter's *stored* axes in the map an equation applies (``roles[i]`` for axis
    ``i``; ``""`` for a size-1 axis the equation does not see) and the equation it was read from."""

    roles: Tuple[str, ...]
    equation: str

    def describe(self, shape: Sequence[int]) -> str:
        """``[out, in]`` sizes of the applied matrix, per stack member where there is a stack."""
        def size(role):
            n = 1
            for s, r in zip(shape, self.roles):
                n *= int(s) if r == role else 1
            return n
        stack = size(STACK) if STACK in self.roles else 0
        what = f"[{size(OUT)}, {size(IN)}]"
        return f"{stack} matrices {what}" if stack else f"one {what} matrix"


@dataclass(frozen=True)
class Layout:
    """How the engine holds the applied matrix: a stack on axis 0 (``experts``), stored ``[in, out]``
    (``transposed``), its rows the first ``row_axes`` axes (after the stack axis)."""

    experts: bool
    transposed: bool
    row_axes: int = 1


def parse(equation: str, ranks: Sequence[int]) -> Optional[Tuple[List[str], str]]:
    """``(subscripts per operand, output subscripts)`` with ``...`` spelled out as distinct capitals (an
    implicit output sorted as torch does); None for an equation this reader does not take."""
    eq = equation.replace(" ", "")
    if "->" in eq:
        lhs, rhs = eq.split("->")
    else:
        lhs, rhs = eq, None
    ops = lhs.split(",")
    if len(ops) != len(ranks) or ("..." in eq and any(c.isupper() for c in eq)):
        return None
    ell_rank = 0
    for sub, r in zip(ops, ranks):
        if "..." in sub:
            ell_rank = max(ell_rank, r - len(sub.replace("...", "")))
    fill = "".join(chr(ord("A") + i) for i in range(ell_rank))
    subs = []
    for sub, r in zip(ops, ranks):
        if "..." in sub:
            k = r - len(sub.replace("...", ""))
            sub = sub.replace("...", fill[ell_rank - k:] if k > 0 else "")
        if len(sub) != r or not sub.isalpha():
            return None
        subs.append(sub)
    if rhs is None:
        counts = {}
        for s in subs:
            for c in s:
                counts[c] = counts.get(c, 0) + 1
        out = fill + "".join(sorted(c for c, n in counts.items() if n == 1 and c.islower()))
    else:
        out = rhs.replace("...", fill)
        if not out.isalpha() and out:
            return None
    return subs, out


def tensordot_equation(a_rank: int, b_rank: int, dims) -> Optional[str]:
    """``torch.tensordot(a, b, dims)`` as an einsum equation."""
    if isinstance(dims, int):
        da, db = list(range(a_rank - dims, a_rank)), list(range(dims))
    else:
        try:
            da, db = [list(d) if isinstance(d, (list, tuple)) else [int(d)] for d in dims]
        except (TypeError, ValueError):
            return None
    da, db = [d % a_rank for d in da], [d % b_rank for d in db]
    if len(da) != len(db) or a_rank + b_rank > 52:
        return None
    letters = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    a = [next(letters) for _ in range(a_rank)]
    b = [next(letters) for _ in range(b_rank)]
    for i, j in zip(da, db):
        b[j] = a[i]
    out = [c for i, c in enumerate(a) if i not in da] + [c for j, c in enumerate(b) if j not in db]
    return f"{''.join(a)},{''.join(b)}->{''.join(out)}"


def read(equation: str, ranks: Sequence[int], operand: int, axes: Sequence[Optional[Sequence[int]]],
         stored_rank: int, members: Sequence[int] = ()) -> Optional[Applied]:
    """The roles of the stored axes of the parameter that is operand ``operand`` of ``equation``
    (``axes[k]``: the stored axes operand axis ``k`` spans, the view's slices, reshapes and permutes composed;
    None for a broadcast axis; ``members``: stored axes the view takes only part of, or one index of: they
    pick matrices of a stack).  None where the equation does not apply it as a matrix (no input or no output
    axis, an axis summed over by itself, an axis the equation repeats, a stored axis split across roles, a
    broadcast input or output axis: the same weights in several places)."""
    parsed = parse(equation, ranks)
    if parsed is None:
        return None
    subs, out = parsed
    mine = subs[operand]
    others = "".join(s for i, s in enumerate(subs) if i != operand)
    if len(set(mine)) != len(mine):
        return None  # a diagonal of the parameter
    roles: List[set] = [set() for _ in range(stored_rank)]
    for c, spans in zip(mine, axes):
        if c in out:
            role = STACK if c in others else OUT
        elif c in others:
            role = IN
        else:
            return None  # summed over the parameter alone: not a linear map of the input
        if spans is None:
            if role != STACK:
                return None
            continue
        for s in spans:
            roles[s].add(role)
    for m in members:
        roles[m] = {STACK}
    if any(len(r) > 1 for r in roles):
        return None
    flat = tuple(next(iter(r)) if r else "" for r in roles)
    if IN not in flat or OUT not in flat:
        return None
    return Applied(flat, equation)


def layout(applied: Applied) -> Optional[Layout]:
    """How the engine holds the matrices ``applied`` describes; None where no ``[prod(shape[:k]), rest]`` view
    holds them (a stack axis not first, the roles of the matrix axes not one run of each)."""
    roles = applied.roles
    experts = roles[0] == STACK
    matrix = roles[1:] if experts else roles
    seen = [r for r in matrix if r]
    if len(matrix) < 2 or STACK in seen or not seen:
        return None
    first = seen[0]
    runs = [r for i, r in enumerate(seen) if i == 0 or r != seen[i - 1]]
    if len(runs) != 2:
        return None
    k = max(i for i, r in enumerate(matrix) if r == first) + 1
    return Layout(experts=experts, transposed=first == IN, row_axes=k)
