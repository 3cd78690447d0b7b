"""Newton–Schulz orthogonalization: the maths every rank and every stack shares.

One function, batched over leading dimensions, so that a home rank can run all
matrices of one shape as a single stack.  Per matrix the arithmetic is the same
as ``torch.optim._muon._zeropower_via_newtonschulz`` (cast first, then Frobenius
normalisation, then the quintic iteration on the wide orientation); on one CPU
thread the result of a matrix does not depend on which others share its batch,
which is what makes a sharded step bitwise equal to the single-process one.
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple, Union

import torch

Triple = Tuple[float, float, float]
Coefficients = Union[str, Triple, Sequence[Triple]]

KELLER: Triple = (3.4445, -4.7750, 2.0315)

QUINTIC: Tuple[Triple, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# Polar Express, degree 5 (arXiv 2505.16932).  Every triple but the last is
# divided by (1.01, 1.01**3, 1.01**5) for safety; see _POLAR_EXPRESS_NORM_SCALE.
_POLAR_EXPRESS_RAW: Tuple[Triple, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS: Tuple[Triple, ...] = tuple(
    (a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]
) + (_POLAR_EXPRESS_RAW[-1],)
_POLAR_EXPRESS_NORM_SCALE = 1.01

SCHEDULES = {"keller": (KELLER,), "quintic": QUINTIC, "polar_express": POLAR_EXPRESS}


def resolve_coefficients(coefficients: Coefficients, steps: int) -> Tuple[Tuple[Triple, ...], float]:
    """Return (one triple per step, factor on the input norm) or raise ValueError.

    A schedule shorter than ``steps`` repeats its last triple.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"ns_steps must be an integer >= 1, got {steps!r}")
    norm_scale = 1.0
    if isinstance(coefficients, str):
        if coefficients not in SCHEDULES:
            raise ValueError(
                f"ns_coefficients={coefficients!r} is unknown; use one of {sorted(SCHEDULES)}, "
                "a triple (a, b, c) or a list of triples"
            )
        schedule = SCHEDULES[coefficients]
        if coefficients == "polar_express":
            norm_scale = _POLAR_EXPRESS_NORM_SCALE
    else:
        seq = list(coefficients)
        if len(seq) == 3 and all(isinstance(x, (int, float)) for x in seq):
            seq = [tuple(seq)]
        schedule = []
        for t in seq:
            t = tuple(t) if isinstance(t, (tuple, list)) else None
            if t is None or len(t) != 3 or not all(
                isinstance(x, (int, float)) and math.isfinite(x) for x in t
            ):
                raise ValueError(
                    f"ns_coefficients={coefficients!r} is not a triple (a, b, c) of finite numbers "
                    "or a non-empty list of such triples"
                )
            schedule.append(tuple(float(x) for x in t))
        if not schedule:
            raise ValueError("ns_coefficients is an empty list; give at least one (a, b, c) triple")
    schedule = tuple(schedule)
    per_step = tuple(schedule[min(i, len(schedule) - 1)] for i in range(steps))
    return per_step, norm_scale


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """Multiply-add FLOPs of ``steps`` iterations on one (rows, cols) matrix.

    With m = min(rows, cols), n = max: X·Xᵀ is 2m²n, A·A is 2m³, B·X is 2m²n,
    i.e. 4m²n + 2m³ per step.  The planner uses this as the cost of a matrix.
    """
    m, n = min(rows, cols), max(rows, cols)
    return float(steps) * (4.0 * m * m * n + 2.0 * m * m * m)


def newton_schulz(
    G: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = "keller",
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximately orthogonalize each matrix in the last two dims of ``G``.

    Returns a tensor of G's shape in ``dtype``.  Runs on the wide orientation
    (transposes when rows > cols), normalises by each matrix's Frobenius norm
    (clamped below by ``eps``) after casting to ``dtype``.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(G.shape)}")
    per_step, norm_scale = resolve_coefficients(coefficients, steps)
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    batch_shape = X.shape[:-2]
    X = X.reshape(-1, X.size(-2), X.size(-1))
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    if norm_scale != 1.0:
        norm = norm * norm_scale
    X = X / norm.clamp(min=eps)
    for a, b, c in per_step:
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    X = X.reshape(*batch_shape, X.size(-2), X.size(-1))
    return X.mT if tall else X
