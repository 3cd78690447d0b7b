"""Which kernels Newton–Schulz's three products run as, chosen per machine.

One NS step is three products: ``gram`` (A = X·Xᵀ), ``poly`` (B = bA + cA·A) and
``apply`` (X ← aX + B·X).  Each can run *batched* over a stack (``bmm``/``baddbmm``)
or *per matrix* (``mm``/``addmm`` on each matrix of the stack, into the same
workspace).  Both forms hand the same operands to the same fused GEMM with the same
alpha/beta, so on the CPUs measured they give the same bits (``tests/test_ns_kernels.py``
checks it, and :func:`calibrate` admits a form only where it does); they differ in
speed, and which is faster depends on the machine: on the Intel AMX box the batched
``apply`` of a tall stack's first step (X a transposed view) ran 1.2-1.8× slower than
per-matrix ``addmm``, while on small matrices the per-matrix loop costs 5-10× in
dispatch.  Separate scaled adds (``bmm`` then ``add_``) and folding ``a`` into B round
differently and measured slower or less accurate (``benchmarks/ns_roofline.py``), so
they are not candidates.

Around the products, the iteration may run a stack in *chunks* of whole matrices
(:func:`chunk_matrices`) where the whole stack's workspace outgrows the caches: each matrix
meets the same operations, so the bits stay the same, and on the Intel AMX box (memory
bandwidth shared with other jobs) 6 MiB chunks ran the bank 1.05-1.25× faster.

A choice is made per *class*: (device type, dtype, product, whether the product reads a
transposed view, size bucket).  It comes from, in order: :func:`pin` (a per-process
setting tests and users fix), :func:`calibrate` (a short measurement, cached for the
process, agreed from rank 0 when a process group is up), and the built-in table for the
device family (:func:`family`).  The table in effect (:func:`fingerprint`) joins the
settings the optimizer's step agreement compares, so ranks never run different kernels:
a rank whose choices differ gets the same clear error as every other rank.

A matrix's result never depends on its batch neighbours in either form (the batched
GEMM treats each matrix on its own; per-matrix forms see one matrix), which is what a
sharded step's bitwise equality with one process rests on.  The exceptions measured are half
precision on a CPU: the batched fp16 GEMM rounds a small matrix by its neighbours (Intel AMX, torch
2.13), and a tiny bf16 product (at most :data:`TINY_PRODUCT` multiply-adds) rounds otherwise in a batch
than alone or as a 2-D product (AMD EPYC, torch 2.13; a stack of one takes the 2-D path, so the bits
followed the stack's size).  So fp16, and bf16 products that tiny, run per matrix there whatever the
table says: 2-D products, torch.optim.Muon's own.

(Over 400 lines, as one table: the classes, the built-in choices, :func:`pin`, :func:`calibrate` (with
the measurements it runs) and :func:`fingerprint` all read and write this module's per-process choices
(``_pinned``, ``_calibrated``, the chunk budget, their version), which a split would only hand back and forth.)
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Dict, Iterable, Optional, Tuple

import torch

from .ns_auto import proc_cpuinfo

PRODUCTS = ("gram", "poly", "apply")
FORMS = ("batched", "per_matrix")

# (device type, dtype name, product, transposed input, size bucket)
Class = Tuple[str, str, str, bool, str]

SMALL = 128 * 128 * 128  # m·m·n below this: dispatch dominates, per-matrix loops lose
TINY_PRODUCT = 16 * 16 * 16  # m·m·n at most this: a bf16 CPU product runs per matrix, for its bits (choice())


def size_bucket(m: int, n: int) -> str:
    """``"small"`` where one matrix's product is too small to amortise a call per matrix."""
    return "small" if m * m * n < SMALL else "large"


def kernel_class(device_type: str, dtype: torch.dtype, product: str, transposed: bool, m: int, n: int) -> Class:
    return (device_type, str(dtype).replace("torch.", ""), product, bool(transposed), size_bucket(m, n))


