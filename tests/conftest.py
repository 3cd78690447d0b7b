import os
import sys

# the workers spawned by dist_harness import test modules by name
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# What importing a library writes into the environment, written up front: the test that first imports it leaks
# nothing (``_leaves_global_state_as_found``).  DeepSpeed's ``__init__`` sets this one.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import pytest  # noqa: E402

from ds_muon.rules.ns_auto import fast_dtype  # noqa: E402

# The NS dtype ns_dtype="auto" picks on this machine (bf16 where the CPU multiplies it natively, else fp32):
# tests that check no dtype behaviour run at it (bf16 on an AVX2-only CPU is ~35x slower than fp32); the
# bf16, fp16 and fp32 paths keep their own parity tests, explicit.
FAST_NS_DTYPE = fast_dtype("cpu")

# Runs that repeat what a kept sample already shows, opt-in so the suite fits a 2-core CI machine (~15 min):
# DS_MUON_FULL_SUITE=1 runs them too.  Each line says which test keeps the sample.
FULL_SUITE_ONLY = {
    "tests/test_mesh3d.py::test_w8_3d_meshes_hsdp_x_tp_and_pipeline_stages_on_2d_sub_meshes":
        "8 processes on 2 cores; the W=4 3-D cases of test_mesh3d stay",
    "tests/test_ddp_homes.py::test_ddp_duplicate_homes_bitwise[bf16]": "the fp32 case stays (same homes)",
    "tests/test_decay_modes.py::test_stack_bitwise_equals_one_process[ddp]":
        "test_fuzz draws all four decay modes on DDP; fsdp2, zero2, zero3+offload stay here",
    "tests/test_decay_modes.py::test_stack_bitwise_equals_one_process[fsdp1]":
        "test_fuzz draws all four decay modes on FSDP1; fsdp2, zero2, zero3+offload stay here",
    "tests/test_deepspeed.py::test_fp32_bitwise_with_single_process[1-bfloat16]":
        "stages 0 and 3 stay; ZeRO-1/2 parity is also test_direct_optimizer_is_bitwise and test_fuzz",
    "tests/test_deepspeed.py::test_fp32_bitwise_with_single_process[2-float32]":
        "stages 0 and 3 stay; ZeRO-1/2 parity is also test_direct_optimizer_is_bitwise and test_fuzz",
}


def pytest_collection_modifyitems(config, items):
    if os.environ.get("DS_MUON_FULL_SUITE") == "1":
        return
    for item in items:
        why = FULL_SUITE_ONLY.get(item.nodeid)
        if why:
            item.add_marker(pytest.mark.skip(reason=f"opt-in, DS_MUON_FULL_SUITE=1 ({why})"))


@pytest.fixture(autouse=True, scope="session")
def _stress_load():
    """The stress mode's busy processes beside the whole session (tests/stress.py; none unless asked)."""
    import stress

    with stress.load():
        yield


@pytest.fixture(autouse=True)
def _leaves_global_state_as_found(request):
    """Fail a test that leaves process-wide state (threads, dtypes, numerics switches, ds_muon's pins, the
    environment: ``global_state``) changed for the next test in this process: such a leak changes the bits
    of whichever test runs next, so it fails here, where it is made."""
    import global_state
    import torch.distributed as dist

    before = global_state.snapshot()
    yield
    after = global_state.snapshot()
    leaked = global_state.changes(before, after)
    if dist.is_available() and dist.is_initialized():
        leaked += "\n  a process group is still initialised in the test process"
    if leaked:
        pytest.fail(f"{request.node.nodeid} left process-wide state changed for the next test:\n{leaked}",
                    pytrace=False)
