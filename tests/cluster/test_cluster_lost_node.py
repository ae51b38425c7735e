"""A host lost in the middle of a 2 x 2 torchrun job: cut off, the other host's ranks stop
within dist.timeout_s naming the missing ranks and their host; killed, an elastic job either
waits for it to come back or carries on without it, from the last checkpoint, with the losses
of an uninterrupted run."""

from __future__ import annotations

import re
import time

import pytest

from tests.cluster.common import torchrun_on
from tests.faults.common import WORKER, losses, metrics, summary, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# Fast failure detection for the test (defaults: 30 s, 5 s x 3).
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"
FAULTS = {"TRAIN_SCRIPT": WORKER, "FAULT_STEP_DELAY_S": 0.3}  # a window to lose the host in
# A machine that loses power closes no connection: its peers learn of it from the collective
# timeout. Killed processes in a namespace do close theirs, so this bounds the wait only when the
# close is missed (a collective waiting on a live rank that waits on the dead one).
ELASTIC_TIMEOUT = "dist.timeout_s=30"


def checkpointed(out, step):
    return lambda: (out / "checkpoints" / f"step_{step:08d}.pt").exists()


@pytest.mark.timeout(200)
def test_a_cut_off_host_is_named_within_the_timeout(host_jobs, cluster_dataset, tmp_path):
    out, timeout_s = tmp_path / "out", 6
    jobs = [
        torchrun_on(
            host_jobs,
            h,
            "2",
            out,
            cluster_dataset,
            "train.max_steps=100000",
            f"dist.timeout_s={timeout_s}",
            NODE_RANK=h,
        )
        for h in (0, 1)
    ]
    wait_for(lambda: any(r.get("step", 0) >= 2 for r in metrics(out)), 150, jobs, "step 2")
    host_jobs.cluster.set_link(1, False)
    start = time.monotonic()
    rc = jobs[0].wait(timeout_s + 40, "host 0 after host 1 was cut off")
    elapsed = time.monotonic() - start
    log = jobs[0].output()
    assert rc != 0
    lines = [x for x in log.splitlines() if x.startswith("error: rank 0:")]
    assert len(lines) == 1, log[-3000:]
    assert re.match(
        rf"error: rank 0: the [\w\- ()]+ at step \d+ failed after [\d.]+ s \(dist.timeout_s={timeout_s}\): "
        r"no report from ranks 2, 3 on host bct-node1 \(unreachable, killed, stopped or hung\)",
        lines[0],
    ), lines[0]
    assert timeout_s - 1 <= elapsed <= timeout_s + 30, (elapsed, lines[0])


@pytest.mark.full_matrix  # make test-full: 30 s on a slow machine; the shrinking job above covers the restart
@pytest.mark.timeout(300)
def test_elastic_job_waits_for_the_host_to_come_back(host_jobs, cluster_dataset, reference, tmp_path):
    out = tmp_path / "out"

    def start(host):
        return torchrun_on(
            host_jobs, host, "2:2", out, cluster_dataset, ELASTIC_TIMEOUT, MAX_RESTARTS=1, RDZV_CONF=RDZV_CONF, **FAULTS
        )

    first = start(0), start(1)
    wait_for(checkpointed(out, 3), 150, list(first), "the checkpoint of step 3")
    host_jobs.cluster.kill_host(1)
    assert max(r["step"] for r in metrics(out) if "loss" in r) < len(reference), "finished before the kill"
    back = start(1)
    for job, what in ((first[0], "host 0"), (back, "host 1, back")):
        assert job.wait(200, what) == 0, job.output()[-3000:]
    resumed = re.findall(r"resumed from step (\d+)", first[0].output())
    assert resumed and int(resumed[-1]) in (3, 6), first[0].output()[-3000:]
    assert losses(out) == pytest.approx(reference, rel=1e-5)  # every step, the restarted ones too
    assert summary(out)["world_size"] == 4


@pytest.mark.timeout(300)
def test_elastic_job_shrinks_to_the_surviving_host(host_jobs, cluster_dataset, reference, tmp_path):
    out = tmp_path / "out"
    jobs = [
        torchrun_on(
            host_jobs, h, "1:2", out, cluster_dataset, ELASTIC_TIMEOUT, MAX_RESTARTS=1, RDZV_CONF=RDZV_CONF, **FAULTS
        )
        for h in (0, 1)
    ]
    wait_for(checkpointed(out, 3), 150, jobs, "the checkpoint of step 3")
    first_summary = [r for r in metrics(out) if "loss" in r]
    host_jobs.cluster.kill_host(1)
    assert max(r["step"] for r in first_summary) < len(reference), "finished before the kill"
    assert jobs[0].wait(200, "host 0 alone") == 0, jobs[0].output()[-3000:]
    log = jobs[0].output()
    resumed = re.findall(r"resumed from step (\d+)", log)
    assert resumed and int(resumed[-1]) in (3, 6), log[-3000:]
    assert re.findall(r"ranks: (\d+)", log) == ["4", "2"], log[-3000:]
    assert losses(out) == pytest.approx(reference, rel=1e-5)
    assert summary(out)["world_size"] == 2
