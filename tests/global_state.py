"""The process-wide state a test could leave behind for the next test in the same process (or pooled rank):
read before and after each test by ``conftest.py`` and each pooled call by ``dist_harness``, so a leak fails
the test that made it instead of changing the bits of whichever test runs next.

What is read: torch's numerics switches (threads, default dtype and device, deterministic algorithms, matmul
precision, oneDNN, TF32 and the fp32_precision switches, grad and anomaly modes), ds_muon's own per-process pins (NS kernel forms, chunk
budget, the step's memory bound, what ``ns_dtype="auto"`` means), an initialised process group in the test process, and the
environment (``ACCELERATE_*``, ``RANK`` ... as much as ``OMP_NUM_THREADS``): all of it but pytest's own key.
"""

from __future__ import annotations

import os
from typing import Dict

import torch

from ds_muon.engine.memory import budget
from ds_muon.rules import ns_auto, ns_kernels

# pytest's own key; inductor's note of a pointer it reads back in this process (set by torch.compile's
# first compile, not a setting: restoring it would only break inductor's later compiles)
_IGNORED_ENV = {"PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"}


def snapshot(env: bool = True) -> Dict[str, object]:
    """Everything above, as plain comparable values."""
    s: Dict[str, object] = {
        "torch.get_num_threads()": torch.get_num_threads(),
        "torch.get_default_dtype()": torch.get_default_dtype(),
        "torch.get_default_device()": str(torch.get_default_device()),
        "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled(),
        "torch.is_deterministic_algorithms_warn_only_enabled()":
            torch.is_deterministic_algorithms_warn_only_enabled(),
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
        "torch.backends.mkldnn.enabled": torch.backends.mkldnn.enabled,
        "torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "torch.backends.cudnn.deterministic": torch.backends.cudnn.deterministic,
        "torch.is_grad_enabled()": torch.is_grad_enabled(),
        "torch.is_anomaly_enabled()": torch.is_anomaly_enabled(),
        "torch.is_inference_mode_enabled()": torch.is_inference_mode_enabled(),
    }
    # torch 2.9's precision switches (transformers' enable_tf32 sets the first: on CPU, oneDNN matmuls in tf32/bf16)
    for path in ("fp32_precision", "mkldnn.fp32_precision", "mkldnn.matmul.fp32_precision",
                 "mkldnn.conv.fp32_precision", "cuda.matmul.fp32_precision"):
        obj = torch.backends
        for part in path.split("."):
            obj = getattr(obj, part, None)
        s[f"torch.backends.{path}"] = obj
    s["kernel bits (bf16/fp32 products and NS on fixed inputs)"] = kernel_bits()
    # the kernel forms and chunk budget in effect (table, calibration, pins): what the step's agreement compares
    s["ds_muon.rules.ns_kernels.fingerprint()"] = ns_kernels.fingerprint()
    s["ds_muon ns_auto pins"] = dict(ns_auto._pinned)  # (choice() would measure where the table has no entry)
    # the step's memory bound: a smaller one runs NS in smaller chunks, and a chunk of one matrix takes torch's
    # 2-D product path (issue 51: a pooled rank left at tests/test_memory.py's smallest budget changed the bits
    # of the next FSDP2 bf16 test on the AMD EPYC)
    s["ds_muon.engine.memory.budget (FLOOR_BYTES, STATE_FRACTION)"] = (budget.FLOOR_BYTES, budget.STATE_FRACTION)
    if env:
        s.update({f"os.environ[{k!r}]": v for k, v in os.environ.items() if k not in _IGNORED_ENV})
    return s


_PROBE = [torch.randn((3, 24, 40), generator=torch.Generator().manual_seed(k)) for k in range(2)]


def kernel_bits() -> str:
    """A digest of what the matmul kernels compute on fixed inputs (bf16 and fp32 ``bmm``/``baddbmm``, ``mm``
    and one bf16 NS): state no getter shows (a library switching the CPU's denormal mode, oneDNN's ISA or
    primitive choices) still shows here, at this thread count."""
    import zlib

    from ds_muon.rules.newton_schulz import newton_schulz

    a, b = _PROBE
    outs = []
    for dt in (torch.bfloat16, torch.float32):
        x, y = a.to(dt), b.to(dt)
        outs += [torch.bmm(x, y.mT), torch.baddbmm(x, torch.bmm(x, x.mT), y, beta=0.5), torch.mm(x[0], y[1].T),
                 x * 1e-38]  # (the last: where denormals are flushed, it differs)
    outs.append(newton_schulz(a, dtype=torch.bfloat16))
    return "".join(f"{zlib.crc32(o.contiguous().view(torch.uint8).numpy().tobytes()):08x}" for o in outs)


def changes(before: Dict[str, object], after: Dict[str, object]) -> str:
    """What differs, one line each ('' when nothing does)."""
    keys = sorted(set(before) | set(after))
    return "\n".join(f"  {k}: {before.get(k, '<unset>')!r} -> {after.get(k, '<unset>')!r}"
                     for k in keys if before.get(k, "<unset>") != after.get(k, "<unset>"))
