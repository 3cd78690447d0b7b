"""``ns_dtype="auto"`` / ``ns_method="auto"`` (ds_muon.rules.ns_auto): the table's decisions per device,
decided once per process, the same on every rank (a mixed cluster raises naming the setting), an
explicit setting winning, and sharded steps bitwise equal to one process for every explicit dtype and
for auto.  The machine readers are mocked: the decisions are checked for CPUs this box is not."""

import pytest
import torch
from torch import nn

import ds_muon
from ds_muon.engine.agreement.fingerprints import AUTO_SUFFIX, settings_of
from ds_muon.engine.plan.compile import ns_settings
from ds_muon.rules import ns_auto

import dist_harness
from conftest import FAST_NS_DTYPE

INTEL_AMX = ("GenuineIntel", {"sse4_2", "avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"})
AMD_ZEN4 = ("AuthenticAMD", {"sse4_2", "avx2", "avx512f", "avx512_bf16"})
AMD_AVX2 = ("AuthenticAMD", {"sse4_2", "avx2", "fma"})  # issue 41's EPYC: family 25, model 1
SKYLAKE = ("GenuineIntel", {"sse4_2", "avx2", "avx512f"})  # AVX-512 without bf16 units: fp32 by the table
ARM = ("unknown", {"fp", "asimd"})  # an aarch64 "Features" line: no table entry


@pytest.fixture
def machine(monkeypatch):
    """``machine(cpu=(vendor, flags), cuda=(major, minor) or None)``: what ns_auto reads, mocked; the
    cached decisions are forgotten before and after (measure() counts its calls in ``machine.measured``)."""
    calls = []
    real_measure = ns_auto.measure

    def measure(device_type, repeats=5):
        calls.append(device_type)
        return real_measure(device_type, repeats)

    def set_machine(cpu=INTEL_AMX, cuda=None):
        monkeypatch.setattr(ns_auto, "read_cpuinfo", lambda: (cpu[0], frozenset(cpu[1])))
        monkeypatch.setattr(ns_auto, "cuda_capability", lambda: cuda)
        ns_auto.reset()

    monkeypatch.setattr(ns_auto, "measure", measure)
    set_machine.measured = calls
    ns_auto.reset()
    yield set_machine
    ns_auto.reset()


@pytest.mark.parametrize("cpu, dtype, gram16", [(INTEL_AMX, "bfloat16", False), (AMD_ZEN4, "bfloat16", False),
                                                 (AMD_AVX2, "float32", False), (SKYLAKE, "float32", False)],
                         ids=["intel-amx", "amd-avx512-bf16", "amd-avx2-only", "avx512-no-bf16"])
def test_cpu_table(machine, cpu, dtype, gram16):
    machine(cpu=cpu)
    c = ns_auto.choice("cpu")
    assert c.dtype == dtype and not c.why.startswith("measured") and not machine.measured
    assert ns_auto.resolve_dtype("auto", "cpu") == getattr(torch, dtype)
    # Gram runs in the asked dtype for fp32/fp16 (fewer FLOPs, same GEMMs); asked in bf16 it iterates in
    # fp16, which no CPU here multiplies at bf16's rate
    assert ns_auto.gram_pays("cpu", torch.float32) and not ns_auto.gram_pays("cpu", torch.float16)
    assert ns_auto.gram_pays("cpu", torch.bfloat16) == gram16
    assert c.device.startswith(f"cpu:{cpu[0]}:")


@pytest.mark.parametrize("cpu", [ARM], ids=["aarch64"])
def test_unknown_cpu_is_measured_once_per_process(machine, cpu):
    machine(cpu=cpu)
    first = ns_auto.choice("cpu")
    assert machine.measured == ["cpu"] and first.why.startswith("measured: bf16 baddbmm took")
    assert first.dtype in ("bfloat16", "float32")
    assert ns_auto.choice("cpu") is first and machine.measured == ["cpu"]  # cached: decided once


def test_measurement_takes_bf16_only_where_it_pays(monkeypatch):
    """The measured rule on fabricated clocks: bf16 at 0.5x fp32's time is taken, at 0.9x it is not."""
    for share, want in ((0.5, "bfloat16"), (0.9, "float32"), (30.0, "float32")):
        ticks = iter([x for _ in range(6) for x in (0.0, share, 0.0, 1.0)])
        monkeypatch.setattr(ns_auto.time, "process_time", lambda: next(ticks))
        assert ns_auto.measure("cpu").dtype == want


