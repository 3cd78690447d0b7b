"""Newton–Schulz orthogonalization: the maths every rank and every stack shares.

One function, batched over leading dimensions, so that a home rank can run all
matrices of one shape as a single stack.  Per matrix the arithmetic is the same
as ``torch.optim._muon._zeropower_via_newtonschulz`` (cast first, then Frobenius
normalisation, then the quintic iteration on the wide orientation); on one CPU
thread the result of a matrix does not depend on which others share its batch,
which is what makes a sharded step bitwise equal to the single-process one.
The coefficient schedules (``"keller"``, ``"quintic"``, ``"polar_express"``, a user's own) are
:mod:`.ns_coefficients`' (served here too).
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from . import ns_auto, ns_kernels
from .ns_coefficients import (KELLER, POLAR_EXPRESS, QUINTIC, SCHEDULES, Coefficients, Triple,  # noqa: F401
                              resolve_coefficients)  # (the schedules, served here too: their old home)

NS_METHODS = ("standard", "gram", "auto")


def ns_flops(rows: int, cols: int, steps: int, method: str = "standard",
             dtype: torch.dtype = torch.float32, device_type: str = "cpu") -> float:
    """Multiply-add FLOPs of ``steps`` iterations on one (rows, cols) matrix.

    With m = min(rows, cols), n = max.  Standard: X·Xᵀ (2m²n), A·A (2m³) and
    B·X (2m²n) per step.  Gram (where it is cheaper, see :func:`use_gram`): X·Xᵀ
    and Q·X once (4m²n), then 8m³ per step on m×m matrices (4m³ on the last).
    ``"auto"`` counts the method :func:`resolve_method` picks for ``dtype`` and
    ``device_type``.  The planner uses this as the cost of a matrix.
    """
    m, n = min(rows, cols), max(rows, cols)
    standard = float(steps) * (4.0 * m * m * n + 2.0 * m * m * m)
    method = resolve_method(method, rows, cols, steps, dtype, device_type)
    if method == "gram" and use_gram(rows, cols, steps):
        return 4.0 * m * m * n + float(steps) * 8.0 * m**3 - 4.0 * m**3
    return standard


def use_gram(rows: int, cols: int, steps: int) -> bool:
    """Whether the Gram iteration does fewer FLOPs than the standard one for this shape."""
    m, n = min(rows, cols), max(rows, cols)
    return 4.0 * m * m * n + steps * 8.0 * m**3 - 4.0 * m**3 < steps * (4.0 * m * m * n + 2.0 * m**3)


def resolve_method(method: str, rows: int, cols: int, steps: int, dtype: torch.dtype,
                   device_type: str) -> str:
    """The iteration ``method`` runs on one (rows, cols) matrix: ``"auto"`` becomes ``"gram"``
    where that does fewer FLOPs (:func:`use_gram`) and the device runs Gram's dtype at full rate
    (:func:`~ds_muon.rules.ns_auto.gram_pays`: the device's table entry), else ``"standard"``.
    A pure function of shape, settings and the device's (agreed) choice, so every rank picks the same.

    Accuracy does not decide it: against a float64 polar factor Gram's error equals the standard
    iteration's to 4 digits in fp32, fp16 and bf16-asked (6 shapes × 3 inputs; its rounding alone,
    against the same iteration in float64, is 1-2× the standard's in fp32 (~2e-6) and 3-7× *smaller*
    asked in bf16, where it iterates in fp16).  Speed and bits do: fp16 GEMMs run at bf16's rate only
    on GPUs (on CPUs without fp16 matrix units: fp32's time, 5× bf16's), and small fp16 stacks on a
    CPU round a matrix differently with its batch neighbours; fp32 Gram kept its bits on 80 shapes.
    """
    if method != "auto":
        return method
    if use_gram(rows, cols, steps) and ns_auto.gram_pays(device_type, dtype):
        return "gram"
    return "standard"


def compute_dtype(method: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype NS returns: ``dtype``, except that the Gram iteration asked for in
    bf16 runs in (and returns) fp16.  Measured (``benchmarks/ns_accuracy.py``): Gram in bf16 rounds
    about 5× worse than DeepSpeed's fp16 Gram, in fp16 1.2–1.7× better than it; both are 16-bit
    matmuls, so the cost is the same on tensor cores.  ``"auto"`` returns ``dtype`` whatever
    it picks per matrix (a Gram result computed in fp16 is cast back), so that one group's
    stacks share one dtype on the wire."""
    return torch.float16 if method == "gram" and dtype == torch.bfloat16 else dtype


