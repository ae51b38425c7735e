"""One cluster of 2 hosts (network namespaces, tests/cluster/netns_cluster.py) shared by every test in
tests/cluster, the tiny training set on the shared filesystem, and the 1-rank reference losses
that every multi-host run must reproduce.

The cluster is torn down at the end of the session, at interpreter exit if the session is
interrupted, and anything left by an earlier, killed session (same name prefix) is swept
away when it is built. Each test's processes are killed when the test ends (``host_jobs``).
"""

from __future__ import annotations

import atexit
import signal

import pytest
import torch

from tests.batches import write_dataset
from tests.cluster.common import NAME, STEPS, SUBNET, HostJobs
from tests.cluster.netns_cluster import Cluster, missing_requirements
from tests.faults.common import losses, run_in_process


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def cluster():
    reason = missing_requirements()
    if reason:
        pytest.skip(f"cluster tests: {reason}")
    c = Cluster(hosts=2, name=NAME, subnet=SUBNET)
    atexit.register(c.down)  # a session ended by an exception or a signal pytest turns into one
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    c.up()
    try:
        yield c
    finally:
        c.down()
        signal.signal(signal.SIGTERM, previous)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture
def host_jobs(cluster, tmp_path):
    jobs = HostJobs(cluster, tmp_path)
    try:
        yield jobs
    finally:
        jobs.cleanup()


@pytest.fixture(scope="session")
def cluster_dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("cluster-data")))


@pytest.fixture(scope="session")
def reference(cluster, cluster_dataset, tmp_path_factory):
    """Per-step losses of 1 rank (fp32, dropout off): what 2 hosts x 2 ranks must reproduce."""
    out = tmp_path_factory.mktemp("cluster-reference")
    run_in_process(cluster_dataset, out, *STEPS)
    return losses(out)
