"""Newton–Schulz on its own: schedules, accuracy against float64, batching, the Gram iteration."""

import importlib

import pytest
import torch

import ds_muon
from ds_muon.rules.newton_schulz import KELLER, QUINTIC, resolve_coefficients

import dist_harness


# -- Newton–Schulz -------------------------------------------------------------------------

def ns_float64(G, coeffs, norm_scale=1.0, eps=1e-7):
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (X.norm() * norm_scale).clamp(min=eps)
    for a, b, c in coeffs:
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.T if tall else X


@pytest.mark.parametrize("shape", [(32, 32), (24, 64), (64, 24)])
@pytest.mark.parametrize("schedule", ["keller", "quintic", "polar_express"])
def test_fp32_against_float64(shape, schedule):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    coeffs, norm_scale = resolve_coefficients(schedule, 5)
    want = ns_float64(G, coeffs, norm_scale)
    got = ds_muon.newton_schulz(G, 5, schedule, torch.float32)
    assert got.dtype == torch.float32 and got.shape == G.shape
    rel = (got.double() - want).norm() / want.norm()
    assert rel < 1e-4, rel


def test_fp32_norm_does_not_limit_accuracy():
    """torch's fp32 Frobenius norm sums in fp32 (1e-5 off on 256×1024); that scale error was the
    whole fp32 iteration's error (1.3e-5 against float64). Accumulated in float64 it is 1.4e-6."""
    G = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)) * torch.logspace(0, -2, 1024)
    ref = ns_float64(G, resolve_coefficients("keller", 5)[0])
    got = ds_muon.newton_schulz(G, 5, "keller", torch.float32)
    assert ((got.double() - ref).norm() / ref.norm()) < 4e-6