def input_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype NS reads its input in before normalising: fp16 stops at 65504, so an fp16
    iteration normalises in fp32 first and casts after (any other dtype casts first, as
    torch.optim.Muon does)."""
    return torch.float32 if dtype == torch.float16 else dtype


def newton_schulz(
    G: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = "keller",
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
    method: str = "standard",
    *,
    out: Optional[torch.Tensor] = None,
    max_chunk: Optional[int] = None,
) -> torch.Tensor:
    """Approximately orthogonalize each matrix in the last two dims of ``G``.

    Returns a tensor of G's shape in ``compute_dtype(method, dtype)``.  Runs on the wide orientation
    (transposes when rows > cols), normalises by each matrix's Frobenius norm
    (clamped below by ``eps``) after casting to ``dtype``.  ``method="gram"``
    iterates on the small Gram matrix where that is cheaper (opt-in: it is the
    same polynomial, but rounds differently); ``"auto"`` does so where the device runs it at full
    rate (:func:`resolve_method`).  The loop reuses a fixed workspace: no allocation per iteration.

    ``out`` (contiguous, G's shape, in ``compute_dtype(method, dtype)``): the result is written
    there (the last product's own output; small tall matrices: one transposing copy) and ``out``
    is returned.  It may be G's own memory from its first byte (a
    narrower dtype reinterpreting it): each chunk is read before its results land, and they land
    on bytes of matrices already read.  ``max_chunk``: at most that many matrices per pass (a
    bound on the workspace).  Neither changes a bit of the result.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(G.shape)}")
    if method not in NS_METHODS:
        raise ValueError(f"ns_method={method!r} is unknown; use one of {list(NS_METHODS)}")
    if _transposed_view(G) and not _compiling():
        # the matrix as it is stored: NS(Hᵀ) computed as NS(H)ᵀ, the products H's own layout meets, as
        # torch.optim.Muon's (its cast keeps strides).  On Intel's MKL a small matrix's products round
        # otherwise through a transposed view (1 ulp on an einsum model's [in, out] weight, test_map_rules)
        H = newton_schulz(G.mT, steps, coefficients, dtype, eps, method, max_chunk=max_chunk)
        if out is None:
            return H.mT
        _out3(out, H.reshape(-1, *H.shape[-2:]), H.dtype)  # checked as any out
        return out.view(G.shape).copy_(H.mT)
    per_step, norm_scale = resolve_coefficients(coefficients, steps)
    out_dtype = compute_dtype(method, dtype)
    method = resolve_method(method, G.size(-2), G.size(-1), steps, dtype, G.device.type)
    dtype = compute_dtype(method, dtype)
    rows, cols = G.size(-2), G.size(-1)
    batch_shape = G.shape[:-2]
    G3 = G.reshape(-1, rows, cols)
    gram = method == "gram" and use_gram(rows, cols, steps)
    # where a whole stack's workspace outgrows the caches, whole matrices at a time (ns_kernels):
    # every matrix meets the same operations either way, so the bits do not change
    if _compiling():  # (compiled: no test on the symbolic batch size; compiled_newton_schulz passes no out)
        X = _orthogonalize(G3, per_step, norm_scale, eps, dtype, gram)
        return X.reshape(*batch_shape, rows, cols).to(out_dtype)
    chunk = len(G3) if gram else ns_kernels.chunk_matrices(
        G.device.type, dtype, len(G3), min(rows, cols), max(rows, cols), steps)
    if max_chunk is not None:
        chunk = min(chunk, max_chunk)
    chunk = max(1, chunk)
    if out is None and chunk >= len(G3):
        X = _orthogonalize(G3, per_step, norm_scale, eps, dtype, gram)
        return X.reshape(*batch_shape, rows, cols).to(out_dtype)
    out3 = torch.empty(G3.shape, dtype=out_dtype, device=G.device) if out is None else _out3(out, G3, out_dtype)
    # one cast buffer and one workspace for every chunk (fresh pages per chunk cost page faults)
    chunk = min(chunk, len(G3))
    cast = None if chunk >= len(G3) else aligned_stack(chunk, rows, cols, input_dtype(dtype), G.device)
    ws = None if gram else _workspace(chunk, min(rows, cols), max(rows, cols), dtype, G.device)
    # the last step writes straight into the destination (a tall stack's through its transposed view,
    # where ns_kernels.writes_tall says that keeps the bits)
    tall_in_place = rows > cols and ns_kernels.writes_tall(cols, rows, G.device.type)
    last = out_dtype == dtype and not gram and (rows <= cols or tall_in_place)
    for k0 in range(0, len(G3), chunk):
        k1 = min(len(G3), k0 + chunk)
        dest = out3[k0:k1]
        X = _orthogonalize(G3[k0:k1], per_step, norm_scale, eps, dtype, gram,
                           None if cast is None else cast[:k1 - k0],
                           None if ws is None else [w[:k1 - k0] for w in ws]
                           + ([dest if rows <= cols else dest.mT] if last else []))
        if X.data_ptr() != dest.data_ptr() or X.stride() != dest.stride():
            dest.copy_(X)  # tall (one transposing copy), Gram, a wider result, or no steps
    return out if out is not None else out3.reshape(*batch_shape, rows, cols)


