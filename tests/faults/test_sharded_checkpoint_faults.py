"""Rank 0 killed while it writes a sharded run's checkpoint (optim.shard: the tensors gathered
whole, one file): the other rank fails instead of hanging, the previous checkpoint survives and is used."""

from __future__ import annotations

import os
import re

import pytest

from bert.checkpoint import training as train_checkpoint
from tests.faults.common import REFERENCE_STEPS, read_pid, spawn_ranks, wait_for
from tests.faults.common import losses as run_losses

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

SHARDED = (*REFERENCE_STEPS, "optim.shard=dp", "dist.timeout_s=20")


def test_sigkill_mid_sharded_save_resumes_from_the_previous_checkpoint(dataset, reference, tmp_path):
    out, marks, logs = tmp_path / "out", tmp_path / "marks", tmp_path / "logs"
    marks.mkdir()
    logs.mkdir()
    jobs = spawn_ranks(2, out, dataset, *SHARDED, log_dir=str(logs), FAULT_MARK_DIR=marks, FAULT_STALL_CHECKPOINT=8)
    wait_for(lambda: (marks / "stalled").exists(), 240, jobs, "rank 0's write of the step-8 checkpoint")
    os.kill(read_pid(marks, 0), 9)  # SIGKILL half-way through the file; rank 1 waits for its verdict
    assert jobs[1].wait(120, "rank 1 after rank 0 was killed") != 0  # a communication failure, not a hang
    jobs[0].wait(30, "the killed rank")
    directory = out / "checkpoints"
    left, kept = sorted(os.listdir(directory))
    assert re.fullmatch(r"\.step_00000008\.pt\.tmp\d+", left) and kept == "step_00000004.pt"
    assert train_checkpoint.read(str(directory / "step_00000004.pt"))["counters"]["step"] == 4

    # Rerun on the same directory: the unfinished write is removed, the run resumes at step 4
    # and trains what the uninterrupted run trains (2 ranks against 1: rel 1e-5, as
    # tests/bert/train/test_trainer_distributed.py).
    jobs = spawn_ranks(2, out, dataset, *SHARDED, log_dir=str(logs))
    for job in jobs:
        assert job.wait(300, "a rank of the resumed run") == 0, job.output()[-3000:]
    printed = jobs[0].output()
    assert f"removed {left}" in printed and "resumed from step 4" in printed
    assert run_losses(out) == pytest.approx(reference, rel=1e-5)
    assert sorted(os.listdir(directory)) == ["step_00000004.pt", "step_00000008.pt"]
