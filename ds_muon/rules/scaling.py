"""Per-matrix update scale: how the orthogonalized update's size follows the shape.

The update of an (out, in) matrix is multiplied by this factor; ``lr`` stays as
given.  Modes follow the literature so results compare across codebases.
"""

from __future__ import annotations

import math

SCALE_MODES = ("shape_scaling", "spectral", "unit_rms_norm", "none")


def check_scale_mode(mode: str) -> str:
    if mode not in SCALE_MODES:
        raise ValueError(f"scale_mode={mode!r} is unknown; use one of {list(SCALE_MODES)}")
    return mode


def get_muon_scale_factor(
    size_out: int, size_in: int, mode: str = "shape_scaling", extra_scale_factor: float = 1.0
) -> float:
    """Scale of the update of a (size_out, size_in) matrix.

    ``shape_scaling``: max(1, out/in) ** 0.5 (Keller Jordan; torch.optim.Muon "original").
    ``spectral``: max(out, in) ** 0.5 (Scion/Kimi; ×0.2 matches AdamW's RMS as in Moonlight).
    ``unit_rms_norm``: (out/in) ** 0.5.  ``none``: 1.
    """
    check_scale_mode(mode)
    if size_out < 1 or size_in < 1:
        raise ValueError(f"matrix sizes must be positive, got ({size_out}, {size_in})")
    if mode == "shape_scaling":
        factor = math.sqrt(max(1.0, size_out / size_in))
    elif mode == "spectral":
        factor = math.sqrt(max(size_out, size_in))
    elif mode == "unit_rms_norm":
        factor = math.sqrt(size_out / size_in)
    else:
        factor = 1.0
    return factor * extra_scale_factor
