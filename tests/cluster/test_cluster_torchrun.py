"""torchrun across 2 hosts x 2 ranks (network namespaces): the static rendezvous of
launch/run_torchrun.sh and an elastic c10d one train exactly what 1 rank trains."""

from __future__ import annotations

import json

import pytest

from tests.cluster.common import torchrun_on
from tests.faults.common import losses

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.timeout(240)
def test_static_rendezvous_two_hosts_match_one_rank(host_jobs, cluster_dataset, reference, tmp_path):
    out = tmp_path / "out"
    jobs = [torchrun_on(host_jobs, h, "2", out, cluster_dataset, NODE_RANK=h) for h in (0, 1)]
    for h, job in enumerate(jobs):
        assert job.wait(180, f"torchrun on host {h}") == 0, job.output()[-3000:]
    assert losses(out) == pytest.approx(reference, rel=1e-5)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["steps"] == len(reference)
