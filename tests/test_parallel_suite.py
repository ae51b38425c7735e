"""`make test` runs on two pytest workers with the multi-process tests grouped on one
(tests/conftest.py). pytest-xdist drops a group it cannot read without a word (it did under
pytest 9), and the clusters then run at once and fail as lost hosts: check the groups land."""

import re
import subprocess
import sys

from tests.helpers import REPO


def test_the_multi_process_tests_run_on_one_worker_under_make_tests_options():
    argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"]
    argv += ["tests/launch/test_nic_selection.py", "tests/data/test_rebalance_plan.py"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    ran = re.findall(r"^\[(gw\d)\] \[ *\d+%\] PASSED (.+?) *$", proc.stdout, re.M)
    assert len(ran) > 20, proc.stdout[-3000:]
    grouped = {worker for worker, test in ran if test.startswith("tests/launch/test_nic_selection.py")}
    assert all(test.endswith("@processes") for _, test in ran if "test_nic_selection" in test), proc.stdout[-3000:]
    assert len(grouped) == 1, proc.stdout[-3000:]  # one worker ran every one of them
    modules = {test.split("@")[-1] for _, test in ran if "test_rebalance_plan" in test}
    assert modules == {"tests/data/test_rebalance_plan.py"}  # the in-process tests go a module at a time


def test_the_whole_matrix_is_shared_by_both_workers_under_make_test_full():
    # A module's tests go to one worker; the peer suite's whole matrix is the exception (one
    # group a case), or `make test-full` ran it on one core.
    argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"]
    argv += ["-m", "full_matrix", "-k", "triton and S1-D64-float32-p0.0 and not w2"]
    argv += ["tests/kernels/test_attention_peer.py"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    ran = re.findall(r"^\[(gw\d)\] \[ *\d+%\] PASSED (.+?)@(.+?) *$", proc.stdout, re.M)
    assert len(ran) >= 4, proc.stdout[-3000:]
    assert all(test == group for _, test, group in ran), proc.stdout[-3000:]  # a group of its own
    assert {worker for worker, _, _ in ran} == {"gw0", "gw1"}, proc.stdout[-3000:]
