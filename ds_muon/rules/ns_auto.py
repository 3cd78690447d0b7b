"""What ``ns_dtype="auto"`` and ``ns_method="auto"`` become on this machine, chosen per device.

The NS dtype matters far more than the kernel forms (:mod:`.ns_kernels`): on an AMD EPYC with AVX2
only, a bf16 ``baddbmm`` of 16×128×128 ran at 1.5-1.7 GFLOP/s against 55 GFLOP/s in fp32, and one
Muon step took 870 ms in bf16 against 34 ms in fp32 (issue 41); on the Intel AMX box here bf16 runs
5-7× fp32's rate.  So "auto" takes a half-precision NS only where the device multiplies it natively,
fp32 elsewhere.  The decision comes, in order, from :func:`pin` (a per-process setting tests and
users fix), the built-in table keyed by what the device *is* (CPU flags from ``/proc/cpuinfo``, the
CUDA compute capability), and, where the table has no entry, a short measurement (bf16 against fp32
``baddbmm``, about 50 ms).  It is made once per process and cached.

``ns_method="auto"`` takes the Gram iteration per matrix where it does fewer FLOPs
(:func:`~ds_muon.rules.newton_schulz.use_gram`) *and* the device's entry lists the dtype: against
a float64 polar factor its error equals the standard iteration's to 4 digits in fp32, fp16 and
bf16-asked (which iterates in fp16) on every shape measured (``benchmarks/ns_auto_bench.py``,
docs/PERFORMANCE.md), so speed and bits decide.  fp32: everywhere (the same GEMMs, fewer).  Asked in
bf16 Gram runs in fp16, which CPUs without fp16 matrix units multiply 5× slower than bf16, and whose
small CPU stacks round a matrix differently with its batch neighbours (sharded parity would break):
bf16 Gram on sm80+ GPUs only, fp16 Gram nowhere.

Every rank must decide alike (a different dtype changes the bits, and so bitwise parity and the
duplicated homes): the step's agreement compares the resolved values
(:func:`~ds_muon.engine.agreement.fingerprints.settings_of`), so a cluster whose machines decide
differently raises on every rank, naming the setting and saying to pass an explicit ``ns_dtype``.
An explicit setting always wins and is never looked up here.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from typing import Dict, FrozenSet, NamedTuple, Optional, Tuple

import torch

AUTO = "auto"


class Choice(NamedTuple):
    """What "auto" means on one device type of this process."""

    dtype: str  # ns_dtype="auto" -> this dtype name
    gram: FrozenSet[str]  # ns dtypes (as asked) in which ns_method="auto" may take the Gram iteration
    device: str  # what the device is: "cpu:<vendor>:<flags that decided>" or "cuda:sm<major><minor>"
    why: str  # the table entry, or "measured ..."

    def describe(self) -> str:
        gram = ", ".join(sorted(self.gram)) or "none"
        return f"ns_dtype auto -> {self.dtype}, ns_method auto -> gram where fewer FLOPs in [{gram}] ({self.device}: {self.why})"


# -- the table ------------------------------------------------------------------------------------
# CPUs, first match wins: (flags the CPU must have, flags it must lack, dtype, dtypes Gram may run in, why).
# Gram in fp32 runs fp32's GEMMs, fewer of them: it pays wherever it saves FLOPs, and a matrix's bits do
# not depend on its batch (80 shapes, tests/test_ns_auto.py), which sharded parity rests on.  In fp16 (and
# asked in bf16, which iterates in fp16) small CPU stacks round a matrix differently with its batch
# neighbours (3 of 10 shapes): never on a CPU.
_GRAM_FP32 = frozenset({"float32"})
CPU_TABLE: Tuple[Tuple[FrozenSet[str], FrozenSet[str], str, FrozenSet[str], str], ...] = (
    (frozenset({"amx_bf16"}), frozenset(), "bfloat16", _GRAM_FP32,
     "AMX bf16 tiles: bf16 baddbmm 5-7x fp32's rate, the bf16 NS 2-5x faster than fp32 (Intel Xeon Sapphire "
     "Rapids, measured); fp16 runs at fp32's rate, so no bf16 Gram (it would iterate in fp16)"),
    (frozenset({"avx512_bf16"}), frozenset(), "bfloat16", _GRAM_FP32,
     "avx512_bf16 dot products (AMD EPYC Zen 4, Intel Cooper Lake): the bf16 demo ran 1.09x AdamW on such an "
     "EPYC (issue 41); no fp16 matrix unit, so no bf16 Gram"),
    (frozenset({"avx512f"}), frozenset({"avx512_bf16", "amx_bf16"}), "float32", _GRAM_FP32,
     "AVX-512 without bf16 units (Intel Skylake/Cascade Lake/Ice Lake Xeons): bf16 products are converted to "
     "fp32 and back, never faster than fp32; in the table rather than measured, so a cluster of such machines "
     "cannot decide differently by timing noise"),
    (frozenset({"avx2"}), frozenset({"avx512f", "avx512_bf16", "amx_bf16"}), "float32", _GRAM_FP32,
     "AVX2 without AVX-512 or bf16 units (AMD EPYC Zen 2/3): bf16 baddbmm 1.5-1.7 GFLOP/s against fp32's 55, "
     "a Muon step 870 ms in bf16 against 34 ms in fp32 (issue 41)"),
)
# CUDA, by compute capability (major, minor), first match at or above it.
CUDA_TABLE: Tuple[Tuple[Tuple[int, int], str, FrozenSet[str], str], ...] = (
    ((8, 0), "bfloat16", frozenset({"bfloat16", "float32"}),
     "sm80+: bf16 and fp16 tensor cores at the same rate (Gram asked in bf16 iterates in fp16, as DeepSpeed's Muon)"),
    ((7, 0), "float16", _GRAM_FP32, "sm70/sm75: fp16 tensor cores, no bf16 units"),
    ((0, 0), "float32", _GRAM_FP32, "below sm70: no half-precision matrix units"),
)
HALF_WINS = 0.8  # measured: a half dtype only where its NS product takes at most this share of fp32's time


# -- what the device is (mocked by tests) --------------------------------------------------------------
FLAGS_ENV = "DS_MUON_CPU_FLAGS"  # "vendor:flag flag ..." read instead of /proc/cpuinfo: another CPU, simulated


def read_cpuinfo() -> Tuple[str, FrozenSet[str]]:
    """(vendor, flags) of this CPU from ``/proc/cpuinfo``; ("unknown", {}) where there is none.
    ``DS_MUON_CPU_FLAGS="AuthenticAMD:avx2 fma"`` stands in for it (what "auto" would pick on such a
    CPU, e.g. to run the tests as an AVX2-only CI machine would; the speed stays this machine's)."""
    simulated = os.environ.get(FLAGS_ENV)
    if simulated:
        vendor, _, flags = simulated.rpartition(":")
        return vendor or "unknown", frozenset(flags.split())
    return proc_cpuinfo()


def proc_cpuinfo() -> Tuple[str, FrozenSet[str]]:
    """(vendor, flags) of the CPU this process runs on (never simulated: the kernel forms and the bits
    they keep are this machine's, :func:`ds_muon.rules.ns_kernels.family`)."""
    vendor, flags = "unknown", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id":
                    vendor = value.strip()
                elif key in ("flags", "Features"):  # x86, aarch64
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return vendor, flags


def cuda_capability() -> Optional[Tuple[int, int]]:
    """The current CUDA device's compute capability, or None without one."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


def table_entry(device_type: str) -> Optional[Choice]:
    """The built-in table's choice for ``device_type`` on this machine, or None where it has no entry."""
    if device_type == "cuda":
        cap = cuda_capability()
        if cap is None:
            return None
        for at_least, dtype, gram, why in CUDA_TABLE:
            if tuple(cap) >= at_least:
                return Choice(dtype, gram, f"cuda:sm{cap[0]}{cap[1]}", why)
        return None
    if device_type != "cpu":
        return None
    vendor, flags = read_cpuinfo()
    for need, lack, dtype, gram, why in CPU_TABLE:
        if need <= flags and not (lack & flags):
            return Choice(dtype, gram, f"cpu:{vendor}:{'+'.join(sorted(need))}", why)
    return None


def measure(device_type: str, repeats: int = 5) -> Choice:
    """For a device the table does not know: bf16 against fp32 ``baddbmm`` on a 16×128×128 stack (the
    issue's probe), interleaved, median.  bf16 only where it takes at most :data:`HALF_WINS` of fp32's
    time (a half dtype rounds worse, so it must buy speed); Gram only in the asked dtype."""
    device = torch.device(device_type)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    g = torch.Generator().manual_seed(0)
    X = torch.randn(16, 128, 128, generator=g).to(device) / 128
    ops = {dt: (X.to(dt), X.to(dt).mT.contiguous()) for dt in (torch.bfloat16, torch.float32)}
    times: Dict[torch.dtype, list] = {dt: [] for dt in ops}
    for k in range(repeats + 1):
        for dt, (A, B) in ops.items():
            sync()
            t0 = clock()
            torch.baddbmm(A, B, A, beta=0.5)
            sync()
            t1 = clock()
            if k:  # the first round warms up
                times[dt].append(t1 - t0)
    bf16, fp32 = (statistics.median(times[dt]) for dt in (torch.bfloat16, torch.float32))
    dtype = "bfloat16" if bf16 <= HALF_WINS * fp32 else "float32"
    return Choice(dtype, _GRAM_FP32, f"{device_type}:measured",
                  f"measured: bf16 baddbmm took {bf16 / max(fp32, 1e-12):.2f}x fp32's time")


# -- the decision, once per process ----------------------------------------------------------------
_pinned: Dict[str, Choice] = {}


@functools.lru_cache(maxsize=None)
def _decided(device_type: str) -> Choice:
    entry = table_entry(device_type)
    if entry is not None:
        return entry
    if device_type == "cuda" and cuda_capability() is None:  # asked about a device this process lacks
        return Choice("float32", _GRAM_FP32, "cuda:none", "no CUDA device in this process")
    return measure(device_type)


def choice(device_type: str = "cpu") -> Choice:
    """What "auto" means for NS on ``device_type`` in this process (pinned, the table, or measured once)."""
    pinned = _pinned.get(device_type)
    return pinned if pinned is not None else _decided(device_type)


def pin(device_type: str, dtype: Optional[str] = None, gram=None, why: str = "pinned") -> None:
    """Fix what "auto" means on ``device_type`` for this process (``dtype``: a dtype name; ``gram``:
    the dtypes Gram may run in); with neither, forget the pin."""
    if dtype is None and gram is None:
        _pinned.pop(device_type, None)
        return
    base = choice(device_type)
    if dtype is not None and dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"ds_muon.rules.ns_auto.pin: dtype={dtype!r}; use 'bfloat16', 'float16' or 'float32'")
    _pinned[device_type] = Choice(dtype or base.dtype, frozenset(base.gram if gram is None else gram),
                                  base.device, why)