# Measured tables per device family (``python benchmarks/ns_roofline.py --calibrate`` prints one).
# Classes absent here run batched.
TABLES: Dict[str, Dict[Tuple[str, str, bool, str], str]] = {
    # Intel Xeon with AMX (bf16 tiles), torch 2.13 CPU: the first step of a tall stack reads X as a
    # transposed view; batched ``baddbmm`` on it took 1.2-1.4× (bf16) and 1.2-1.8× (fp32) per-matrix
    # ``addmm``'s time; every other class ran batched as fast or faster (docs/PERFORMANCE.md)
    "cpu:GenuineIntel:amx": {
        ("bfloat16", "apply", True, "large"): "per_matrix",
        ("float32", "apply", True, "large"): "per_matrix",
        ("float16", "apply", True, "large"): "per_matrix",
    },
    # AMD EPYC (avx512, avx512_bf16; no AMX), torch 2.13 CPU: the same class, batched ``baddbmm`` on a
    # transposed X took 1.18-1.22x (bf16) and 1.11x (fp32) per-matrix ``addmm``'s time (ns_kernels.measure,
    # 15 interleaved repeats, the box shared); every other class within 5 % of batched (docs/PERFORMANCE.md)
    "cpu:AuthenticAMD:avx512": {
        ("bfloat16", "apply", True, "large"): "per_matrix",
        ("float32", "apply", True, "large"): "per_matrix",
        ("float16", "apply", True, "large"): "per_matrix",
    },
}

# Per device family: bytes of NS workspace one chunk of a stack may use before the iteration runs
# chunk by chunk (ns_kernels.chunk_matrices); absent: whole stacks.
CHUNK_BYTES: Dict[str, int] = {
    # the Intel AMX box (2 MiB L2 per core, memory bandwidth shared with other jobs): 6 MiB chunks ran the bank
    # (8x512², 4x1536x512, 4x512x1536, 4x384x1024) 1.09-1.25x faster than whole stacks in bf16, 1.05x in fp32
    # (3 and 12 MiB: less); one 512² bf16 matrix's workspace is 2.5 MiB (docs/PERFORMANCE.md)
    "cpu:GenuineIntel:amx": 6 * 2**20,
}
CHUNK_CANDIDATES = (0, 3 * 2**20, 6 * 2**20, 12 * 2**20)  # what calibrate() tries (0: whole stacks)
CHUNK_STACK = (8, 512, 512)  # ... on this stack

_pinned: Dict[Class, str] = {}  # pin(): per-process choices, first
_calibrated: Dict[Class, str] = {}  # calibrate(): measured choices, next


