"""`make test` runs on two pytest workers with the multi-process tests grouped on one
(tests/conftest.py). pytest-xdist drops a group it cannot read without a word (it did under
pytest 9), and the clusters then run at once and fail as lost hosts: check the groups land.
`make test-full` shares the attention peer suite's whole matrix between both workers (one group
a case), or one core ran it while the other idled. The compile check of every kernel is in that
tier too; `make test` compiles the representative subset."""

import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

MATRIX = "tests/kernels/test_attention_peer.py::test_kernel_error_within_flash_attention_bar_full_matrix"
CASES = [f"{MATRIX}[{kernel}-S1-D64-float32-p0.0]" for kernel in ("triton", "triton_grouped", "triton_window")]
COMPILE = "tests/kernels/test_kernels_compile.py"


@pytest.fixture(scope="module")
def ran():
    """(worker, test, group) of each test of one run under `make test-full`'s options."""
    argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"]
    argv += ["-m", "full_matrix or not full_matrix", "tests/launch/test_nic_selection.py"]
    argv += ["tests/data/rebalance/test_plan.py", *CASES]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    ran = re.findall(r"^\[(gw\d)\] \[ *\d+%\] PASSED (.+?)@(.+?) *$", proc.stdout, re.M)
    assert len(ran) > 20, proc.stdout[-3000:]
    return ran


def test_the_multi_process_tests_run_on_one_worker_under_make_tests_options(ran):
    nic = [(worker, group) for worker, test, group in ran if test.startswith("tests/launch/test_nic_selection.py")]
    assert nic and all(group == "processes" for _, group in nic), ran
    assert len({worker for worker, _ in nic}) == 1, ran  # one worker ran every one of them
    modules = {group for _, test, group in ran if "rebalance/test_plan" in test}
    assert modules == {"tests/data/rebalance/test_plan.py"}  # the in-process tests go a module at a time


def test_each_case_of_the_whole_matrix_is_a_group_of_its_own(ran):
    matrix = [(test, group) for _, test, group in ran if test.startswith(MATRIX)]
    assert sorted(test for test, _ in matrix) == sorted(CASES), ran
    assert all(test == group for test, group in matrix), ran


def _collected(*options) -> set[str]:
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *options, COMPILE]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return {line.split("::")[-1] for line in proc.stdout.splitlines() if line.startswith(COMPILE + "::")}


def test_make_test_compiles_the_representative_subset_and_make_test_full_every_kernel():
    subset, every = (
        "test_representative_kernels_compile_for_hopper_without_spills",
        "test_every_kernel_compiles_for_hopper_without_spills",
    )
    make_test = _collected()  # `make test` names no marker
    assert subset in make_test and every not in make_test, make_test
    assert {subset, every} <= _collected("-m", "full_matrix or not full_matrix"), "make test-full's selection"
