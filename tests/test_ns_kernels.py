"""The kernel forms Newton–Schulz runs (ds_muon.rules.ns_kernels): same bits whichever is chosen, a
matrix's result independent of its batch neighbours, choices agreed on every rank, and
coefficient triples with c = 0 right in 16-bit dtypes."""

import os
import random

import pytest
import torch

import ds_muon
from ds_muon.rules import ns_coefficients, ns_kernels
from ds_muon.rules.newton_schulz import resolve_coefficients

import dist_harness
from test_newton_schulz import ns_float64


@pytest.fixture(autouse=True)
def _fresh_choices():
    ns_kernels.reset()
    yield
    ns_kernels.reset()


# -- c = 0 ---------------------------------------------------------------------------------------

CUBIC = (1.5, -0.5, 0.0)  # X ← 1.5X − 0.5·XXᵀX: the cubic iteration, as a quintic triple with c = 0


@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("shape", [(40, 64), (2, 64, 40)])
def test_c_zero_matches_float64(dtype, bound, shape):
    """torch 2.13's CPU ``baddbmm(alpha=0)`` returns wrong values in bf16/fp16 (2-D ``addmm`` is right);
    a schedule with c = 0 (Emerging-Optimizers' cubic ones) ran into it in every step."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    schedule = [CUBIC, (3.4445, -4.7750, 2.0315), CUBIC, (2.0, -1.25, 0.0), CUBIC]
    got = ds_muon.newton_schulz(G, 5, schedule, dtype)
    coeffs, _ = resolve_coefficients(schedule, 5)
    for k in range(G.shape[0] if G.ndim == 3 else 1):
        g, o = (G[k], got[k]) if G.ndim == 3 else (G, got)
        want = ns_float64(g, coeffs)
        rel = float((o.double() - want).norm() / want.norm())
        assert rel < bound, (dtype, shape, rel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_c_zero_in_the_gram_iteration(dtype):
    G = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    got = ds_muon.newton_schulz(G, 4, [CUBIC], dtype, method="gram")
    want = ns_float64(G, [CUBIC] * 4)
    assert float((got.double() - want).norm() / want.norm()) < 1e-2


# -- forms ---------------------------------------------------------------------------------------

SHAPES = [(5, 20, 36), (3, 36, 20), (2, 160, 200), (2, 200, 160), (1, 384, 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_form_gives_the_same_bits_and_ignores_batch_neighbours(dtype):
    """Batched and per-matrix forms of every product, on stacks small and large, wide and tall (a
    tall stack's first step reads a transposed view): one result, bit for bit, and each matrix's
    result the one it gets alone."""
    with dist_harness.one_thread():
        for shape in SHAPES:
            G = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
            results = {}
            for form in ns_kernels.FORMS:
                ns_kernels.pin(form=form)
                results[form] = ds_muon.newton_schulz(G, 5, "quintic", dtype).contiguous()
                for k in range(shape[0]):
                    alone = ds_muon.newton_schulz(G[k:k + 1], 5, "quintic", dtype)[0]
                    assert torch.equal(alone, results[form][k]), (form, shape, k)
            ns_kernels.pin()
            results["chosen"] = ds_muon.newton_schulz(G, 5, "quintic", dtype).contiguous()
            for budget in (1, 0):  # one matrix per chunk, then whole stacks
                ns_kernels.pin_chunk_bytes(budget)
                results[f"chunks of {budget}"] = ds_muon.newton_schulz(G, 5, "quintic", dtype).contiguous()
            ns_kernels.pin_chunk_bytes(None)
            for form, r in results.items():
                assert torch.equal(r, results["batched"]), (form, shape, dtype)


NEIGHBOUR_DRAWS = int(os.environ.get("DS_MUON_NS_NEIGHBOUR_DRAWS", "24"))


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_matrix_gets_the_same_bits_in_any_stack_at_any_offset(dtype, method):
    """Generated small stacks (short sides from 2, where CPU GEMMs take alignment-dependent small-matrix
    paths): every run of consecutive matrices, each matrix cloned alone, and every chunking give each matrix
    the bits it gets in the whole stack.  A sharded step stacks a matrix with other neighbours, at another
    offset, than one process does; before NS read aligned copies (newton_schulz.aligned_stack) 218 of 4276
    such comparisons differed on the AMD EPYC (one thread)."""
    rng = random.Random(7)
    failed = []
    with dist_harness.one_thread():
        for draw in range(NEIGHBOUR_DRAWS):
            b, m, n = rng.randint(2, 6), rng.randint(2, 40), rng.randint(2, 120)
            G = torch.randn(b, m, n, generator=torch.Generator().manual_seed(draw))
            whole = ds_muon.newton_schulz(G, dtype=dtype, method=method)
            runs = {f"[{i}:{j}]": (ds_muon.newton_schulz(G[i:j], dtype=dtype, method=method), whole[i:j])
                    for i in range(b) for j in range(i + 1, b + 1)}
            runs.update({f"clone {i}": (ds_muon.newton_schulz(G[i].clone(), dtype=dtype, method=method), whole[i])
                         for i in range(b)})
            runs.update({f"chunks of {c}": (ds_muon.newton_schulz(G, dtype=dtype, method=method, max_chunk=c), whole)
                         for c in (1, 2)})
            failed += [f"{(b, m, n)} {k}" for k, (got, want) in runs.items() if not torch.equal(got, want)]
    assert not failed, failed[:10]


TINY_DRAWS = int(os.environ.get("DS_MUON_NS_TINY_DRAWS", "150"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tiny_half_products_keep_a_matrix_bits_alone_and_in_a_stack(dtype):
    """Generated stacks of matrices whose products are tiny (m·m·n <= ns_kernels.TINY_PRODUCT, short sides 2
    to 16): each matrix's NS is the one it gets alone (a stack of one, what a home with one such matrix runs)
    and, in bf16, torch.optim.Muon's (2-D products).  On the AMD EPYC (torch 2.13) a tiny bf16 product rounds
    otherwise in a batch than alone or as a 2-D product (16 of 12000 drawn 16x16 ``poly`` products): a
    sharded FSDP2 step of a Qwen2-MoE's 16x32 matrices differed from one process by 1 ulp at its second step."""
    from torch.optim import _muon
    from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

    torch_triple = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)  # what torch.optim.Muon runs by default
    assert torch_triple == ns_coefficients.KELLER  # ds_muon's default ("keller") is the same triple

    rng = random.Random(11)
    failed, checked = [], 0
    with dist_harness.one_thread():
        for draw in range(TINY_DRAWS):
            m = rng.randint(2, 16)
            n = rng.randint(m, max(m, ns_kernels.TINY_PRODUCT // (m * m)))
            b = rng.randint(2, 5)
            G = torch.randn(b, m, n, generator=torch.Generator().manual_seed(draw)).to(dtype)
            G = G.mT.contiguous() if draw % 3 == 0 else G  # tall too
            whole = ds_muon.newton_schulz(G, dtype=dtype, method="standard")
            for k in range(b):
                checked += 1
                if not torch.equal(ds_muon.newton_schulz(G[k:k + 1], dtype=dtype, method="standard")[0], whole[k]):
                    failed.append((tuple(G.shape), k, "alone"))
                if dtype == torch.bfloat16 and not torch.equal(torch_ns(G[k], torch_triple, 5, 1e-7),
                                                               whole[k]):
                    failed.append((tuple(G.shape), k, "torch.optim.Muon"))
    assert not failed, f"{len(failed)} of {checked} matrices: {failed[:8]}"


def test_choices_follow_pins_then_calibration_then_the_family_table(monkeypatch):
    key = ("cpu", "bfloat16", "apply", True, "large")
    monkeypatch.setitem(ns_kernels.TABLES, ns_kernels.family("cpu"), {key[1:]: "per_matrix"})
    assert ns_kernels.choice("cpu", torch.bfloat16, "apply", True, 512, 1024) == "per_matrix"
    assert ns_kernels.choice("cpu", torch.bfloat16, "apply", True, 16, 32) == "batched"  # small: another class
    table_print = ns_kernels.fingerprint()
    ns_kernels._calibrated[key] = "batched"
    assert ns_kernels.choice("cpu", torch.bfloat16, "apply", True, 512, 1024) == "batched"
    ns_kernels.pin({key: "per_matrix"})
    assert ns_kernels.choice("cpu", torch.bfloat16, "apply", True, 512, 1024) == "per_matrix"
    assert ns_kernels.fingerprint() == table_print  # the same choices in effect: the same fingerprint
    ns_kernels.pin(form="batched")
    assert ns_kernels.fingerprint().startswith("[]")
    with pytest.raises(ValueError, match="form='fast' is not a form"):
        ns_kernels.pin(form="fast")
    with pytest.raises(ValueError, match="is not a class"):
        ns_kernels.pin({("cpu", "bfloat16"): "batched"})
    with pytest.raises(ValueError, match="budget=-1 must be an int >= 0 or None"):
        ns_kernels.pin_chunk_bytes(-1)
    ns_kernels.pin_chunk_bytes(5 * 2**20)
    assert ns_kernels.chunk_matrices("cpu", torch.bfloat16, 8, 512, 512, 5) == 2  # 2.5 MiB of workspace each
    assert ns_kernels.chunk_matrices("cpu", torch.float32, 8, 512, 512, 5) == 1
    assert "chunks [('cpu', 5242880)]" in ns_kernels.fingerprint()
    ns_kernels.pin_chunk_bytes(0)
    assert ns_kernels.chunk_matrices("cpu", torch.bfloat16, 8, 512, 512, 5) == 8


def test_calibration_picks_only_forms_with_the_batched_bits(monkeypatch):
    """A faster form that rounds differently is never chosen; a faster one with the same bits is."""
    monkeypatch.setattr(ns_kernels, "CALIBRATION_STACKS", {"large": (2, 64, 128), "small": (2, 8, 16)})
    monkeypatch.setattr(ns_kernels, "CHUNK_STACK", (2, 16, 24))
    fake = {"gram": (0.5, True), "poly": (0.5, False), "apply": (0.99, True)}  # per_matrix's (time, same bits)

    def measure(product, dtype, device, transposed, bucket, repeats=5):
        return {"batched": (1.0, True), "per_matrix": fake[product]}

    monkeypatch.setattr(ns_kernels, "measure", measure)
    chosen = ns_kernels.calibrate("cpu", (torch.float32,))
    assert set(chosen.values()) <= set(ns_kernels.FORMS)
    assert {k[2] for k, f in chosen.items() if f == "per_matrix"} == {"gram"}  # poly: other bits; apply: < 5 %
    assert ns_kernels.choice("cpu", torch.float32, "gram", False, 64, 128) == "per_matrix"
    assert ns_kernels.chunk_bytes("cpu") in (None,) + tuple(b for b in ns_kernels.CHUNK_CANDIDATES if b)
    monkeypatch.undo()
    real = ns_kernels.measure("apply", torch.float32, "cpu", True, "small", repeats=1)  # the real one runs
    assert set(real) == set(ns_kernels.FORMS) and all(t >= 0 for t, _ in real.values())


# -- agreed on every rank ------------------------------------------------------------------------
# These run inside tests/test_agreement.py's W=2 worker (one spawn for both: a spawn costs seconds).

def kernels_worker(rank):
    """On each rank of a W=2 run: a step where rank 1 alone pins another form (must fail the same
    way on every rank, before anything changes), then calibration with rank 1's timings made to
    pick otherwise (rank 0's choices must win everywhere, and the step must run)."""
    from torch import nn

    def attempt():
        torch.manual_seed(0)
        ps = [nn.Parameter(torch.randn(s)) for s in [(24, 8), (8, 24)]]
        opt = ds_muon.Muon([{"params": ps, "param_names": ["tall", "wide"]}], mode="duplicated")
        for p in ps:
            p.grad = torch.ones_like(p)
        before = [p.detach().clone() for p in ps]
        try:
            opt.step()
        except ValueError as e:
            return str(e), all(torch.equal(a, p) for a, p in zip(before, ps))
        return None, [p.detach().clone() for p in ps]

    out = {}
    saved = ns_kernels.measure, ns_kernels.CALIBRATION_STACKS, ns_kernels.CHUNK_STACK
    try:
        if rank == 1:  # this rank alone runs another form for a class the others run batched
            ns_kernels.pin({("cpu", "bfloat16", "apply", True, "small"): "per_matrix"})
        out["pinned"] = attempt()
        ns_kernels.reset()
        if rank == 1:
            ns_kernels.measure = lambda product, *a, **k: {"batched": (1.0, True), "per_matrix": (0.1, True)}
        ns_kernels.CALIBRATION_STACKS = {"large": (2, 64, 128), "small": (2, 8, 16)}
        ns_kernels.CHUNK_STACK = (2, 16, 24)
        out["calibrated"] = ns_kernels.calibrate("cpu", (torch.float32,), repeats=1), ns_kernels.fingerprint()
        out["after"] = attempt()
    finally:
        ns_kernels.measure, ns_kernels.CALIBRATION_STACKS, ns_kernels.CHUNK_STACK = saved
        ns_kernels.reset()
    return out


def check_kernels_agreed(results):
    for out in results:
        msg, unchanged = out["pinned"]
        assert msg is not None and unchanged, msg
        assert msg.startswith("ds_muon: optimizer settings differ between ranks: ns_kernels is ")
        assert "'apply', True, 'small'), 'per_matrix')" in msg and "on rank 1" in msg
        assert "ds_muon.rules.ns_kernels.pin() alike on every rank" in msg
        assert out["after"][0] is None  # steps: the ranks run the same kernels
    assert results[0]["calibrated"] == results[1]["calibrated"]
    assert torch.equal(results[0]["after"][1][0], results[1]["after"][1][0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tall_last_step_into_transposed_view_keeps_the_bits(dtype):
    """``apply`` into a transposed view of a tall destination (``writes_tall``: the last NS step of a
    large tall stack, no transposing copy after) gives the bits of the contiguous product transposed,
    on 12 drawn large shapes (contiguous and transposed inputs, as step 1 reads)."""
    if ns_kernels.family("cpu") not in ns_kernels.WRITES_TALL_FAMILIES:
        pytest.skip(f"{ns_kernels.family('cpu')} copies a tall result instead (ns_kernels.WRITES_TALL_FAMILIES)")
    g = torch.Generator().manual_seed(5)
    with dist_harness.one_thread():
        for k in range(12):
            m = int(torch.randint(130, 260, (1,), generator=g))
            n = m + int(torch.randint(0, 300, (1,), generator=g))
            assert ns_kernels.writes_tall(m, n)
            X = (torch.randn(2, n, m, generator=g) / (m * n) ** 0.5).to(dtype).mT if k % 2 else \
                (torch.randn(2, m, n, generator=g) / (m * n) ** 0.5).to(dtype)
            A = torch.bmm(X, X.mT)
            B = torch.baddbmm(A, A, A, beta=-4.775, alpha=2.0315)
            want = ns_kernels.apply(X, B, 3.4445, torch.empty(2, m, n, dtype=dtype), "batched").mT
            dest = torch.empty(2, n, m, dtype=dtype)
            ns_kernels.apply(X, B, 3.4445, dest.mT, "batched")
            assert torch.equal(dest, want), (m, n)