def reset() -> None:
    """Forget pins and the cached decisions (tests that mock the device readers)."""
    _pinned.clear()
    _decided.cache_clear()


def resolve_dtype(value, device_type: str = "cpu") -> torch.dtype:
    """The torch dtype NS runs in for a group's ``ns_dtype`` (a name, or ``"auto"``)."""
    name = choice(device_type).dtype if value == AUTO else str(value).replace("torch.", "")
    return getattr(torch, name)


def gram_pays(device_type: str, dtype: torch.dtype) -> bool:
    """May ``ns_method="auto"`` take the Gram iteration (where it saves FLOPs) for NS asked in ``dtype``?"""
    return str(dtype).replace("torch.", "") in choice(device_type).gram


def ns_device_type() -> str:
    """Where this process runs NS when its tensors do not say: the accelerator if there is one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def group_device_type(group: dict) -> str:
    """Where a param group's NS runs: its first tensor's device type (this process's accelerator, or
    the CPU, for an empty group).  (Host-offloaded state runs NS on the accelerator: the exchange
    resolves "auto" for that device itself.)"""
    params = group.get("params") or []
    return params[0].device.type if params else ns_device_type()


def resolved(group: dict) -> Dict[str, str]:
    """What a Muon group's ``"auto"`` settings became here (empty where it has none): every rank
    must agree on these (:func:`~ds_muon.engine.agreement.fingerprints.settings_of`)."""
    out: Dict[str, str] = {}
    dev = group_device_type(group)
    asked = resolve_dtype(group.get("ns_dtype"), dev) if group.get("ns_dtype") == AUTO else None
    if asked is not None:
        out["ns_dtype"] = str(asked).replace("torch.", "")
    if group.get("ns_method") == AUTO:
        dtype = asked if asked is not None else resolve_dtype(group.get("ns_dtype"), dev)
        out["ns_method"] = "gram where it saves FLOPs" if gram_pays(dev, dtype) else "standard"
    return out


def fast_dtype(device_type: str = "cpu") -> torch.dtype:
    """The dtype "auto" picks here: what tests that check no dtype behaviour run at."""
    return getattr(torch, choice(device_type).dtype)