@pytest.mark.parametrize("shape", [(1536, 512), (512, 1536)])
def test_bitwise_torch_optim_muon_iteration(shape):
    """The default (bf16, Keller) is torch's own iteration bit for bit, tall matrices included:
    the norm is taken in the input's own layout, as torch's is (over a transposed view it
    rounded differently on these inputs)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    with dist_harness.one_thread():
        G = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(0, -2, shape[1])
        assert torch.equal(ds_muon.newton_schulz(G).contiguous(), _zeropower_via_newtonschulz(G, KELLER, 5, 1e-7))


def test_a_transposed_view_gets_the_stored_matrix_products():
    """Generated shapes (small, where CPU GEMMs take layout-dependent paths, and large), bf16 and fp32:
    NS of ``H.mT`` is NS(H)ᵀ bit for bit, and torch.optim.Muon's on the view (its cast keeps the strides).
    A model stores a weight [in, out] and its update is NS of the [out, in] view; before, NS copied the view
    into its own layout and on the Intel AMX box 2 of 6 einsum weights moved 1 ulp off the stored-layout
    products the optimizer runs (test_map_rules)."""
    import random

    from torch.optim._muon import _zeropower_via_newtonschulz

    rng, failed = random.Random(5), []
    shapes = [(rng.randint(2, 40), rng.randint(2, 40)) for _ in range(16)] + [(96, 256), (256, 96)]
    shapes = [s for s in shapes if s[0] != s[1]]  # (a square view keeps its orientation: _transposed_view)
    with dist_harness.one_thread():
        for k, (r, c) in enumerate(shapes):
            H = torch.randn(r, c, generator=torch.Generator().manual_seed(k))
            for dtype in (torch.float32, torch.bfloat16):
                got = ds_muon.newton_schulz(H.mT, dtype=dtype)
                if not torch.equal(got, ds_muon.newton_schulz(H, dtype=dtype).mT):
                    failed.append((r, c, dtype))
            if not torch.equal(ds_muon.newton_schulz(H.mT), _zeropower_via_newtonschulz(H.mT, KELLER, 5, 1e-7)):
                failed.append((r, c, "torch"))
    assert not failed, failed


def test_batched_equals_one_by_one():
    with dist_harness.one_thread():
        G = torch.randn(5, 20, 36)
        batched = ds_muon.newton_schulz(G)
        for k in range(5):
            assert torch.equal(batched[k], ds_muon.newton_schulz(G[k]))


def test_polar_express_singular_values_near_one():
    G = torch.randn(96, 48, generator=torch.Generator().manual_seed(0))
    O = ds_muon.newton_schulz(G, steps=8, coefficients="polar_express", dtype=torch.float32)
    s = torch.linalg.svdvals(O)
    assert (s - 1).abs().max() < 0.05, s


def test_schedules_as_designed():
    assert resolve_coefficients("keller", 3)[0] == (KELLER,) * 3
    assert resolve_coefficients("quintic", 7)[0] == QUINTIC + (QUINTIC[-1],) * 2
    pe, scale = resolve_coefficients("polar_express", 8)
    assert scale == 1.01 and pe[-1] == (1.875, -1.25, 0.375)
    assert pe[0] == pytest.approx((8.28721201814563 / 1.01, -23.595886519098837 / 1.01**3,
                                   17.300387312530933 / 1.01**5))
    assert resolve_coefficients((1.0, 2.0, 3.0), 2)[0] == ((1.0, 2.0, 3.0),) * 2
    assert resolve_coefficients([(1, 2, 3), (4, 5, 6)], 3)[0] == ((1, 2, 3), (4, 5, 6), (4, 5, 6))


def test_zero_matrix_stays_finite():
    O = ds_muon.newton_schulz(torch.zeros(8, 4))
    assert torch.isfinite(O).all() and O.abs().max() == 0


# -- Gram Newton–Schulz (opt-in) --------------------------------------------------------------------

def _deepspeed_fp16_gram_error(G):
    """DeepSpeed 0.19.8's own Gram Newton–Schulz in fp16 (its choice for gram), eagerly, against
    itself in float64; None without DeepSpeed."""
    try:
        from deepspeed.runtime.zero.muon import original_muon
    except ImportError:
        return None
    gram = original_muon.zeropower_via_gram_newtonschulz
    gram = getattr(gram, "_torchdynamo_orig_callable", gram)
    saved = original_muon.ns_compute_dtype
    try:
        original_muon.ns_compute_dtype = lambda method="gram": torch.float16
        x = gram(G, steps=5)
        original_muon.ns_compute_dtype = lambda method="gram": torch.float64
        ref = gram(G.double(), steps=5)
    finally:
        original_muon.ns_compute_dtype = saved
    return float((x.double() - ref).norm() / ref.norm())


def test_gram_matches_standard_iteration():
    from ds_muon.rules.newton_schulz import use_gram

    g = torch.Generator().manual_seed(4)
    for shape in [(64, 256), (256, 48)]:
        assert use_gram(*shape, 5)
        G = torch.randn(shape, generator=g)
        ref = ns_float64(G, resolve_coefficients("keller", 5)[0])
        fp32 = ds_muon.newton_schulz(G, dtype=torch.float32, method="gram")
        assert ((fp32.double() - ref).norm() / ref.norm()) < 1e-4
        bf16 = ds_muon.newton_schulz(G, dtype=torch.bfloat16, method="gram")
        std = ds_muon.newton_schulz(G, dtype=torch.bfloat16)
        err_gram = (bf16.double() - ref).norm() / ref.norm()
        err_std = (std.double() - ref).norm() / ref.norm()
        # asked for in bf16, Gram iterates in fp16: well below the standard bf16 iteration's error
        # and below DeepSpeed's fp16 Gram (benchmarks/ns_accuracy.py)
        assert bf16.dtype == torch.float16
        assert err_gram < err_std / 2, (err_gram, err_std)
        err_deepspeed = _deepspeed_fp16_gram_error(G)
        if err_deepspeed is not None:
            assert err_gram < err_deepspeed, (err_gram, err_deepspeed)
    # square: gram is not cheaper, so the standard iteration runs (bitwise the same, in fp16)
    G = torch.randn(32, 32, generator=g)
    assert not use_gram(32, 32, 5)
    assert torch.equal(ds_muon.newton_schulz(G, method="gram"), ds_muon.newton_schulz(G, dtype=torch.float16))


def test_fp16_iteration_normalises_before_the_cast():
    """fp16 stops at 65504: a finite fp32 gradient above that must not become inf (or zeros)."""
    G = torch.randn(16, 64, generator=torch.Generator().manual_seed(6))
    for method in ("standard", "gram"):
        big = ds_muon.newton_schulz(G * 1e6, dtype=torch.float16, method=method)
        assert torch.isfinite(big).all()
        assert torch.equal(big, ds_muon.newton_schulz(G, dtype=torch.float16, method=method))


def test_gram_restart_keeps_polar_express_accurate_in_bf16(monkeypatch):
    from ds_muon.rules.newton_schulz import _gram_iteration

    G = torch.randn(128, 512, generator=torch.Generator().manual_seed(5))
    coeffs, scale = resolve_coefficients("polar_express", 8)
    ref = ns_float64(G, coeffs, scale)
    X = G.bfloat16()
    X = (X / (X.norm() * scale))[None]
    err = lambda out: ((out[0].double() - ref).norm() / ref.norm()).item()  # noqa: E731
    restarted = err(_gram_iteration(X, coeffs))  # bf16: a restart every two steps
    ns_module = importlib.import_module("ds_muon.rules.newton_schulz")  # the package exports the function of that name
    monkeypatch.setattr(ns_module, "_restart_interval", lambda dtype, steps: steps)
    straight = err(_gram_iteration(X, coeffs))
    assert restarted < 0.8 * straight, (restarted, straight)


# -- ns_method="auto" --------------------------------------------------------------------------------

def test_auto_picks_gram_only_where_it_saves_flops_and_runs_at_full_rate(monkeypatch):
    """Gram where it saves FLOPs (wide, not square) and the device's table lets Gram run in the asked
    dtype (ns_auto.gram_pays): fp32 everywhere (the same GEMMs, fewer; as accurate against the float64
    polar factor), bf16 only where fp16 runs at bf16's rate (a GPU; CPUs: 5-17x slower), fp16 nowhere
    (small CPU stacks round a matrix with its batch)."""
    from ds_muon.rules import ns_auto
    from ds_muon.rules.newton_schulz import resolve_method

    monkeypatch.setattr(ns_auto, "cuda_capability", lambda: (9, 0))
    monkeypatch.setattr(ns_auto, "read_cpuinfo", lambda: ("GenuineIntel", frozenset({"avx2", "avx512f", "amx_bf16"})))
    ns_auto.reset()
    try:
        for device in ("cpu", "cuda"):
            assert resolve_method("auto", 64, 256, 5, torch.float32, device) == "gram"
            assert resolve_method("auto", 256, 64, 5, torch.float32, device) == "gram"
            assert resolve_method("auto", 64, 256, 5, torch.float16, device) == "standard"
            assert resolve_method("auto", 32, 32, 5, torch.bfloat16, device) == "standard"  # square: no saving
            assert resolve_method("auto", 32, 32, 5, torch.float32, device) == "standard"
            assert resolve_method("standard", 64, 256, 5, torch.bfloat16, device) == "standard"
        assert resolve_method("auto", 64, 256, 5, torch.bfloat16, "cuda") == "gram"
        assert resolve_method("auto", 256, 64, 5, torch.bfloat16, "cuda") == "gram"
        assert resolve_method("auto", 64, 256, 5, torch.bfloat16, "cpu") == "standard"
        G = torch.randn(64, 256, generator=torch.Generator().manual_seed(8))
        # on this CPU: bf16 the standard iteration, fp32 the Gram one, bitwise
        assert torch.equal(ds_muon.newton_schulz(G, dtype=torch.bfloat16, method="auto"),
                           ds_muon.newton_schulz(G, dtype=torch.bfloat16))
        assert torch.equal(ds_muon.newton_schulz(G, dtype=torch.float32, method="auto"),
                           ds_muon.newton_schulz(G, dtype=torch.float32, method="gram"))
    finally:
        ns_auto.reset()


def test_auto_gram_in_bf16_returns_bf16_and_rounds_better(monkeypatch, request):
    """Where auto picks Gram for bf16 (a GPU), it iterates in fp16 and hands back bf16, so a group's
    stacks share one dtype; the CPU stands in for the GPU here."""
    from ds_muon.rules import ns_auto

    ns_module = importlib.import_module("ds_muon.rules.newton_schulz")
    resolve = ns_module.resolve_method
    monkeypatch.setattr(ns_module, "resolve_method", lambda m, r, c, s, d, dev: resolve(m, r, c, s, d, "cuda"))
    monkeypatch.setattr(ns_auto, "cuda_capability", lambda: (8, 0))  # an sm80 GPU's table entry
    ns_auto.reset()
    request.addfinalizer(ns_auto.reset)  # forget the mocked GPU's decision afterwards
    G = torch.randn(64, 256, generator=torch.Generator().manual_seed(9))
    ref = ns_float64(G, resolve_coefficients("keller", 5)[0])
    auto = ds_muon.newton_schulz(G, method="auto")
    std = ds_muon.newton_schulz(G)
    assert auto.dtype == torch.bfloat16 and ns_module.compute_dtype("auto", torch.bfloat16) == torch.bfloat16
    err = lambda x: ((x.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    assert err(auto) < err(std), (err(auto), err(std))


def test_settings_are_validated_by_name():
    p = torch.nn.Parameter(torch.randn(4, 8))
    ds_muon.Muon([p], ns_method="auto", compile=False)
    for bad, name in ((dict(ns_method="fast"), "ns_method"), (dict(compile="yes"), "compile")):
        with pytest.raises(ValueError, match=name):
            ds_muon.Muon([p], **bad)
    opt = ds_muon.Muon([p])
    opt.param_groups[0]["compile"] = 1
    p.grad = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: compile"):
        opt.step()


# -- compile=True ------------------------------------------------------------------------------------

def _torch_compile_works() -> bool:
    """torch.compile on CPU needs a working C++ toolchain; try the smallest graph once."""
    try:
        return bool(torch.compile(lambda x: x * 2 + 1)(torch.ones(2)).eq(3).all())
    except Exception:
        return False


COMPILE_SHAPES = [(16, 24), (16, 24), (24, 16), (20, 20)]


def _compile_run(world, rank=0):
    """Two Muon groups, one compiled (bf16 NS), one eager with ns_method="auto" (fp32 NS), 3 steps."""
    g = torch.Generator().manual_seed(11)
    mats = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in COMPILE_SHAPES]
    opt = ds_muon.Muon([{"params": mats[:2] + mats[3:], "compile": True},
                        {"params": mats[2:3], "ns_method": "auto", "ns_dtype": torch.float32}], lr=0.05)
    for t in range(3):
        gg = torch.Generator().manual_seed(100 + t)
        for p in mats:
            p.grad = torch.randn(p.shape, generator=gg)
        opt.step()
    return [m.detach().clone() for m in mats]


def _compile_worker(rank, world):
    return _compile_run(world, rank)


def _eager_run():
    g = torch.Generator().manual_seed(11)
    mats = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in COMPILE_SHAPES]
    opt = ds_muon.Muon(mats[:2] + mats[3:], lr=0.05)
    for t in range(3):
        gg = torch.Generator().manual_seed(100 + t)
        for p in mats:
            p.grad = torch.randn(p.shape, generator=gg)
        opt.step()
    return [m.detach().clone() for m in mats[:2] + mats[3:]]


def test_compile_trains_and_sharded_equals_single_process():
    if not _torch_compile_works():
        pytest.skip("torch.compile does not work here (it needs a C++ compiler on CPU)")
    with dist_harness.one_thread():
        single = _compile_run(1)
        again = _compile_run(1)
        eager = _eager_run()
    assert all(torch.equal(a, b) for a, b in zip(single, again))  # compiled NS is deterministic
    compiled = single[:2] + single[3:]
    for c, e in zip(compiled, eager):  # not bitwise equal to eager (docs/PERFORMANCE.md), but the same step
        assert torch.isfinite(c).all()
        assert ((c - e).norm() / e.norm()) < 1e-2, ((c - e).norm() / e.norm())
    from ds_muon.rules.newton_schulz import compiled_newton_schulz

    with dist_harness.one_thread():  # one graph per shape whatever the stack size, so homes get the same bits
        for shape in [(3, 16, 24), (3, 24, 16)]:
            G = torch.randn(shape, generator=torch.Generator().manual_seed(12))
            stack = compiled_newton_schulz()(G)
            for k in range(shape[0]):
                assert torch.equal(compiled_newton_schulz()(G[k:k + 1].clone())[0], stack[k]), (shape, k)
    for rank, mats in enumerate(dist_harness.run(_compile_worker, 2, timeout=240)):
        for i, (a, b) in enumerate(zip(mats, single)):
            assert torch.equal(a, b), f"rank {rank} matrix {i} {COMPILE_SHAPES[i]}"


# -- results written into their destination (out=, max_chunk=) -----------------------------

def _out_cases(n: int, seed: int = 11):
    """Seeded draws: stack shape (tall, wide, square; 16-bit and fp32 inputs), NS dtype, method,
    steps, chunk bound, and whether ``out`` is fresh or the input's own memory."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=g))]  # noqa: E731
    for _ in range(n):
        rows, cols = (int(x) for x in torch.randint(3, 72, (2,), generator=g))
        yield dict(batch=int(torch.randint(1, 6, (1,), generator=g)), rows=rows, cols=cols,
                   in_dtype=pick([torch.float32, torch.bfloat16]), dtype=pick([torch.bfloat16, torch.float32, torch.float16]),
                   method=pick(["standard", "standard", "gram"]), steps=pick([1, 2, 5]),
                   max_chunk=pick([None, 1, 2, 4]), alias=pick([False, True]))


