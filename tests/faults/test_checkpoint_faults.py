"""Checkpoints that are interrupted, refused by the file system, or damaged on disk: the
previous checkpoint always survives and is used, and every problem is named."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil

import pytest
import torch

import run_pretraining
from bert.checkpoint import training as train_checkpoint
from common import files
from common.errors import CheckpointError
from tests.faults.common import (
    PYTHON,
    REFERENCE_STEPS,
    WORKER,
    Job,
    clean_env,
    losses,
    run_args,
    run_in_process,
    summary,
    wait_for,
)


def ckpt_dir(out):
    return os.path.join(out, "checkpoints")


def names(out):
    return sorted(os.listdir(ckpt_dir(out)))


# ---- the file format -------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    state = {"model": {"w": torch.arange(5000, dtype=torch.float32)}, "counters": {"step": 3}}
    path = train_checkpoint.save(str(tmp_path), 3, state, keep=2)
    return path, state


def test_checksum_trailer_is_what_sha256sum_gives(saved):
    path, state = saved
    raw = open(path, "rb").read()
    body, trailer = raw[: -train_checkpoint.TRAILER_BYTES], raw[-train_checkpoint.TRAILER_BYTES :]
    assert trailer == (f"\nBERT-CHECKPOINT sha256={hashlib.sha256(body).hexdigest()} size={len(body):016d}\n").encode()
    assert torch.equal(train_checkpoint.read(path)["model"]["w"], state["model"]["w"])


def _flip(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 0x40]) + raw[at + 1 :]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda raw: _flip(raw, len(raw) // 2), "checksum mismatch"),
        (lambda raw: _flip(raw, 100), "checksum mismatch"),
        (lambda raw: raw[: len(raw) // 2], "no checksum trailer"),
        (lambda raw: raw[:-1], "no checksum trailer"),
        (lambda raw: raw[:50], "too short"),
        (lambda raw: b"", "too short"),
        (lambda raw: raw[: -train_checkpoint.TRAILER_BYTES], "no checksum trailer"),
        (lambda raw: raw[:1000] + raw[1001:], "trailer records"),
    ],
    ids=["flip-middle", "flip-header", "half", "minus-one-byte", "50-bytes", "empty", "no-trailer", "byte-removed"],
)
def test_damage_is_detected_and_named(saved, damage, message):
    path, _ = saved
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(damage(raw))
    with pytest.raises(CheckpointError) as e:
        train_checkpoint.read(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)


def test_keep_prunes_the_oldest_only_after_a_successful_write(tmp_path):
    for step in (1, 2, 3):
        train_checkpoint.save(str(tmp_path), step, {"counters": {"step": step}}, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000002.pt", "step_00000003.pt"]


# ---- kill -9 in the middle of a write --------------------------------------------------------


@pytest.mark.slow  # a training subprocess, killed
@pytest.mark.timeout(180)
def test_kill_during_a_checkpoint_write_keeps_the_previous_one(dataset, reference, tmp_path, capsys):
    out, marks = tmp_path / "out", tmp_path / "marks"
    marks.mkdir()
    job = Job(
        [PYTHON, WORKER, "--output-dir", str(out), *run_args(dataset, *REFERENCE_STEPS)],
        str(tmp_path / "run.log"),
        clean_env(FAULT_MARK_DIR=marks, FAULT_STALL_CHECKPOINT=8),
    )
    wait_for(lambda: (marks / "stalled").exists(), 120, [job], "the write of the step-8 checkpoint")
    job.kill()  # SIGKILL, half-way through the file
    left, kept = names(out)
    assert re.fullmatch(r"\.step_00000008\.pt\.tmp\d+", left) and kept == "step_00000004.pt"
    assert os.path.getsize(os.path.join(ckpt_dir(out), left)) > 4096
    assert train_checkpoint.read(os.path.join(ckpt_dir(out), "step_00000004.pt"))["counters"]["step"] == 4

    # Rerun with the same output directory: the leftover goes, the run resumes at step 4 and
    # trains exactly what the uninterrupted run trained.
    s = run_in_process(dataset, out, *REFERENCE_STEPS)
    printed = capsys.readouterr().out
    assert f"removed {left}" in printed and "resumed from step 4" in printed
    assert s["steps"] == 12 and losses(out) == reference
    assert names(out) == ["step_00000004.pt", "step_00000008.pt"]


# ---- a kill at every point of a save: the last good checkpoint is never lost -------------------


class Killed(BaseException):
    """A kill -9 at this point: the test copied what is on disk first."""


class KillingOs:
    """``os`` as a module sees it: the ``at``-th call that touches the disk first copies
    ``watched`` to ``left`` (what a kill there leaves behind), then raises Killed. Of a run of
    writes only the first two count (an empty file, a partial one; ``close`` sees it whole)."""

    CALLS = {"open", "write", "close", "fsync", "replace", "rename", "remove", "unlink", "mkdir", "rmdir"}

    def __init__(self, real, watched, left, at: int):
        self._real, self.watched, self.left, self.at = real, watched, left, at
        self.calls = self.writes = 0

    def __getattr__(self, name):
        value = getattr(self._real, name)
        if name not in self.CALLS:
            return value

        def call(*args, **kwargs):
            self.writes = self.writes + 1 if name == "write" else 0
            self.calls += self.writes <= 2
            if self.calls == self.at and self.writes <= 2:
                shutil.copytree(self.watched, self.left, symlinks=True)
                raise Killed
            return value(*args, **kwargs)

        return call


def kill_points(tmp_path, monkeypatch, prepare, save):
    """Yield, for each call of ``save(root)`` that touches the disk, the directory a kill just
    before that call leaves (``prepare(root)`` set it up first); ends once ``save`` ran whole."""
    at = 0
    while True:
        at += 1
        root, left = tmp_path / f"run{at}", tmp_path / f"left{at}"
        root.mkdir()
        prepare(root)
        killer = KillingOs(os, root, left, at)
        monkeypatch.setattr(train_checkpoint, "os", killer)
        monkeypatch.setattr(files, "os", killer)
        try:
            save(root)
        except BaseException:  # Killed, or what torch.save turned it into on its way out
            if not left.exists():
                raise
        finally:
            monkeypatch.undo()
        if not left.exists():
            assert at > 8  # opens, writes, fsyncs, renames: the whole window was walked
            return
        yield left


def _state(step: int, version: float) -> dict:
    return {"counters": {"step": step}, "model": {"w": torch.full((3000,), version)}}


@pytest.mark.parametrize("step", [8, 12], ids=["re-save-of-the-newest-step", "new-step-pruning-the-oldest"])
def test_a_kill_at_any_point_of_a_save_leaves_a_good_checkpoint_to_resume(tmp_path, monkeypatch, step):
    """Checkpoints of steps 4 and 8 (keep 2), then a save of ``step``: wherever a kill lands,
    the next start (leftovers removed, newest that verifies) resumes from step 8 as it was, or
    from the new checkpoint whole."""

    def prepare(root):
        for s in (4, 8):
            train_checkpoint.save(str(root), s, _state(s, 0.0), keep=2)

    for left in kill_points(
        tmp_path, monkeypatch, prepare, lambda r: train_checkpoint.save(str(r), step, _state(step, 1.0), 2)
    ):
        train_checkpoint.remove_temporaries(str(left))
        path, state = train_checkpoint.load_latest(str(left), warn=pytest.fail)
        assert (state["counters"]["step"], float(state["model"]["w"][0])) in ((8, 0.0), (step, 1.0)), path


def test_a_kill_at_any_point_of_an_export_leaves_the_old_or_the_new_one(tmp_path, monkeypatch):
    """``files.publishing_dir`` over an existing export: a kill between moving the old one aside
    and renaming the new one in leaves ``.export.old``, which the next export puts back first."""

    def export(root, text):
        with files.publishing_dir(root / "export") as staging:
            (staging / "weights").write_text(text)

    for left in kill_points(tmp_path, monkeypatch, lambda r: export(r, "old"), lambda r: export(r, "new")):
        with pytest.raises(RuntimeError), files.publishing_dir(left / "export"):
            raise RuntimeError("the next export fails: only its start (the recovery) ran")
        assert (left / "export" / "weights").read_text() in ("old", "new")
        assert not (left / ".export.old").exists()


def test_cleanup_unlinks_links_and_a_write_never_goes_through_one(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    os.symlink(target, directory / ".step_00000008.tmp")
    os.symlink(target / "keep", directory / ".step_00000004.pt.tmp")
    assert sorted(train_checkpoint.remove_temporaries(str(directory))) == [
        ".step_00000004.pt.tmp",
        ".step_00000008.tmp",
    ]
    assert os.listdir(directory) == [] and os.listdir(target) == ["keep"]
    # A link under the very name the writer uses (a killed writer of this pid's), left after the start:
    os.symlink(target / "keep", directory / f".step_00000004.pt.tmp{os.getpid()}")
    train_checkpoint.save(str(directory), 4, {"counters": {"step": 4}}, keep=2)
    assert (target / "keep").read_text() == "x" and os.listdir(directory) == ["step_00000004.pt"]


def test_a_write_stopped_by_anything_leaves_no_temporary_file(tmp_path, monkeypatch):
    def failing_save(state, sink):
        sink.write(b"x" * 5000)
        raise MemoryError("out of memory half-way")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(MemoryError):
        train_checkpoint.save(str(tmp_path), 4, {"counters": {"step": 4}}, keep=2)
    assert os.listdir(tmp_path) == []


# ---- a file system that refuses the write ----------------------------------------------------


class RefusingOs:
    """``os`` as bert.checkpoint.training and common.files see it, refusing the checkpoint of one step:
    ENOSPC after some bytes were written, or EACCES when the file is created."""

    def __init__(self, real, err: int, step: int):
        self._real, self.err, self.name = real, err, f".step_{step:08d}.pt.tmp"
        self.fd, self.written = None, 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def open(self, path, flags, mode=0o777):
        ours = os.path.basename(path).startswith(self.name)
        if ours and self.err == errno.EACCES:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        fd = self._real.open(path, flags, mode)
        if ours and flags & os.O_WRONLY:
            self.fd = fd
        return fd

    def write(self, fd, data):
        if fd == self.fd and self.err == errno.ENOSPC and self.written > 2048:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self._real.write(fd, data)
        if fd == self.fd:
            self.written += n
        return n


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EACCES], ids=["no-space", "no-permission"])
def test_a_refused_write_is_reported_and_the_run_continues(dataset, reference, tmp_path, monkeypatch, capsys, err):
    refusing = RefusingOs(os, err, step=8)
    monkeypatch.setattr(train_checkpoint, "os", refusing)
    monkeypatch.setattr(files, "os", refusing)
    s = run_in_process(dataset, tmp_path, *REFERENCE_STEPS)
    printed = capsys.readouterr().out
    path = os.path.join(ckpt_dir(tmp_path), "step_00000008.pt")
    assert (
        f"error: step 8: {path}: cannot write the checkpoint ({os.strerror(err)}); the previous checkpoint "
        f"(step_00000004.pt) is kept; continuing (checkpoint.on_error=continue)"
    ) in printed
    assert names(tmp_path) == ["step_00000004.pt"]  # no temporary file left behind
    assert s["status"] == "aborted" and s["steps"] == 12 and s["checkpoint_failures"] == 1 and "error" not in s
    assert losses(tmp_path) == reference


def test_a_refused_write_stops_the_run_when_configured(dataset, tmp_path, monkeypatch, capsys):
    refusing = RefusingOs(os, errno.ENOSPC, step=8)
    monkeypatch.setattr(train_checkpoint, "os", refusing)
    monkeypatch.setattr(files, "os", refusing)
    code = run_pretraining.main(
        ["--output-dir", str(tmp_path), *run_args(dataset, *REFERENCE_STEPS, "checkpoint.on_error=stop")]
    )
    captured = capsys.readouterr()
    assert code == 1
    assert "stopping (checkpoint.on_error=stop)" in captured.out
    err = captured.err.strip().splitlines()
    assert err == [
        f"error: the checkpoint of step 8 could not be written: "
        f"{os.path.join(ckpt_dir(tmp_path), 'step_00000008.pt')}: cannot write the checkpoint "
        f"(No space left on device)"
    ]
    assert names(tmp_path) == ["step_00000004.pt"]
    s = summary(tmp_path)
    assert s["status"] == "aborted" and s["steps"] == 8 and s["error"].startswith("the checkpoint of step 8")
    stop = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in open(tmp_path / "mlperf.log") if '"run_stop"' in line]
    assert stop and stop[-1]["metadata"]["status"] == "aborted"


# ---- damaged on disk ---------------------------------------------------------------------------


def test_a_damaged_checkpoint_is_named_and_the_previous_one_used(dataset, reference, tmp_path, capsys):
    first = run_in_process(dataset, tmp_path, *REFERENCE_STEPS, stop_after=7)  # as SIGTERM at step 8 does
    assert first["status"] == "interrupted" and names(tmp_path) == ["step_00000004.pt", "step_00000008.pt"]
    path = os.path.join(ckpt_dir(tmp_path), "step_00000008.pt")
    raw = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(_flip(raw, len(raw) // 3))
    capsys.readouterr()
    s = run_in_process(dataset, tmp_path, *REFERENCE_STEPS)
    printed = capsys.readouterr().out
    assert f"warning: {path}: checksum mismatch" in printed and "trying the previous checkpoint" in printed
    assert "resumed from step 4" in printed
    assert s["steps"] == 12 and losses(tmp_path) == reference


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(dataset, tmp_path, capsys):
    run_in_process(dataset, tmp_path, "train.max_steps=5", "checkpoint.interval_steps=4")
    path = os.path.join(ckpt_dir(tmp_path), "step_00000004.pt")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    capsys.readouterr()
    code = run_pretraining.main(["--output-dir", str(tmp_path), *run_args(dataset, *REFERENCE_STEPS)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(
        f"error (rank 0): every checkpoint in {ckpt_dir(tmp_path)} is damaged or refused ({path}: no checksum trailer"
    )