@pytest.mark.parametrize("cap, dtype, gram_bf16", [((9, 0), "bfloat16", True), ((8, 0), "bfloat16", True),
                                                   ((8, 6), "bfloat16", True), ((7, 5), "float16", False),
                                                   ((7, 0), "float16", False), ((6, 1), "float32", False)])
def test_cuda_table(machine, cap, dtype, gram_bf16):
    machine(cuda=cap)
    c = ns_auto.choice("cuda")
    assert c.dtype == dtype and c.device == f"cuda:sm{cap[0]}{cap[1]}" and not machine.measured
    assert ns_auto.gram_pays("cuda", torch.bfloat16) == gram_bf16
    assert ns_auto.gram_pays("cuda", torch.float32) and not ns_auto.gram_pays("cuda", torch.float16)


def _model():
    g = torch.Generator().manual_seed(0)
    # the input layer, three hidden maps (tall, wide, square) and the output layer: Muon's rule leaves the first
    # and last to AdamW
    m = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 96, bias=False), nn.Linear(96, 32, bias=False), nn.Linear(32, 32),
                      nn.Linear(32, 8))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m


def _step(m, opt, seed=1):
    g = torch.Generator().manual_seed(seed)
    m(torch.randn(4, 32, generator=g)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def test_avx2_machine_steps_in_fp32_with_gram_on_wide_matrices(machine):
    """The AVX2-only EPYC simulated: auto gives fp32 (and Gram where it saves FLOPs), bitwise the
    explicit choice; the summary and the first-step line say what was chosen and why."""
    machine(cpu=AMD_AVX2)
    runs = {}
    for name, kw in (("auto", {}), ("explicit", dict(ns_dtype=torch.float32, ns_method="auto")),
                     ("bf16", dict(ns_dtype="bfloat16", ns_method="standard"))):
        m = _model()
        opt = ds_muon.Muon(ds_muon.muon_param_groups(m), **kw)
        with dist_harness.one_thread():
            _step(m, opt)
        runs[name] = (m, opt)
    auto_opt = runs["auto"][1]
    ns = ns_settings(auto_opt.param_groups[0])
    assert ns.dtype == torch.float32 and ns.method == "auto"
    assert [ns.method_for(96, 32), ns.method_for(32, 96), ns.method_for(32, 32)] == ["gram", "gram", "standard"]
    for a, b in zip(runs["auto"][0].parameters(), runs["explicit"][0].parameters()):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(runs["auto"][0].parameters(), runs["bf16"][0].parameters()))
    s = auto_opt.summary()
    assert "NS in auto -> float32, method auto -> gram where it saves FLOPs, else standard (auto on " \
           "cpu:AuthenticAMD:avx2)" in s.log_line()
    assert any("1.5-1.7 GFLOP/s" in n for n in s.notes)
    assert sorted(m.ns_method for m in s.matrices) == ["gram", "gram", "standard"]
    # explicit settings win and are shown as given; nothing about auto joins the agreement
    explicit = runs["bf16"][1]
    assert ns_settings(explicit.param_groups[0]).dtype == torch.bfloat16
    assert "NS in bfloat16, method standard" in explicit.summary().log_line()
    assert not [k for k in settings_of(explicit) if k.endswith(AUTO_SUFFIX)]
    resolved = {k: v for k, v in settings_of(auto_opt).items() if k.endswith(AUTO_SUFFIX)}
    assert resolved == {f"param_groups[0]['ns_dtype'] {AUTO_SUFFIX}": "float32",
                        f"param_groups[0]['ns_method'] {AUTO_SUFFIX}": "gram where it saves FLOPs"}


def test_fp32_gram_bits_do_not_depend_on_the_batch():
    """What auto's fp32 Gram rests on (sharded parity: a home batches other matrices than one process):
    each matrix's bits alone, in its whole stack and in two parts; generated shapes, wide and tall,
    where Gram saves FLOPs (seeded, 24 here; DS_MUON_FULL_SUITE=1: 120)."""
    import os
    import random

    from ds_muon.rules.newton_schulz import newton_schulz, use_gram

    rng, g = random.Random(41), torch.Generator().manual_seed(41)
    count = 120 if os.environ.get("DS_MUON_FULL_SUITE") == "1" else 24
    with dist_harness.one_thread():
        for _ in range(count):
            m = rng.choice((2, 3, 5, 8, 12, 16, 24, 32, 48, 64, 96, 128))
            n = m * rng.choice((2, 3, 4, 6))
            b = rng.randint(2, 5)
            shape = (b, m, n) if rng.random() < 0.5 else (b, n, m)
            assert use_gram(shape[1], shape[2], 5)
            G = torch.randn(shape, generator=g)
            ns = lambda x: newton_schulz(x, 5, "keller", torch.float32, method="gram")  # noqa: E731
            whole = ns(G)
            assert torch.equal(whole, torch.cat([ns(G[k:k + 1]) for k in range(b)])), shape
            assert torch.equal(whole, torch.cat([ns(G[:2]), ns(G[2:])])), shape


