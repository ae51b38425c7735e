"""Suite-wide settings, applied before any test module imports Triton.

Triton fixes interpreter-or-compiled mode when it is first imported, so the choice has to be
made here, not in the kernel test modules (a test that imports torch.compile's inductor could
otherwise import Triton first, compiled). On CPU-only machines the Triton kernels run in the
interpreter; bench/gpu_check.sh sets TRITON_INTERPRET=0 to test the compiled kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests that build hosts out of network namespaces use fixed namespace names and subnets
# (tests/cluster/common.py, test_nic_selection.py): under pytest-xdist (`pytest -n N --dist
# loadgroup`; bench/gpu_check.sh runs its test stages so) they all go to one worker, so two
# clusters never exist at once.
NETNS_TESTS = ("tests/cluster/", "tests/launch/test_nic_selection.py")


def pytest_collection_modifyitems(config, items):
    import pytest

    root = str(config.rootpath) + "/"
    for item in items:
        path = str(item.path).removeprefix(root)
        if path.startswith(NETNS_TESTS):
            item.add_marker(pytest.mark.xdist_group("netns"))