LARGE_TALL = [dict(batch=b, rows=r, cols=c, in_dtype=torch.float32, dtype=dt, method="standard", steps=st,
                   max_chunk=mc, alias=al)
              for (b, r, c), dt, st, mc, al in (((2, 300, 160), torch.bfloat16, 5, None, True),
                                                ((3, 260, 140), torch.float32, 1, 1, False),
                                                ((2, 200, 180), torch.float32, 5, 1, True),
                                                ((3, 290, 150), torch.bfloat16, 2, 2, False))]


@pytest.mark.parametrize("case", list(_out_cases(40)) + LARGE_TALL, ids=lambda c: "{batch}x{rows}x{cols}-{dtype}-{method}-"
                         "{steps}-{max_chunk}-{alias}".format(**c).replace("torch.", ""))
def test_out_and_max_chunk_change_no_bit(case):
    """``newton_schulz(out=..., max_chunk=...)`` (what ChunkedNS runs: results straight into the
    stack's own memory, written by the last product itself: large tall stacks through the
    destination's transposed view) gives exactly the bits of the plain call, for tall, wide and
    square stacks, every NS dtype and method (40 drawn, small; 4 large tall ones)."""
    from ds_muon.rules.newton_schulz import compute_dtype

    with dist_harness.one_thread():
        G = torch.randn(case["batch"], case["rows"], case["cols"],
                        generator=torch.Generator().manual_seed(case["rows"])).to(case["in_dtype"])
        args = (case["steps"], "keller", case["dtype"], 1e-7, case["method"])
        want = ds_muon.newton_schulz(G.clone(), *args)
        rdt = compute_dtype(case["method"], case["dtype"])
        alias = case["alias"] and rdt.itemsize <= G.element_size()
        if alias:  # the result over the input's own bytes, as ChunkedNS runs it
            mine = G.clone()
            out = mine.view(-1).view(torch.uint8)[:mine.numel() * rdt.itemsize].view(rdt).view(G.shape)
        else:
            mine, out = G.clone(), torch.empty(G.shape, dtype=rdt)
        got = ds_muon.newton_schulz(mine, *args, out=out, max_chunk=case["max_chunk"])
        assert got is out and got.dtype == want.dtype
        assert torch.equal(got, want.contiguous())
        if not alias:
            assert torch.equal(mine, G)  # the input is only read


def test_out_that_cannot_hold_the_result_is_refused():
    G = torch.randn(2, 8, 12)
    with pytest.raises(ValueError, match="out must be a contiguous torch.bfloat16"):
        ds_muon.newton_schulz(G, out=torch.empty(2, 8, 12))  # fp32, the result is bf16
    with pytest.raises(ValueError, match="not contiguous"):
        ds_muon.newton_schulz(G, out=torch.empty(2, 12, 8, dtype=torch.bfloat16).mT)
