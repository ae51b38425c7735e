"""The exchange of data.rebalance across real processes: 2 and 4 gloo ranks, torchrun and mpirun.

Each launch runs tests/dist_scripts/rebalance_worker.py, which checks on every rank that
the output equals the single-process plan, that all outputs together are exactly the inputs,
that ``none`` is the identity, that start()/wait() overlaps, and that bad input on one rank
raises a RebalanceError naming that rank on every rank (and a missing rank a timeout).
"""

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "dist_scripts" / "rebalance_worker.py"
TIMEOUT_S = 90
LAUNCH_VARS = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|MASTER_ADDR|MASTER_PORT|OMPI_.*|PMI_.*|PMIX_.*|SLURM_.*)$")


def run(cmd, nranks):
    env = {k: v for k, v in os.environ.items() if not LAUNCH_VARS.match(k)}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[0]} did not finish in {TIMEOUT_S} s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-4000:]}"
    for r in range(nranks):
        assert f"REBALANCE-OK rank {r}" in out, out[-4000:]
    # Ranks share one stdout, so another rank's line can land in the middle of this one.
    hidden = re.findall(r"HIDDEN \{[^}]*\}", out)
    assert hidden, out[-4000:]
    print(hidden[0])  # the measured overlap, shown with pytest -s
    return out


def bin_of(name):
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else shutil.which(name)


@pytest.mark.slow
@pytest.mark.parametrize("nranks", [2, 4])
def test_exchange_under_torchrun(nranks):
    # The 2-rank run also checks that a rank that never calls the exchange times out the others.
    extra = ["--timeout"] if nranks == 2 else []
    run([bin_of("torchrun"), "--standalone", "--nproc-per-node", str(nranks), str(WORKER)] + extra, nranks)


@pytest.mark.slow
def test_exchange_under_mpirun():
    mpirun = bin_of("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun in the virtualenv or on PATH")
    run([mpirun, "-np", "2", "--oversubscribe", "--allow-run-as-root", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
         sys.executable, str(WORKER)], 2)