@functools.lru_cache(maxsize=None)
def family(device_type: str = "cpu") -> str:
    """The device family the built-in table is keyed by: ``cpu:<vendor>:<amx|ISA>``, ``cuda:sm<major><minor>``."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return "cuda:none"
        major, minor = torch.cuda.get_device_capability()
        return f"cuda:sm{major}{minor}"
    if device_type != "cpu":
        return device_type
    vendor, flags = proc_cpuinfo()
    isa = "amx" if "amx_bf16" in flags else torch.backends.cpu.get_cpu_capability().lower()
    return f"cpu:{vendor}:{isa}"


def choice(device_type: str, dtype: torch.dtype, product: str, transposed: bool, m: int, n: int) -> str:
    """The form ``product`` runs as for this class (see the module docstring for the order)."""
    key = kernel_class(device_type, dtype, product, transposed, m, n)
    got = _pinned.get(key)
    if got is None and device_type == "cpu" and (dtype == torch.float16 or
                                                 (dtype == torch.bfloat16 and m * m * n <= TINY_PRODUCT)):
        # for the bits, not the speed: CPU fp16 batched products round a matrix by its batch neighbours
        # (Intel AMX, torch 2.13), and a tiny bf16 product (at most 16³ multiply-adds) rounds otherwise
        # batched than alone or 2-D (AMD EPYC, torch 2.13: 16 of 12000 drawn 16x16 ``poly`` products; a
        # batch of one took the 2-D path, so a matrix's bits followed its stack's size).  One 2-D product
        # per matrix has no neighbours and is torch.optim.Muon's product; fp32 keeps its bits batched
        return "per_matrix"
    got = got or _calibrated.get(key)
    if got is not None:
        return got
    return TABLES.get(family(device_type), {}).get(key[1:], "batched")


_chunk_pin: list = [None]  # pin_chunk_bytes(): this process's budget, over CHUNK_BYTES


def chunk_bytes(device_type: str) -> Optional[int]:
    """The workspace budget of one chunk on ``device_type`` (None: whole stacks)."""
    if _chunk_pin[0] is not None:
        return _chunk_pin[0] or None
    return CHUNK_BYTES.get(family(device_type))


def pin_chunk_bytes(budget: Optional[int]) -> None:
    """Fix the chunk budget for this process: bytes, 0 for whole stacks, None to follow the table."""
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        raise ValueError(f"ds_muon.rules.ns_kernels.pin_chunk_bytes: budget={budget!r} must be an int >= 0 or None")
    _version[0] += 1
    _chunk_pin[0] = budget


def chunk_matrices(device_type: str, dtype: torch.dtype, batch: int, m: int, n: int, steps: int) -> int:
    """How many matrices of a [batch, m, n] stack one pass of the iteration takes: all of them,
    unless the stack's workspace (X, A, B and two X buffers per matrix) exceeds :func:`chunk_bytes`.
    Any chunking gives the same bits (each matrix meets the same products), so this is speed only."""
    budget = chunk_bytes(device_type)
    if budget is None or batch <= 1 or steps < 1:
        return batch
    per = (3 * m * n + 2 * m * m) * dtype.itemsize
    return max(1, min(batch, budget // max(per, 1)))


def pin(choices: Optional[Dict[Class, str]] = None, *, form: Optional[str] = None) -> None:
    """Fix choices for this process: ``choices`` per class, or ``form`` for every class; with neither,
    forget all pins.  Pins win over calibration and the built-in table."""
    _version[0] += 1
    if choices is None and form is None:
        _pinned.clear()
        return
    if form is not None:
        _check_form(form, "form")
        for dev in ("cpu", "cuda"):
            for dt in ("bfloat16", "float16", "float32"):
                for product in PRODUCTS:
                    for transposed in (False, True):
                        for bucket in ("small", "large"):
                            _pinned[(dev, dt, product, transposed, bucket)] = form
    for key, f in (choices or {}).items():
        _check_form(f, f"choices[{key!r}]")
        if not (isinstance(key, tuple) and len(key) == 5 and key[2] in PRODUCTS):
            raise ValueError(f"ds_muon.rules.ns_kernels.pin: {key!r} is not a class "
                             "(device type, dtype name, product, transposed, 'small'|'large')")
        _pinned[key] = f


def _check_form(f, what: str) -> None:
    if f not in FORMS:
        raise ValueError(f"ds_muon.rules.ns_kernels: {what}={f!r} is not a form; use one of {list(FORMS)}")


def reset() -> None:
    """Forget pins and calibration: back to the built-in table."""
    _version[0] += 1
    _pinned.clear()
    _calibrated.clear()
    _chunk_pin[0] = None


def fingerprint() -> str:
    """The choices in effect, as text every rank can compare: the non-batched classes of the
    built-in table for this process's device families, overridden by calibration and pins.
    (Cached until the next pin, calibration or reset: the step reads it every time.)"""
    key = (_version[0], repr(TABLES))
    if _fingerprint[0] != key:
        _fingerprint[:] = [key, _effective_text()]
    return _fingerprint[1]


_fingerprint: list = [None, ""]
_version = [0]  # bumped by every pin, calibration and reset


def _effective_text() -> str:
    effective: Dict[Class, str] = {}
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        for k, f in TABLES.get(family(dev), {}).items():
            effective[(dev,) + k] = f
    effective.update(_calibrated)
    effective.update(_pinned)
    chunks = [(dev, chunk_bytes(dev)) for dev in devices if chunk_bytes(dev) is not None]
    return repr(sorted((k, f) for k, f in effective.items() if f != "batched")) + (f" chunks {chunks}" if chunks else "")


# -- the products -------------------------------------------------------------------------------

def gram(X: torch.Tensor, out: torch.Tensor, form: str) -> torch.Tensor:
    """out ← X·Xᵀ, per matrix of the stack."""
    if form == "per_matrix":  # (unbind: one call for every matrix's view, not one index per operand)
        for x, o in zip(X.unbind(0), out.unbind(0)):
            torch.mm(x, x.T, out=o)
        return out
    return torch.bmm(X, X.mT, out=out)


def poly(A: torch.Tensor, b: float, c: float, out: torch.Tensor, form: str) -> torch.Tensor:
    """out ← bA + cA·A.  ``c = 0`` is a scaled copy: torch 2.13's CPU ``baddbmm(alpha=0)`` in bf16 and
    fp16 ignores ``beta`` (returns A unscaled; measured from 16×16 up, fp32 and 2-D ``addmm`` right),
    and ``alpha=0`` never needs a product anyway."""
    if c == 0:
        return torch.mul(A, b, out=out)
    if form == "per_matrix":
        for a, o in zip(A.unbind(0), out.unbind(0)):
            torch.addmm(a, a, a, beta=b, alpha=c, out=o)
        return out
    return torch.baddbmm(A, A, A, beta=b, alpha=c, out=out)


def apply(X: torch.Tensor, B: torch.Tensor, a: float, out: torch.Tensor, form: str) -> torch.Tensor:
    """out ← aX + B·X.  ``out`` may be a transposed view (:func:`writes_tall`: a tall stack's last step
    written in its own layout, no transposing copy after): then always per matrix, ``addmm`` into
    each matrix's transposed view (the batched form into such a view rounded differently)."""
    if form == "per_matrix" or out.stride(-1) != 1:
        for x, b, o in zip(X.unbind(0), B.unbind(0), out.unbind(0)):
            torch.addmm(x, b, x, beta=a, out=o)
        return out
    return torch.baddbmm(X, B, X, beta=a, out=out)


