"""Shared pieces of the fault tests: the tiny run's settings, a reference run in this process,
and processes started in their own process groups that a test kills when its time is up.

Every process a test starts goes through ``Job``: output goes to a file (never a pipe that
could fill up and block it), and ``Job.wait``/``wait_for`` kill the whole process group and
fail the test when their timeout expires, so a hang is a failure, never a stuck suite.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from tests.bert.train.test_trainer import ROOT, TINY, losses, run_in_process  # noqa: F401 - re-exported
from tests.helpers import Job, clean_env, free_port  # noqa: F401 - re-exported

REFERENCE_STEPS = ("train.max_steps=12", "checkpoint.interval_steps=4")
PYTHON = sys.executable
WORKER = os.path.join(ROOT, "tests", "faults", "fault_worker.py")


def run_args(dataset, *extra) -> list[str]:
    train, eval_file = dataset
    return [*TINY, f"data.train_dir={train}", f"data.eval_file={eval_file}", *extra]


def wait_for(predicate, timeout: float, jobs: list[Job], what: str) -> None:
    """Poll ``predicate`` until true; fail (killing ``jobs``) on timeout or if a job exits first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        ended = [j for j in jobs if j.proc.poll() is not None]
        if ended or time.monotonic() > deadline:
            for j in jobs:
                if not ended:
                    j.dump_worker_stacks()
                j.kill()
            why = f"exited with {ended[0].proc.returncode}" if ended else f"timed out after {timeout:g} s"
            pytest.fail(f"waiting for {what}: {why}:\n" + "\n".join(j.output()[-3000:] for j in jobs))
        time.sleep(0.05)


def spawn_ranks(n: int, out_dir, dataset, *extra, log_dir, **fault_env) -> list[Job]:
    """n ranks started directly with the variables torchrun would set (no launcher process)."""
    port = free_port()
    jobs = []
    for rank in range(n):
        env = clean_env(
            RANK=rank, WORLD_SIZE=n, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **fault_env
        )
        jobs.append(
            Job(
                [PYTHON, WORKER, "--output-dir", str(out_dir), *run_args(dataset, *extra)],
                os.path.join(log_dir, f"rank{rank}.log"),
                env,
            )
        )
    return jobs


def read_pid(mark_dir, rank: int) -> int:
    with open(os.path.join(mark_dir, f"rank{rank}.pid")) as f:
        return int(f.read())


def metrics(out_dir) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(out_dir) -> dict:
    with open(os.path.join(out_dir, "summary.json")) as f:
        return json.load(f)
