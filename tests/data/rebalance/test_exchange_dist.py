"""The exchange of data.rebalance across real processes: 2 and 4 gloo ranks, torchrun and mpirun.

Each launch runs tests/data/rebalance/rebalance_worker.py, which checks on every rank that
the output equals the single-process plan, that all outputs together are exactly the inputs,
that ``none`` is the identity, that start()/wait() overlaps, and that bad input on one rank
raises a RebalanceError naming that rank on every rank (and a missing rank a timeout).
"""

import re
import sys

import pytest

from tests.helpers import REPO, launcher, run_launched

WORKER = REPO / "tests" / "data" / "rebalance" / "rebalance_worker.py"
TIMEOUT_S = 90


def run(cmd, nranks):
    out = run_launched(cmd, TIMEOUT_S)
    for r in range(nranks):
        assert f"REBALANCE-OK rank {r}" in out, out[-4000:]
    # Ranks share one stdout, so another rank's line can land in the middle of this one.
    hidden = re.findall(r"HIDDEN \{[^}]*\}", out)
    assert hidden, out[-4000:]
    print(hidden[0])  # the measured overlap, shown with pytest -s
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("nranks", [2, 4])
def test_exchange_under_torchrun(nranks):
    # The 2-rank run also checks that a rank that never calls the exchange times out the others.
    extra = ["--timeout"] if nranks == 2 else []
    run([launcher("torchrun"), "--standalone", "--nproc-per-node", str(nranks), str(WORKER)] + extra, nranks)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_exchange_under_mpirun():
    mpirun = launcher("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun in the virtualenv or on PATH")
    run(
        [
            mpirun,
            "-np",
            "2",
            "--oversubscribe",
            "--allow-run-as-root",
            "-x",
            "PYTHONPATH",
            "-x",
            "OMP_NUM_THREADS",
            sys.executable,
            str(WORKER),
        ],
        2,
    )