def batch_sensitive(X: torch.Tensor) -> bool:
    """CPU fp16 batched products round a matrix by its batch neighbours (Intel AMX, torch 2.13: 3 of 209
    drawn matrices of Gram stacks differed from the same matrix alone; per matrix 0 of 209), so a sharded
    fp16 Gram step would not be the one-process step there; one product per matrix has no neighbours (the
    standard iteration's fp16 forms: :func:`choice`; the Gram iteration's products: the two below).  bf16
    and fp32 stacks keep their bits; fp16 Gram on a CPU is opt-in (``ns_method="gram"`` with bf16) and runs
    at fp32's time anyway."""
    return X.dtype == torch.float16 and X.device.type == "cpu"


def per_matrix_bmm(A: torch.Tensor, B: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    if out is None:
        out = torch.empty(A.size(0), A.size(1), B.size(2), dtype=A.dtype, device=A.device)
    for a, b, o in zip(A, B, out):
        torch.mm(a, b, out=o)
    return out


def per_matrix_baddbmm(C: torch.Tensor, A: torch.Tensor, B: torch.Tensor, *, alpha: float,
                        out: torch.Tensor) -> torch.Tensor:
    for c, a, b, o in zip(C, A, B, out):
        torch.addmm(c, a, b, alpha=alpha, out=o)
    return out


# Device families where ``addmm`` into a transposed ``out`` was seen to keep the bits of the contiguous
# product transposed (see :func:`writes_tall`).  Not on the Intel AMX box: there results differed in the
# last bits on fp32 8 of 119 and bf16 4 of 120 drawn large tall shapes (torch 2.13), so it copies.
WRITES_TALL_FAMILIES = ("cpu:AuthenticAMD:avx512",)


def writes_tall(m: int, n: int, device_type: str = "cpu") -> bool:
    """Does a tall stack's last step write its result in the tall layout itself (``addmm`` per matrix
    into the transposed view of the destination) rather than wide and then copied transposed?

    The transposing copy is strided on one side: on the AMD EPYC it cost ~10 % of a 4×1536×512 bf16
    NS (benchmarks/ns_roofline.py), the products themselves no more than the copy they replace.
    Bits: on that EPYC, ``addmm`` into a transposed ``out`` computed the transposed product, the same
    products summed in the same order on every large shape measured (bf16 and fp32, 175 shapes; small
    fp32 ones differed: 3 of 29), so only the large bucket does it, and only on the families listed in
    :data:`WRITES_TALL_FAMILIES` (elsewhere the copy is the price of the bits; ``tests/test_ns_kernels.py``
    checks whichever the machine it runs on does)."""
    return size_bucket(m, n) == "large" and family(device_type) in WRITES_TALL_FAMILIES


def forms_for(X: torch.Tensor, compiling: bool = False) -> Tuple[str, str, str]:
    """The (gram, poly, apply) forms for one step on the stack ``X`` ([batch, m, n], m <= n).
    Under torch.compile the batch dimension is symbolic: batched forms only."""
    if compiling:
        return ("batched",) * 3
    transposed = X.stride(-1) != 1  # (rows contiguous: a stack laid out aligned, newton_schulz.aligned_stack)
    m, n = X.size(-2), X.size(-1)
    dev, dt = X.device.type, X.dtype
    return (choice(dev, dt, "gram", transposed, m, n), choice(dev, dt, "poly", False, m, m),
            choice(dev, dt, "apply", transposed, m, n))


# -- calibration --------------------------------------------------------------------------------

# one representative stack per size bucket (batch, m, n): timed per product, both layouts
CALIBRATION_STACKS = {"large": (4, 512, 1024), "small": (16, 48, 96)}


def _operands(batch: int, m: int, n: int, dtype, device, transposed: bool):
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (batch, n, m) if transposed else (batch, m, n)
    X = (torch.randn(shape, generator=g) / (m * n) ** 0.5).to(device=device, dtype=dtype)
    X = X.mT if transposed else X
    A = torch.bmm(X, X.mT)
    return X, A, torch.bmm(A, A) * 0.5 - A


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure(product: str, dtype, device, transposed: bool, bucket: str, repeats: int = 5):
    """{form: (median seconds, bitwise equal to batched)} for one class, the forms interleaved."""
    batch, m, n = CALIBRATION_STACKS[bucket]
    X, A, B = _operands(batch, m, n, dtype, device, transposed)
    if product == "poly":
        run = lambda f, out: poly(A, -4.775, 2.0315, out, f)  # noqa: E731
        out_shape = A.shape
    elif product == "gram":
        run = lambda f, out: gram(X, out, f)  # noqa: E731
        out_shape = A.shape
    else:
        run = lambda f, out: apply(X, B, 3.4445, out, f)  # noqa: E731
        out_shape = X.shape
    outs = {f: X.new_empty(out_shape) for f in FORMS}
    for f in FORMS:
        run(f, outs[f])  # warm-up, and the bits
    _sync(device)
    same = {f: torch.equal(outs[f], outs["batched"]) for f in FORMS}
    times = {f: [] for f in FORMS}
    for _ in range(repeats):
        for f in FORMS:
            _sync(device)
            t0 = time.perf_counter() if torch.device(device).type == "cuda" else time.process_time()
            run(f, outs[f])
            _sync(device)
            t1 = time.perf_counter() if torch.device(device).type == "cuda" else time.process_time()
            times[f].append(t1 - t0)
    return {f: (statistics.median(times[f]), same[f]) for f in FORMS}


def _iterate_in_chunks(X: torch.Tensor, chunk: int, out: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller steps on a wide stack, ``chunk`` matrices at a time in one reused workspace (what
    newton_schulz does after normalising; timed by :func:`measure_chunks`)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    m, n = X.shape[-2:]
    chunk = max(1, min(chunk, len(X)))
    A, B = X.new_empty((chunk, m, m)), X.new_empty((chunk, m, m))
    bufs = [X.new_empty((chunk, m, n)), X.new_empty((chunk, m, n))]
    for k0 in range(0, len(X), chunk):
        k1 = min(len(X), k0 + chunk)
        Y = X[k0:k1]
        for k in range(steps):
            gram(Y, A[:k1 - k0], "batched")
            poly(A[:k1 - k0], b, c, B[:k1 - k0], "batched")
            Y = apply(Y, B[:k1 - k0], a, bufs[k % 2][:k1 - k0], "batched")
        out[k0:k1].copy_(Y)
    return out


def measure_chunks(dtype, device, repeats: int = 3):
    """{chunk budget: (median seconds, same bits as whole stacks)} of 5 NS steps on :data:`CHUNK_STACK`,
    the budgets interleaved (a budget gives :func:`chunk_matrices` matrices per chunk)."""
    batch, m, n = CHUNK_STACK
    X, _, _ = _operands(batch, m, n, dtype, device, False)
    per = (3 * m * n + 2 * m * m) * X.element_size()
    counts = {b: (batch if b == 0 else max(1, b // per)) for b in CHUNK_CANDIDATES}
    outs = {b: torch.empty_like(X) for b in CHUNK_CANDIDATES}
    for b in CHUNK_CANDIDATES:
        _iterate_in_chunks(X, counts[b], outs[b])
    times = {b: [] for b in CHUNK_CANDIDATES}
    for _ in range(repeats):
        for b in CHUNK_CANDIDATES:
            _sync(device)
            t0 = time.perf_counter() if torch.device(device).type == "cuda" else time.process_time()
            _iterate_in_chunks(X, counts[b], outs[b])
            _sync(device)
            t1 = time.perf_counter() if torch.device(device).type == "cuda" else time.process_time()
            times[b].append(t1 - t0)
    return {b: (statistics.median(times[b]), torch.equal(outs[b], outs[0])) for b in CHUNK_CANDIDATES}


def calibrate(device="cpu", dtypes: Iterable[torch.dtype] = (torch.bfloat16, torch.float32),
              group=None, repeats: int = 5, margin: float = 0.95) -> Dict[Class, str]:
    """Measure every class on ``device`` for ``dtypes`` (about a second on a CPU) and use the
    fastest form that gives the batched form's bits (a form must beat batched by ``margin`` to
    be chosen).  With a process group initialised this is collective over ``group``: every rank
    measures, rank 0's choices are broadcast and used everywhere (so timing noise cannot make
    ranks disagree).  The chunk budget (:func:`chunk_matrices`) is measured too, on
    :data:`CHUNK_STACK` in the first dtype, and set for the process like :func:`pin_chunk_bytes`.
    Returns the product choices now in effect from calibration."""
    import torch.distributed as dist

    dev_type = torch.device(device).type
    found: Dict[Class, str] = {}
    for dtype in dtypes:
        for product in PRODUCTS:
            for transposed in ((False,) if product == "poly" else (False, True)):
                for bucket in CALIBRATION_STACKS:
                    res = measure(product, dtype, device, transposed, bucket, repeats)
                    base = res["batched"][0]
                    best = "batched"
                    for f, (t, same) in res.items():
                        if same and t < margin * base and t < res[best][0]:
                            best = f
                    found[(dev_type, str(dtype).replace("torch.", ""), product, transposed, bucket)] = best
    dtypes = list(dtypes)
    chunks = measure_chunks(dtypes[0], device, max(1, repeats // 2)) if dtypes else {0: (1.0, True)}
    budget = min((b for b, (t, same) in chunks.items() if same and (b == 0 or t < margin * chunks[0][0])),
                 key=lambda b: chunks[b][0])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        box = [(found, budget)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        found, budget = box[0]
    _version[0] += 1
    _calibrated.update(found)
    _chunk_pin[0] = budget
    return dict(found)
