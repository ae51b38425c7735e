"""A real Slurm (Debian's slurm-wlm and munge) on 2 hosts: launch/slurm.sub submitted with
sbatch (no container) and run_and_time.sh started with srun directly."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from tests.cluster.common import CONFIG, LAUNCH, SLURM_TOOLS, SlurmCluster, train_args
from tests.faults.common import Job, losses, run_in_process
from tests.helpers import compliance_check

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def slurm(cluster, tmp_path_factory):
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"Slurm tests: needs {', '.join(missing)} (apt-get install slurm-wlm munge)")
    s = SlurmCluster(cluster, str(tmp_path_factory.mktemp("slurm")))
    try:
        s.start()
        yield s
    finally:
        s.stop()


def on_host0(slurm, argv, log, timeout, **env) -> Job:
    job = Job(slurm.cluster.command(0, argv), log, slurm.env(CLEAR_CACHES=0, SOCKET_IFNAME="cl0", **env))
    rc = job.wait(timeout, argv[0])
    assert rc == 0, job.output()[-4000:]
    return job


def check_compliance(path) -> None:
    status, _, output = compliance_check(path)
    assert status == 0, output[-4000:]


def seed_of(path) -> int:
    with open(path) as f:
        return int(re.search(r'"key": "seed", "value": (\d+)', f.read()).group(1))


@pytest.mark.timeout(300)
def test_sbatch_slurm_sub_two_runs_on_two_nodes(slurm, cluster_dataset, tmp_path):
    logdir = tmp_path / "results"
    on_host0(
        slurm,
        [
            "sbatch",
            "--wait",
            "--nodes=2",
            "--ntasks-per-node=2",
            f"--output={tmp_path}/job.out",
            os.path.join(LAUNCH, "slurm.sub"),
            # No fixed seed: each run draws its own (slurm.sub without SEED), as MLPerf wants.
            *train_args(cluster_dataset, "train.max_steps=4", "train.seed=null"),
        ],
        str(tmp_path / "sbatch.log"),
        240,
        CONFIG=CONFIG,
        LOGDIR=logdir,
        NEXP=2,
    )
    out = (tmp_path / "job.out").read_text()
    results = [logdir / f"result_{i}.txt" for i in range(2)]
    assert all(r.exists() for r in results), out[-4000:]
    for r in results:
        check_compliance(r)
    assert seed_of(results[0]) != seed_of(results[1])
    assert re.findall(r"ranks: (\d+)", out) == ["4", "4"], out[-3000:]


@pytest.mark.timeout(240)
def test_srun_two_nodes_match_one_rank(slurm, cluster_dataset, reference, tmp_path):
    on_host0(
        slurm,
        [
            "srun",
            "--nodes=2",
            "--ntasks-per-node=2",
            "--kill-on-bad-exit=1",
            os.path.join(LAUNCH, "run_and_time.sh"),
            *train_args(cluster_dataset),
        ],
        str(tmp_path / "srun.log"),
        180,
        CONFIG=CONFIG,
        OUTPUT_DIR=tmp_path,
        RUN_INDEX=0,
        GLOO_SOCKET_IFNAME="cl0",
    )
    assert losses(tmp_path / "run_0") == pytest.approx(reference, rel=1e-5)
    check_compliance(tmp_path / "result_0.txt")


@pytest.mark.full_matrix  # make test-full: the fault-tolerant branch of slurm.sub
@pytest.mark.timeout(240)
def test_sbatch_slurm_sub_with_ft_replicas_starts_a_replica_on_each_node(slurm, cluster_dataset, tmp_path):
    pytest.importorskip("torchft", reason="FT_REPLICAS needs torchft (pip install -e '.[ft]')")
    from tests.faults.test_replica_faults import FT, STEPS, check_losses, losses_by_step

    uninterrupted = tmp_path / "uninterrupted"
    run_in_process(cluster_dataset, uninterrupted, *STEPS)
    logdir = tmp_path / "results"
    on_host0(
        slurm,
        ["sbatch", "--wait", "--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/job.out"]
        + [os.path.join(LAUNCH, "slurm.sub"), *train_args(cluster_dataset, *STEPS, *FT[1:])],
        str(tmp_path / "sbatch.log"),
        200,
        CONFIG=CONFIG,
        LOGDIR=logdir,
        FT_REPLICAS=1,
        FT_JOIN_TIMEOUT_MS=2000,
        TORCHFT_TIMEOUT_SEC=5,
    )
    out = (tmp_path / "job.out").read_text()
    assert out.count("recovered from a peer") <= 1 and "Traceback" not in out, out[-3000:]
    for replica in (0, 1):  # node k's replica is k
        check_losses(logdir / "run_0", replica, losses_by_step(uninterrupted))
        assert max(losses_by_step(logdir / "run_0" / f"replica_{replica}")) == 14
