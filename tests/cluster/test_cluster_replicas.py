"""dist.fault_tolerance=torchft across two hosts: a replica on each (the Lighthouse on host 0), then
host 1's cable pulled. Host 0's replica goes on alone from the step that failed, with the losses of
the uninterrupted run (1e-5 relative); the cut-off replica, which can reach neither its peer nor the
Lighthouse, ends with one line naming the Lighthouse."""

from __future__ import annotations

import time

import pytest

from tests.cluster.common import HostJobs
from tests.faults.common import PYTHON, WORKER, run_args, run_in_process, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
pytest.importorskip("torchft", reason="dist.fault_tolerance=torchft needs torchft (pip install -e '.[ft]')")

# The CPU replica tests' run (tests/faults/test_replica_faults.py), imported after the skip above.
from tests.faults.test_replica_faults import (  # noqa: E402
    DELAY_S,
    FT,
    STEPS,
    check_losses,
    lighthouse_args,
    losses_by_step,
    trained,
)

PORT = 29510


def start_replica(host_jobs: HostJobs, host: int, out, dataset, address: str, marks):
    env = dict(
        REPLICA_GROUP_ID=host,
        TORCHFT_LIGHTHOUSE=address,
        TORCHFT_TIMEOUT_SEC=3,
        GLOO_SOCKET_IFNAME="cl0",  # the store the quorum meets in listens on the cluster's NIC
        FAULT_MARK_DIR=marks,
        FAULT_STEP_DELAY_S=DELAY_S,
    )
    args = [PYTHON, WORKER, "--output-dir", str(out), *run_args(dataset, *STEPS, *FT)]
    return host_jobs.start(host, args, f"replica{host}.log", **env)


@pytest.mark.timeout(240)
def test_a_cut_off_host_costs_its_replica_and_the_other_goes_on(host_jobs, cluster_dataset, tmp_path):
    uninterrupted = tmp_path / "uninterrupted"
    run_in_process(cluster_dataset, uninterrupted, *STEPS)
    out, marks = tmp_path / "out", tmp_path / "marks"
    marks.mkdir()
    c = host_jobs.cluster
    host_jobs.start(0, lighthouse_args(PORT), "lighthouse.log")
    address = f"http://{c.address(0)}:{PORT}"
    jobs = [start_replica(host_jobs, h, out, cluster_dataset, address, marks) for h in (0, 1)]
    wait_for(lambda: all(trained(out, h) >= 3 for h in (0, 1)), 150, jobs, "both replicas at step 3")
    c.set_link(1, False)
    at, start = trained(out, 0), time.monotonic()
    wait_for(lambda: trained(out, 0) > at + 1, 60, jobs[:1], "host 0's replica going on alone")
    held = time.monotonic() - start
    # TORCHFT_TIMEOUT_SEC=3 fails the step; the Lighthouse drops the silent replica 2 s after its last heartbeat.
    assert held < 3 + 2 + 8, f"the cut-off replica held the run for {held:.1f} s"
    assert jobs[0].wait(120, "host 0's replica") == 0, jobs[0].output()[-3000:]
    assert "Traceback" not in jobs[0].output()
    check_losses(out, 0, losses_by_step(uninterrupted))
    assert max(losses_by_step(out / "replica_0")) == 14
    # The cut-off side: one line, naming the Lighthouse it lost (dist.timeout_s=8 bounds its wait).
    rc = jobs[1].wait(60, "host 1's replica after its cable was pulled")
    log = jobs[1].output()
    errors = [line for line in log.splitlines() if line.startswith("error")]
    assert rc != 0 and len(errors) == 1 and address in errors[0], log[-3000:]
    assert "Traceback" not in log, log[-3000:]