def _transposed_view(G: torch.Tensor) -> bool:
    """``G`` is the transpose of contiguous non-square matrices (``H.mT``), not itself contiguous.  (A square
    one is copied rows-contiguous, as before: NS keeps a square matrix's orientation, so NS(H)ᵀ would run
    HHᵀ where the view's products are HᵀH.)"""
    return G.size(-1) != G.size(-2) and min(G.shape[-2:]) > 1 and not G.is_contiguous() and G.mT.is_contiguous()


def _out3(out: torch.Tensor, G3: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` as [batch, rows, cols], after checking it can hold the result."""
    if out.dtype != dtype or out.numel() != G3.numel() or not out.is_contiguous() or out.device != G3.device:
        raise ValueError(f"newton_schulz: out must be a contiguous {dtype} tensor of {G3.numel()} elements on "
                         f"{G3.device} (the result's), got {out.dtype} {tuple(out.shape)} on {out.device}"
                         f"{'' if out.is_contiguous() else ', not contiguous'}")
    return out.view(G3.shape)


def _orthogonalize(G: torch.Tensor, per_step, norm_scale: float, eps: float, dtype: torch.dtype,
                   gram: bool, cast=None, ws=None) -> torch.Tensor:
    """Cast, normalise and iterate a stack [batch, rows, cols]; the result in G's orientation.
    ``cast`` (a buffer for the cast) and ``ws`` (the iteration's workspace) are reused across chunks."""
    # each matrix copied to a 64-byte boundary (aligned_stack): the products' bits then do not depend on where
    # a matrix sat in the stack it came in, so not on which others share its home
    if G.dtype == input_dtype(dtype) == dtype:  # no cast: normalised straight into the aligned stack
        X = torch.div(G, input_norm(G, norm_scale, eps),
                      out=aligned_stack(*G.shape, dtype, G.device) if cast is None else cast)
    else:
        X = (aligned_stack(*G.shape, input_dtype(dtype), G.device) if cast is None else cast).copy_(G)
        norm = input_norm(X, norm_scale, eps)
        X = X.div_(norm) if X.dtype == dtype else aligned_stack(*G.shape, dtype, G.device).copy_(X / norm)
    # normalised in G's own layout, then viewed wide: the same memory torch.optim.Muon's
    # transposed view has, and the layout torch.compile keeps too (so both run the same products)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = _gram_iteration(X, per_step) if gram else _standard_iteration(X, per_step, ws)
    return X.mT if tall else X


def input_norm(X: torch.Tensor, norm_scale: float, eps: float, dim=(-2, -1)) -> torch.Tensor:
    """The divisor NS normalises ``X`` by: ``max(norm_scale·‖X‖_F, eps)`` per matrix over ``dim``, in
    X's dtype, right at every scale.  torch's bf16 norm sums squares in fp32, which overflows to inf
    for a finite matrix of entries ~1e20 (the update became all zeros) and underflows to 0 below
    ~1e-19 (0/0 with eps = 0).  So the norm is also summed in float64 (wide enough for the squares of
    any fp32/bf16/fp16 value; a float64 input is pre-scaled by its max-abs), and that one is taken
    wherever the fast one could have over- or underflowed: where the float64 norm lies outside
    [2⁻⁴⁰, 2⁶³] (there the fp32 sum is exact to its own rounding).  Elsewhere the result is the
    bits of the fast norm, so NS stays bitwise torch.optim.Muon's.  No device sync: a ``where`` (on the host,
    where reading a value costs nothing, the float64 norm is skipped when no norm is near the edges)."""
    raw = _frobenius_norm(X, dim)
    fast = raw * norm_scale if norm_scale != 1.0 else raw
    fast = fast.clamp_(min=eps).to(X.dtype)
    if X.dtype == torch.float32:  # _frobenius_norm already sums fp32 in float64: no overflow, no underflow
        return fast
    if X.device.type == "cpu" and not _compiling() and \
            bool(((raw >= 2.0 ** -38) & (raw <= 2.0 ** 61)).numpy().all()):  # (compiled: no graph break)
        # (on the host a check costs no sync) every norm 4x inside the range where the fast one is right: the
        # float64 norm, within far less than 4x of it, is inside [2^-40, 2^63] too, so the where below would
        # pick fast everywhere; the float64 norm (a sixth of a small bf16 NS) is not needed
        return fast
    wide = _wide_norm(X, dim)
    ordinary = (wide >= 2.0 ** -40) & (wide <= 2.0 ** 63)
    safe = (wide * norm_scale).clamp_(min=eps).to(X.dtype)
    return torch.where(ordinary, fast, safe)


def _wide_norm(X: torch.Tensor, dim) -> torch.Tensor:
    """‖X‖_F over ``dim`` in float64 with neither overflow nor underflow for any finite X.  A bf16 X is
    first scaled by a power of two (exact) that puts its largest entry in [1/2, 1), so torch's fp32 sum
    of squares cannot overflow or underflow, and the norm is scaled back in float64: no float64 copy of
    X, which would take 4× X's memory at the step's peak (``tests/test_memory.py``)."""
    if X.dtype == torch.bfloat16:
        # the largest |entry|, exact either way; amax of abs() took 0.07 ms where vector_norm(ord=inf) took
        # 0.67 ms on a 256x1024 bf16 matrix (a sixth of the whole bf16 NS, issue 41's bench)
        peak = X.abs().amax(dim=dim, keepdim=True).float()
        exponent = torch.frexp(peak).exponent
        exponent = torch.where(peak > 0, exponent, torch.zeros_like(exponent)).clamp_(min=-127)  # 2^127 fits bf16
        scale = torch.exp2(-exponent.float())
        return torch.linalg.vector_norm(X * scale.to(X.dtype), dim=dim, keepdim=True).double() / scale.double()
    if X.dtype != torch.float64:
        return torch.linalg.vector_norm(X, dim=dim, keepdim=True, dtype=torch.float64)
    peak = torch.amax(X.abs(), dim=dim, keepdim=True)
    peak = torch.where(peak > 0, peak, torch.ones_like(peak))
    return torch.linalg.vector_norm(X / peak, dim=dim, keepdim=True) * peak


def _frobenius_norm(X: torch.Tensor, dim=(-2, -1)) -> torch.Tensor:
    """Each matrix's Frobenius norm, [batch, 1, 1].  An fp32 input accumulates in float64:
    torch's fp32 norm sums in fp32, 1e-5 off on a 256×1024 matrix, and that scale error
    was the whole of an fp32 iteration's error against float64 (6× above what the
    iteration itself rounds; ``benchmarks/ns_accuracy.py``).  bf16 keeps torch's own norm
    (accumulated in fp32, rounded to bf16) so that the bf16 standard iteration stays bitwise
    torch.optim.Muon's."""
    wide = torch.float64 if X.dtype == torch.float32 else None
    return torch.linalg.vector_norm(X, dim=dim, keepdim=True, dtype=wide)


ALIGN_BYTES = 64  # where each matrix an NS product reads starts (a cache line, an AVX-512 vector)


def aligned_stack(count: int, m: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A ``[count, m, n]`` buffer whose every matrix starts on an :data:`ALIGN_BYTES` boundary (rows
    contiguous, the batch stride rounded up).  CPU GEMMs (MKL's ``sgemm`` and batched ``sgemm``, torch
    2.13) round a product of small matrices differently by where its operands start: on the AMD EPYC 44
    of 4080 drawn ``mm`` products of a matrix at an odd offset differed from the same on an aligned copy,
    and 0 of 5428 batched products of aligned matrices differed from the same matrices in another stack
    (one thread; ``benchmarks/ns_neighbours.py`` counts, ``tests/test_ns_kernels.py`` checks).  Where the result lands does not matter (0 of 1800).  torch's
    allocators return storage aligned at least this far (64 bytes on CPU)."""
    per = ALIGN_BYTES // dtype.itemsize if ALIGN_BYTES % dtype.itemsize == 0 else 1
    stride = -(-(m * n) // per) * per if count > 1 else m * n
    return torch.empty(count * stride, dtype=dtype, device=device).as_strided((count, m, n), (stride, n, 1))


def _workspace(count: int, m: int, n: int, dtype: torch.dtype, device) -> list:
    """A and B ([count, m, m]), then two X buffers ([count, m, n], rows contiguous whatever X's strides),
    each matrix aligned (:func:`aligned_stack`).  A fifth entry, where a caller adds one ([count, m, n], or the
    transposed view of a tall destination), is where the last step writes."""
    return [aligned_stack(count, m, m, dtype, device) for _ in range(2)] + \
        [aligned_stack(count, m, n, dtype, device) for _ in range(2)]


def _standard_iteration(X: torch.Tensor, per_step, ws=None) -> torch.Tensor:
    """X ← aX + (bA + cA²)X with A = XXᵀ, on [batch, m, n] with m <= n, in a fixed workspace
    (``ws`` from :func:`_workspace`, or a new one)."""
    b_, m, n = X.shape
    A, B, *bufs = ws if ws is not None else _workspace(b_, m, n, X.dtype, X.device)
    last = bufs[2] if len(bufs) > 2 else None  # the destination of the last step, if given
    compiling = _compiling()
    # the forms this machine runs fastest (ns_kernels: all give the same bits); step 1 of a tall stack
    # reads a transposed view, the later ones the contiguous workspace: looked up once each, not per
    # step (3 µs a lookup: 2 % of a 128² bf16 NS on the Intel AMX box)
    first = ns_kernels.forms_for(X, compiling)
    later = first if X.stride(-1) == 1 else ns_kernels.forms_for(bufs[0], compiling)
    for k, (a, b, c) in enumerate(per_step):
        f_gram, f_poly, f_apply = later if k else first
        ns_kernels.gram(X, A, f_gram)
        ns_kernels.poly(A, b, c, B, f_poly)
        X = ns_kernels.apply(X, B, a, last if last is not None and k + 1 == len(per_step) else bufs[k % 2], f_apply)
    return X


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def _restart_interval(dtype: torch.dtype, steps: int) -> int:
    """Steps between Gram restarts: two in 16-bit dtypes (where Q drifts), none in fp32."""
    return 2 if dtype.itemsize <= 2 else steps


def _gram_iteration(X: torch.Tensor, per_step) -> torch.Tensor:
    """The same polynomial, carried on m×m matrices: X_k = Q_k X_0 with R_k = X_k X_kᵀ.

    Each step Z = aI + bR + cR² (a polynomial in R, so all of them commute),
    Q ← ZQ, R ← ZRZ.  One X·Xᵀ at the start and one Q·X at the end touch the
    long side.  In 16-bit dtypes Q drifts from the iterate it stands for, so the
    iteration restarts from X = QX every two steps (as Dao-AILab's Gram
    Newton–Schulz does); with Polar Express's large early coefficients that
    halves the error.  fp32 runs straight through.
    """
    restart_every = _restart_interval(X.dtype, len(per_step))
    batched = _compiling() or not ns_kernels.batch_sensitive(X)
    bmm, baddbmm = (torch.bmm, torch.baddbmm) if batched else (ns_kernels.per_matrix_bmm, ns_kernels.per_matrix_baddbmm)
    b_, m, _ = X.shape
    eye = torch.eye(m, dtype=X.dtype, device=X.device).expand(b_, m, m)
    square = [aligned_stack(b_, m, m, X.dtype, X.device) for _ in range(5)]  # every product reads aligned matrices
    R, Z, T, Qs = square[0], square[1], square[2], square[3:]
    bmm(X, X.mT, out=R)
    Q = None
    for k, (a, b, c) in enumerate(per_step):
        if k and k % restart_every == 0 and Q is not None:
            X = bmm(Q, X, out=aligned_stack(*X.shape, X.dtype, X.device))
            bmm(X, X.mT, out=R)
            Q = None
        # Z = aI + bR + cR²; the sum aI + B cancels heavily, so it is formed in one rounding
        base = torch.add(R, eye, alpha=a / b).mul_(b) if b else eye * a
        if c:
            baddbmm(base, R, R, alpha=c, out=Z)
        else:  # no product for c = 0 (torch 2.13's CPU baddbmm(alpha=0) is wrong in bf16/fp16: ns_kernels.poly)
            Z.copy_(base)
        Q = Qs[0].copy_(Z) if Q is None else bmm(Z, Q, out=Qs[1] if Q is Qs[0] else Qs[0])
        if k + 1 < len(per_step):
            bmm(Z, R, out=T)
            bmm(T, Z, out=R)
    return bmm(Q, X) if Q is not None else X


_compiled: dict = {}  # (matrix shape, dtypes, settings) -> newton_schulz under torch.compile


def compiled_newton_schulz():
    """:func:`newton_schulz` under ``torch.compile``, for ``compile=True``.

    One compiled function per matrix shape and settings, each with its own code object:
    dynamo keeps at most ``recompile_limit`` graphs per code object and runs the rest
    eagerly, which would make what a stack runs depend on which stacks a rank saw first.
    The batch dimension is unbacked, so one graph serves every stack size: a matrix runs
    the same code whichever others share its stack, at home or in a single process.
    Inductor is told to round where eager rounds (``emulate_precision_casts``) and calls the
    same matmul kernels: results matched eager bitwise on every stack measured, and a matrix
    got the same bits alone or in a stack on all but a tiny tall fp32 one — measured, not
    guaranteed (inductor owns the code); docs/PERFORMANCE.md has speed and accuracy.
    """
    if not hasattr(torch, "compile"):
        raise RuntimeError("ds_muon: compile=True needs torch.compile (torch >= 2.0)")
    return _run_compiled


def _run_compiled(G: torch.Tensor, steps: int = 5, coefficients: Coefficients = "keller",
                  dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7, method: str = "standard") -> torch.Tensor:
    key = (G.ndim, tuple(G.shape[-2:]), G.dtype, G.device.type, steps, repr(coefficients), dtype, eps, method)
    fn = _compiled.get(key)
    if fn is None:
        code = newton_schulz.__code__.replace()  # a code object of its own: its own graph cache
        fresh = types.FunctionType(code, newton_schulz.__globals__, newton_schulz.__name__,
                                   newton_schulz.__defaults__, newton_schulz.__closure__)
        fresh.__kwdefaults__ = dict(newton_schulz.__kwdefaults__ or {})
        fn = _compiled[key] = torch.compile(fresh, dynamic=False, options=_inductor_options())
    if G.ndim == 3 and hasattr(torch._dynamo, "decorators") and hasattr(torch._dynamo.decorators, "mark_unbacked"):
        torch._dynamo.decorators.mark_unbacked(G, 0)
    return fn(G, steps, coefficients, dtype, eps, method)


def _inductor_options() -> dict:
    try:
        from torch._inductor import config as inductor_config
    except ImportError:
        return {}
    return {"emulate_precision_casts": True} if hasattr(inductor_config, "emulate_precision_casts") else {}
