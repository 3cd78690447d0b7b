"""Newton–Schulz's coefficient schedules: the named ones and the check of a user's own.

Each NS step computes ``X ← aX + (bA + cA²)X`` with ``A = XXᵀ``; a schedule is one ``(a, b, c)`` per
step (``"keller"``: one triple repeated; ``"quintic"``, ``"polar_express"``: one per step, the last
repeated), or the user's own triple or list of triples.  :func:`resolve_coefficients` turns any of them
into one triple per step and the factor on the input norm (Polar Express's safety margin).
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple, Union

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
