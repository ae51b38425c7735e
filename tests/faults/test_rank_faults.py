"""Ranks that die or hang: torchrun restarts and resumes, mpirun and a hung peer end with a
message naming the collective and the rank, never a hang. Two CPU ranks (gloo)."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.faults.common import (
    PYTHON,
    REFERENCE_STEPS,
    WORKER,
    Job,
    clean_env,
    losses,
    metrics,
    read_pid,
    run_args,
    run_in_process,
    spawn_ranks,
    summary,
    wait_for,
)
from tests.helpers import launcher

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

STEPS = [*REFERENCE_STEPS, "data.rebalance=balanced"]
DELAY_S = 0.4  # per step: the window in which a rank is killed


def checkpoint_exists(out, step: int):
    return lambda: os.path.exists(os.path.join(out, "checkpoints", f"step_{step:08d}.pt"))


@pytest.mark.timeout(240)
def test_torchrun_restarts_a_killed_rank_and_resumes(dataset, reference, tmp_path):
    out, marks = tmp_path / "out", tmp_path / "marks"
    marks.mkdir()
    job = Job(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--monitor-interval",
            "0.2",
            WORKER,
            "--output-dir",
            str(out),
            *run_args(dataset, *STEPS),
        ],
        str(tmp_path / "torchrun.log"),
        # torchrun's shared rendezvous store keeps the first generation's keys, so restarted
        # ranks connect to the dead ones' addresses (pytorch/pytorch#135712); see the README.
        clean_env(FAULT_MARK_DIR=marks, FAULT_STEP_DELAY_S=DELAY_S, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1),
    )
    wait_for(checkpoint_exists(out, 4), 150, [job], "the checkpoint of step 4")
    victim = read_pid(marks, 1)
    os.kill(victim, signal.SIGKILL)
    killed_at = max([r["step"] for r in metrics(out) if "loss" in r], default=0)
    assert killed_at < 12, "the run ended before the kill: raise DELAY_S"
    rc = job.wait(180, "torchrun")
    log = job.output()
    assert rc == 0, log[-4000:]
    assert read_pid(marks, 1) != victim  # a new generation of workers ran
    resumed = re.findall(r"resumed from step (\d+)", log)
    assert resumed and int(resumed[-1]) in (4, 8), log[-4000:]
    got = losses(out)
    assert len(got) == 12
    assert got == pytest.approx(reference, rel=1e-5)  # the final loss, and every one before it
    s = summary(out)
    assert s["steps"] == 12 and s["samples"] == 96 and s["world_size"] == 2


@pytest.mark.timeout(180)
def test_mpirun_survivor_exits_with_a_message_when_a_rank_is_killed(dataset, tmp_path):
    out, marks = tmp_path / "out", tmp_path / "marks"
    marks.mkdir()
    mpirun = launcher("mpirun")
    # --enable-recovery (as launch/run_mpirun.sh passes it): mpirun lets the survivor report
    # and exit by itself instead of killing it the moment a rank dies, which raced the report.
    args = [
        mpirun,
        "-np",
        "2",
        "--oversubscribe",
        "--enable-recovery",
        *(["--allow-run-as-root"] if os.geteuid() == 0 else []),
    ]
    env = clean_env(FAULT_MARK_DIR=marks, FAULT_STEP_DELAY_S=DELAY_S)
    for var in ("PYTHONPATH", "OMP_NUM_THREADS", "FAULT_MARK_DIR", "FAULT_STEP_DELAY_S", "PYTHONUNBUFFERED"):
        args += ["-x", var]
    job = Job(
        [
            *args,
            PYTHON,
            WORKER,
            "--output-dir",
            str(out),
            *run_args(dataset, "train.max_steps=1000", "dist.timeout_s=60"),
        ],
        str(tmp_path / "mpirun.log"),
        env,
    )
    wait_for(lambda: any(r.get("step", 0) >= 2 for r in metrics(out)), 120, [job], "step 2")
    os.kill(read_pid(marks, 1), signal.SIGKILL)
    start = time.monotonic()
    rc = job.wait(60, "mpirun after the kill")
    log = job.output()
    assert rc != 0
    assert time.monotonic() - start < 30, log[-3000:]  # far below dist.timeout_s: the closed connection is seen
    assert re.search(r"error: rank 0: the [\w\- ()]+ at step \d+ failed .*no report from rank 1", log), log[-3000:]
    assert "Traceback" not in log


@pytest.mark.timeout(180)
def test_a_stopped_peer_makes_the_others_fail_within_the_timeout(dataset, tmp_path):
    out, marks = tmp_path / "out", tmp_path / "marks"
    marks.mkdir()
    timeout_s = 8
    jobs = spawn_ranks(
        2,
        out,
        dataset,
        "train.max_steps=1000",
        f"dist.timeout_s={timeout_s}",
        log_dir=str(tmp_path),
        FAULT_MARK_DIR=marks,
        FAULT_STEP_DELAY_S=0.2,
    )
    try:
        wait_for(lambda: any(r.get("step", 0) >= 2 for r in metrics(out)), 120, jobs, "step 2")
        os.kill(read_pid(marks, 1), signal.SIGSTOP)
        start = time.monotonic()
        rc = jobs[0].wait(timeout_s + 30, "rank 0 after rank 1 stopped")
        elapsed = time.monotonic() - start
        log = jobs[0].output()
        assert rc == 1, log[-3000:]
        line = [x for x in log.splitlines() if x.startswith("error:")]
        assert len(line) == 1, log[-3000:]
        assert re.match(
            rf"error: rank 0: the [\w\- ()]+ at step \d+ failed after [\d.]+ s "
            rf"\(dist.timeout_s={timeout_s}\): no report from rank 1 \(killed, stopped or hung\)",
            line[0],
        ), line[0]
        assert timeout_s - 1 <= elapsed <= timeout_s + 20, (elapsed, line[0])
        assert "Traceback" not in log
    finally:
        for j in jobs:
            j.kill()


def test_backend_errors_are_recognised_and_shortened():
    from bert.distributed.collectives import backend_reason, is_comm_error
    from data.rebalance.exchange import RebalanceError

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
        "peer [127.0.0.1]:17065. This is typically caused by a remote worker crashing. GLHF!"
    )
    assert is_comm_error(gloo) and backend_reason(gloo) == "Connection closed by peer [127.0.0.1]:17065"
    assert not is_comm_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    # Seen on rank 0 of a 2 x 2 job when host 1 was cut off and its local peer timed out first.
    closure = RuntimeError("Application timeout caused pair closure")
    assert is_comm_error(closure) and backend_reason(closure) == "Application timeout caused pair closure"
    try:
        raise RebalanceError("rebalance step 3: rank 1: the length all-gather failed") from gloo
    except RebalanceError as wrapped:
        assert is_comm_error(wrapped) and backend_reason(wrapped).startswith("Connection closed by peer")
    assert not is_comm_error(RebalanceError("rebalance step 3: rank 1: block has 3 samples, expected 4"))


@pytest.mark.timeout(120)
def test_a_config_error_on_one_rank_is_one_line_per_rank_under_run_torchrun(dataset, tmp_path):
    """Rank 0 alone refuses to resume a run that already ended (its MLPerf log says so); rank 1
    prints that cause, torchrun one line; no traceback, no C++ frames, no torchrun log lines."""
    steps = ("train.max_steps=2", "checkpoint.interval_steps=1")
    run_in_process(dataset, tmp_path, *steps)
    cmd = ["bash", "launch/run_torchrun.sh", "1", "2", "", str(tmp_path), *run_args(dataset, *steps)]
    job = Job(cmd, str(tmp_path / "torchrun.log"), clean_env())
    rc, lines = job.wait(90, "run_torchrun.sh"), job.output().strip().splitlines()
    cause = f"MLPerf log: cannot resume {tmp_path}/mlperf.log: the run already ended"
    assert rc in (1, 2) and len(lines) == 3, lines
    assert lines[0].startswith(f"error (rank 0): {cause}"), lines
    assert re.match(rf"error: rank 1: the .* failed after .*: rank 0 stopped first: {re.escape(cause)}", lines[1])
    assert re.fullmatch(r"torchrun: [12] rank\(s\) failed, rank [01] first: it exited with status [12]", lines[2])
