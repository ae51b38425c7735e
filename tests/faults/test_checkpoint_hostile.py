"""Hostile training checkpoints and transformers directories (issue 33): files that would hang the
run (FIFOs, ``/dev/zero``), and the sharded DCP-directory format that no release wrote. Each is
refused at once in one line naming the file and the rule; a run that also has an older good
checkpoint names each refused file and resumes from the good one.
"""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest

from bert.checkpoint import training as tc
from bert.checkpoint.safe_load import read_config_and_weights
from bert.model.config import BertConfig
from common.errors import CheckpointError, ConfigError
from tests.bert.checkpoint.test_tf_reader import PREFIX
from tests.faults.common import run_in_process, spawn_ranks, summary

BASE = ("train.max_steps=4", "checkpoint.interval_steps=2")


def test_files_that_would_block_are_named_at_once_and_the_good_one_resumes(dataset, good_run, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(good_run, out)
    checkpoints = out / "checkpoints"
    os.mkfifo(checkpoints / "step_00000003.pt")
    os.symlink("/dev/zero", checkpoints / "step_00000004.pt")
    expected = {
        str(checkpoints / "step_00000003.pt"): "a checkpoint is a FIFO, not a regular file; refused",
        str(checkpoints / "step_00000004.pt"): "a checkpoint is a device, not a regular file; refused",
    }
    capsys.readouterr()
    started = time.monotonic()
    s = run_in_process(dataset, out, *BASE)
    printed = capsys.readouterr().out
    warnings = [line for line in printed.splitlines() if line.startswith("warning:")]
    for path, message in expected.items():
        named = [w for w in warnings if w.startswith(f"warning: {path}: ")]
        assert len(named) == 1 and message in named[0], (path, message, "\n".join(warnings))
        assert named[0].endswith("; trying the previous checkpoint")
    assert len(warnings) == len(expected), warnings
    assert "resumed from step 2" in printed and s["steps"] == 4
    assert time.monotonic() - started < 60  # nothing waited on a FIFO or read /dev/zero


def test_a_sharded_checkpoint_directory_is_refused_in_one_line(tmp_path):
    """The DCP-directory format of unreleased code: listing, reading or exporting it is one line
    that names the format and what to do; nothing inside it is opened."""
    directory = tmp_path / "step_00000004"
    directory.mkdir()
    os.mkfifo(directory / "MANIFEST.json")  # opening it would block
    for call in (lambda: tc.list_checkpoints(str(tmp_path)), lambda: tc.read(str(directory))):
        with pytest.raises(CheckpointError) as e:
            call()
        message = str(e.value)
        assert message.startswith(f"{directory}: a sharded checkpoint directory (DCP-directory format)")
        assert "move it out of the checkpoint directory" in message and "\n" not in message


@pytest.mark.timeout(10)  # a regression blocks on the FIFO: failed by the timeout, not hung
@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: os.mkfifo(d / "step_00000003.pt"), "step_00000003.pt: a checkpoint is a FIFO"),
        (lambda d: os.symlink("/dev/zero", d / "step_00000003.pt"), "step_00000003.pt: a checkpoint is a device"),
    ],
    ids=["fifo", "dev-zero"],
)
def test_a_checkpoint_that_would_block_is_refused_at_once(tmp_path, make, message):
    make(tmp_path)
    path = tc.list_checkpoints(str(tmp_path))[-1][1]
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=message) as e:
        tc.read(path)
    assert time.monotonic() - started < 0.5 and "refused" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "pytorch_model.bin"])
def test_a_fifo_in_a_transformers_directory_is_refused_at_once(tmp_path, name):
    BertConfig.preset("tiny", vocab_size=96).to_json(str(tmp_path / "config.json"), transformers=True)
    if name == "config.json":
        os.remove(tmp_path / "config.json")
    os.mkfifo(tmp_path / name)
    started = time.monotonic()
    with pytest.raises((CheckpointError, ConfigError)) as e:
        read_config_and_weights(str(tmp_path))
    assert time.monotonic() - started < 1
    assert str(e.value).startswith(f"{tmp_path / name}: ")
    assert "is a FIFO, not a regular file; refused" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_ranks_pass_over_a_fifo_and_dev_zero_without_waiting(dataset, good_run, tmp_path):
    """No collective guards a checkpoint's reading: a rank blocked on a FIFO would hang the run
    past dist.timeout_s. Both ranks refuse them at once and resume from step 2."""
    out = tmp_path / "out"
    shutil.copytree(good_run, out)
    checkpoints = out / "checkpoints"
    os.symlink("/dev/zero", checkpoints / "step_00000004.pt")
    os.mkfifo(checkpoints / "step_00000005.pt")
    jobs = spawn_ranks(2, out, dataset, *BASE, log_dir=str(tmp_path))
    for rank, job in enumerate(jobs):
        assert job.wait(180, f"rank {rank}") == 0, job.output()[-4000:]
    log = jobs[0].output()
    for name, rule in [("step_00000005.pt", "is a FIFO"), ("step_00000004.pt", "is a device")]:
        assert re.search(rf"warning: \S*{name}: .*{rule}, not a regular file; refused; trying the previous", log), log
    assert "resumed from step 2" in log and summary(out)["steps"] == 4


@pytest.mark.timeout(10)
def test_a_fifo_tensorflow_data_shard_is_refused_at_once(tmp_path):
    shutil.copy(f"{PREFIX}.index", tmp_path / "model.ckpt-7.index")
    os.mkfifo(tmp_path / "model.ckpt-7.data-00000-of-00001")
    with pytest.raises(CheckpointError) as e:
        read_config_and_weights(str(tmp_path / "model.ckpt-7"))
    shard = tmp_path / "model.ckpt-7.data-00000-of-00001"
    assert str(e.value) == f"{shard}: a TensorFlow data shard is a FIFO, not a regular file; refused"
