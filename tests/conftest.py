"""Suite-wide settings, applied before any test module imports Triton.

Triton fixes interpreter-or-compiled mode when it is first imported, so the choice has to be
made here, not in the kernel test modules (a test that imports torch.compile's inductor could
otherwise import Triton first, compiled). On CPU-only machines the Triton kernels run in the
interpreter; bench/gpu_check.sh sets TRITON_INTERPRET=0 to test the compiled kernels.
"""

import os
import platform

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

# train.fp8's GEMM on the CPU, torch._scaled_mm, goes to oneDNN, whose FP8 matmul takes over a second
# for a 320 x 128 x 512 product on a Xeon with AMX unless ATEN_CPU_CAPABILITY is set (to any level;
# then about a millisecond in fp32; torch 2.13, docs/fp8.md): the FP8 tests ran past their timeouts
# there. The variable is read at torch's first operation, so setting it here serves every test and
# every rank they launch (tests/helpers.py's clean_env passes it on). AVX2: every x86-64 CPU this
# suite runs on has it. (Under bf16 autocast even that is not enough: test_fp8.py switches oneDNN off.)
if platform.machine() in ("x86_64", "AMD64"):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")


# `make test` runs the suite on two pytest workers (`pytest -n 2 --dist loadgroup`, pytest-xdist).
# The tests that start several processes at once (ranks, hosts: markers `multiprocess` and
# `cluster`) all go to one worker, which runs them one after another while the other worker runs
# the in-process tests: two of them at once would put 8 ranks on 2 cores and miss their timeouts,
# and the namespace clusters use fixed names and subnets (tests/cluster/common.py,
# test_nic_selection.py), so two clusters must never exist at once. The group has the most tests,
# so xdist hands it out first and the longest chain starts at once. Every other test goes to a
# worker with the rest of its module, so a module's fixtures are built once, except the tests of
# `make test-full`'s tier (marker `full_matrix`: the attention peer suite's whole matrix, the
# compile check of every kernel): each is a group of its own, so both workers share them (the
# matrix as one module kept one core busy for over an hour while the other idled).
PROCESS_TESTS = ("tests/cluster/", "tests/launch/test_nic_selection.py")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    # The full_matrix tier (the peer suite's whole matrix, the sm_90 compile check of every kernel, two
    # slow cluster cases) runs only when -m names it: make test-full.
    if "full_matrix" not in (config.getoption("markexpr") or ""):
        deselected = [item for item in items if item.get_closest_marker("full_matrix")]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if not item.get_closest_marker("full_matrix")]
    root = str(config.rootpath) + "/"
    for item in items:
        path = str(item.path).removeprefix(root)
        several = item.get_closest_marker("multiprocess") or item.get_closest_marker("cluster")
        if several or path.startswith(PROCESS_TESTS):
            group = "processes"
        elif item.get_closest_marker("full_matrix"):
            group = item.nodeid
        else:
            group = path
        item.add_marker(pytest.mark.xdist_group(group))