def test_auto_is_refused_where_no_dtype_is_meant():
    with pytest.raises(ValueError, match=r"ns_dtype='fast' is not a floating-point torch dtype .* or 'auto'"):
        ds_muon.Muon(ds_muon.muon_param_groups(_model()), ns_dtype="fast")
    with pytest.raises(ValueError, match="comm_dtype"):
        ds_muon.Muon(ds_muon.muon_param_groups(_model()), comm_dtype="auto")


def _run(rank, world, cpus, kw):
    """One step at W=2 on rank's mocked CPU: (error, resolved settings, parameters after)."""
    ns_auto.reset()
    real = ns_auto.read_cpuinfo
    ns_auto.read_cpuinfo = lambda: (cpus[rank][0], frozenset(cpus[rank][1]))
    try:
        m = _model()
        opt = ds_muon.Muon(ds_muon.muon_param_groups(m), **kw)
        try:
            _step(m, opt)
            err = None
        except ValueError as e:
            err = str(e)
        resolved = {k: v for k, v in settings_of(opt).items() if k.endswith(AUTO_SUFFIX)}
        return err, resolved, [p.detach().clone() for p in m.parameters()]
    finally:
        ns_auto.read_cpuinfo = real
        ns_auto.reset()


def _cluster_worker(rank, world):
    return {
        "same": _run(rank, world, [INTEL_AMX, INTEL_AMX], {}),
        "mixed": _run(rank, world, [INTEL_AMX, AMD_AVX2], {}),
        "mixed_explicit": _run(rank, world, [INTEL_AMX, AMD_AVX2], dict(ns_dtype="float32", ns_method="standard")),
    }


def test_auto_agrees_across_ranks_and_a_mixed_cluster_raises():
    results = dist_harness.run(_cluster_worker, 2, timeout=120)
    same = [r["same"] for r in results]
    assert same[0][0] is None and same[1][0] is None and same[0][1] == same[1][1]
    assert same[0][1][f"param_groups[0]['ns_dtype'] {AUTO_SUFFIX}"] == "bfloat16"
    for r in results:  # the same error on every rank, naming the setting and what to do
        err = r["mixed"][0]
        assert err is not None and f"param_groups[0]['ns_dtype'] {AUTO_SUFFIX} is 'bfloat16' on rank 0, " \
            "'float32' on rank 1" in err, err
        assert "ns_dtype='auto' chose differently on these ranks" in err and "pass an explicit ns_dtype" in err
        assert r["mixed_explicit"][0] is None  # explicit settings: nothing machine-dependent is compared
    # the explicit run is bitwise one process's
    m = _model()
    opt = ds_muon.Muon(ds_muon.muon_param_groups(m), ns_dtype="float32", ns_method="standard")
    with dist_harness.one_thread():
        _step(m, opt)
    for a, b in zip(m.parameters(), results[0]["mixed_explicit"][2]):
        assert torch.equal(a.detach(), b)


def _parity_worker(rank, world, dtypes):
    out = {}
    for dtype in dtypes:
        m = _model()
        opt = ds_muon.Muon(ds_muon.muon_param_groups(m), ns_dtype=dtype)
        _step(m, opt)
        _step(m, opt, seed=2)
        out[dtype] = [p.detach().clone() for p in m.parameters()]
    return out


def test_sharded_bitwise_one_process_for_every_explicit_dtype_and_auto():
    """W=2 plain replicas (every matrix one home) against one process, two steps each: bf16, fp16, fp32
    explicit (their own parity, unchanged) and auto (here: FAST_NS_DTYPE)."""
    dtypes = ["bfloat16", "float16", "float32", "auto"]
    results = dist_harness.run(_parity_worker, 2, dtypes, timeout=120)
    assert ns_auto.resolve_dtype("auto", "cpu") == FAST_NS_DTYPE
    for dtype in dtypes:
        m = _model()
        opt = ds_muon.Muon(ds_muon.muon_param_groups(m), ns_dtype=dtype)
        with dist_harness.one_thread():
            _step(m, opt)
            _step(m, opt, seed=2)
        for r in results:
            for a, b in zip(m.parameters(), r[dtype]):
                assert torch.equal(a.detach(), b), dtype
