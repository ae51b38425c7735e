"""Training checkpoints on disk: written atomically, checksummed, verified on load.

The trainer (rank 0) saves ``DIR/checkpoints/step_%08d.pt`` every ``checkpoint.interval_steps``
and on SIGTERM; every rank resumes from the newest one that verifies. A file is the
``torch.save`` of the training state followed by a fixed-size trailer,

    \\nBERT-CHECKPOINT sha256=<64 hex digits> size=<16 digits>\\n

the SHA-256 and byte count of everything before it (``torch.load`` reads the file as it is;
``head -c -111 FILE | sha256sum`` checks it by hand).

Writing: the state is streamed to ``.step_%08d.pt.tmp`` while it is hashed, the trailer is
appended, the file fsynced, renamed into place and the directory fsynced; only then are
checkpoints beyond ``keep`` removed, oldest first. So a file under a final name is always
complete, a kill at any moment leaves at most a temporary file (removed at the next start),
and the previous checkpoints are never touched by a write that does not finish. A write that
fails (no space, no permission, an I/O error) removes its temporary file and raises
``CheckpointWriteError``; the trainer reports it and goes on or stops (``checkpoint.on_error``).

Loading: newest first. A file without a valid trailer (cut short), whose checksum does not
match (damaged), or that torch cannot read is named in a warning and the next older one is
tried; when every checkpoint is damaged the run stops with ``CheckpointError`` rather than
silently starting over.

Safety: a checksum detects damage, not intent, and checkpoints travel between people and
clusters, so reading one never runs code. The state is plain data: tensors, numbers,
strings, lists, tuples and dicts (``save`` refuses anything else), and ``read`` unpickles
with ``torch.load(weights_only=True)``, which builds only those (and refuses, without
calling it, any other global a file names). A file that needs anything else, compresses a
record (a small file that inflates to gigabytes), or holds a value that is not plain data
is refused like a damaged one: one line naming the file and what it holds, then the next
older checkpoint. The caller's ``accept`` (the trainer's shape and dtype checks against the
model) refuses the same way.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable

import torch

from bert.safe_load import CheckpointError, plain_data_problem, safe_torch_load
from fileio import file_digest, publish, write_text

_TRAILER_PREFIX = b"\nBERT-CHECKPOINT sha256="
_TRAILER_RE = re.compile(rb"\nBERT-CHECKPOINT sha256=([0-9a-f]{64}) size=(\d{16})\n\Z")
TRAILER_BYTES = len(_TRAILER_PREFIX) + 64 + len(b" size=") + 16 + 1
_NAME_RE = re.compile(r"step_(\d{8,})(\.pt)?\Z")  # a file, or a sharded checkpoint's directory
_READ_CHUNK = 1 << 22


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message names the file and the OS error."""


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}.pt")


# A sharded checkpoint (bert.distributed_checkpoint) is a directory: DCP's files, rank 0's
# STATE (this module's file format) and, written last, MANIFEST (every other file's size and
# SHA-256). Its format is checked here, with the files', so that listing, pruning, cleaning
# and verifying know both kinds; the tensors are DCP's to read.
MANIFEST = "MANIFEST.json"
STATE = "state.pt"
_DIR_FORMAT = "bert-sharded-checkpoint/1"


def checkpoint_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}")


def temporary_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f".step_{step:08d}.tmp")


def write_manifest(path: str, step: int) -> None:
    """MANIFEST of the directory ``path``: the byte count and SHA-256 of every other file in it."""
    digests = {}
    for name in sorted(n for n in os.listdir(path) if n != MANIFEST):
        file = os.path.join(path, name)
        digests[name] = {"bytes": os.path.getsize(file), "sha256": file_digest(file, "sha256")}
    manifest = {"format": _DIR_FORMAT, "step": step, "files": digests}
    write_text(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1))


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every ``step_*.pt`` file and sharded ``step_*`` directory under its final
    name, oldest first (a step saved both ways, by runs with different ``optim.shard``: the
    directory sorts after the file, so it is the one tried first)."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), "step_*")):
        m = _NAME_RE.match(os.path.basename(path))
        if m and (m.group(2) is None) == os.path.isdir(path):
            found.append((int(m.group(1)), m.group(2) is None, path))
    return [(step, path) for step, _, path in sorted(found)]


def remove_temporaries(directory: str) -> list[str]:
    """Delete the temporary files and directories of writes that were killed; returns their names."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(directory), ".step_*.tmp")):
        try:
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
            removed.append(os.path.basename(path))
        except FileNotFoundError:
            pass
    return removed


class _HashingSink:
    """A write-only file for ``torch.save`` that hashes what passes through it."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # torch.save turns it into a RuntimeError; keep the cause

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        n = len(view)
        try:
            while view:
                written = os.write(self.fd, view)
                view = view[written:]
        except OSError as e:
            self.error = e
            raise
        self.size += n
        return n

    def flush(self) -> None:
        pass


def _trailer(sha_hex: str, size: int) -> bytes:
    return _TRAILER_PREFIX + sha_hex.encode() + b" size=" + f"{size:016d}".encode() + b"\n"


def save(directory: str, step: int, state: dict, keep: int) -> str:
    """Write ``state`` as the checkpoint of ``step`` and keep the newest ``keep``; returns its path.

    ``state`` must be plain data (TypeError otherwise: a bug, since ``read`` would refuse the
    file). Raises CheckpointWriteError (the temporary file removed, older checkpoints
    untouched) when the file system refuses the write.
    """
    problem = plain_data_problem(state)
    if problem:
        raise TypeError(f"checkpoint state of step {step}: {problem}")
    return write(directory, step, state, keep)


def write(directory: str, step: int, state, keep: int) -> str:
    """``save`` without the plain-data check: the file format only (tests write hostile files with it)."""
    path = write_file(checkpoint_path(directory, step), state)
    prune(directory, keep)
    return path


def prune(directory: str, keep: int) -> None:
    """Remove the checkpoints (files and sharded directories) beyond the newest ``keep``."""
    for _, old in list_checkpoints(directory)[:-keep]:
        try:
            if os.path.isdir(old):
                shutil.rmtree(old)
            else:
                os.remove(old)
        except OSError:
            pass  # an old checkpoint that cannot be removed costs space, not correctness


def write_file(path: str, state) -> str:
    """One checksummed file at ``path``: streamed to ``.NAME.tmp`` beside it, fsynced, renamed."""
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp")
    fd = -1
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sink = _HashingSink(fd, tmp)
        try:
            torch.save(state, sink)
        except RuntimeError:
            if sink.error is None:
                raise  # not the file system: a bug to see
            raise sink.error from None
        trailer = _trailer(sink.sha.hexdigest(), sink.size)
        view = memoryview(trailer)
        while view:
            view = view[os.write(fd, view) :]
        os.close(fd)
        fd = -1
        publish(tmp, path)
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        try:
            os.remove(tmp)
        except OSError:
            pass
        what = e.strerror or str(e)
        raise CheckpointWriteError(f"{path}: cannot write the checkpoint ({what})") from None
    return path


def verify(path: str) -> None:
    """Check the trailer and the SHA-256 of ``path``; raises CheckpointError saying what is wrong."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            total = f.tell()
            if total < TRAILER_BYTES:
                raise CheckpointError(f"{path}: {total} bytes, too short to be a checkpoint (cut short?)")
            f.seek(total - TRAILER_BYTES)
            m = _TRAILER_RE.match(f.read(TRAILER_BYTES))
            if m is None:
                raise CheckpointError(
                    f"{path}: no checksum trailer at the end (cut short, or not written by this trainer)"
                )
            want, size = m.group(1).decode(), int(m.group(2))
            if size != total - TRAILER_BYTES:
                raise CheckpointError(
                    f"{path}: the trailer records {size} bytes of state, the file holds {total - TRAILER_BYTES}"
                )
            f.seek(0)
            sha = hashlib.sha256()
            left = size
            while left:
                piece = f.read(min(_READ_CHUNK, left))
                if not piece:
                    raise CheckpointError(f"{path}: ended early while reading")
                sha.update(piece)
                left -= len(piece)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    if sha.hexdigest() != want:
        raise CheckpointError(
            f"{path}: checksum mismatch (damaged: SHA-256 {sha.hexdigest()[:12]}..., recorded {want[:12]}...)"
        )


def verify_dir(path: str) -> dict:
    """Check every file of the checkpoint directory against its manifest; returns the manifest.
    Raises CheckpointError saying what is missing or damaged."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST} (an unfinished write, or not written by this trainer)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: {MANIFEST} is not readable JSON ({e})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("format") != _DIR_FORMAT or not isinstance(files, dict) or STATE not in files:
        raise CheckpointError(f"{path}: {MANIFEST} is not a sharded training checkpoint's manifest")
    for name, entry in files.items():
        file = os.path.join(path, name)
        if os.path.basename(name) != name or not isinstance(entry, dict):
            raise CheckpointError(f"{path}: {MANIFEST} names {name!r}, not a file of this directory")
        try:
            size = os.path.getsize(file)
        except OSError:
            raise CheckpointError(f"{path}: {name} is missing") from None
        if size != entry.get("bytes"):
            raise CheckpointError(f"{path}: {name} holds {size} bytes, the manifest records {entry.get('bytes')}")
        digest = file_digest(file, "sha256")
        if digest != entry.get("sha256"):
            raise CheckpointError(
                f"{path}: {name}: checksum mismatch (damaged: SHA-256 {digest[:12]}..., recorded "
                f"{str(entry.get('sha256'))[:12]}...)"
            )
    if ".metadata" not in files:
        raise CheckpointError(f"{path}: the manifest lists no .metadata")
    return manifest


def read(path: str) -> dict:
    """Verify and load one checkpoint (on the CPU) without running anything in it.

    A sharded checkpoint (a directory, bert.distributed_checkpoint) is checked against its
    manifest and gives its ``state.pt`` with ``"sharded": path`` added: its tensors are read
    into the resuming run's layout by ``distributed_checkpoint.load_tensors``.
    """
    if os.path.isdir(path):
        verify_dir(path)
        state = read_file(os.path.join(path, STATE))
        if not isinstance(state, dict) or "counters" not in state:
            raise CheckpointError(f"{path}: not a training checkpoint (no 'counters')")
        return {**state, "sharded": path}
    state = read_file(path)
    if not isinstance(state, dict) or "counters" not in state:
        raise CheckpointError(f"{path}: not a training checkpoint (no 'counters')")
    return state


def read_file(path: str):
    """Verify and load one checksummed file of plain data."""
    verify(path)
    # Only the bytes before the trailer are the archive: records may not reach beyond them.
    state = safe_torch_load(path, limit=os.path.getsize(path) - TRAILER_BYTES, archive_only=True)
    problem = plain_data_problem(state)
    if problem:
        raise CheckpointError(f"{path}: {problem}; only tensors, numbers, strings, lists and dicts are loaded")
    return state


def load_latest(
    directory: str, warn=print, accept: Callable[[dict], None] | None = None, older_than: str | None = None
) -> tuple[str, dict] | None:
    """(path, state) of the newest checkpoint that verifies and that ``accept`` takes (it
    raises CheckpointError to refuse one); None when there is none at all. ``older_than``
    (a checkpoint's path) looks only at checkpoints of earlier steps.

    Each damaged or refused one is reported through ``warn`` before the next older one is
    tried; if all are, CheckpointError names them.
    """
    found = list_checkpoints(directory)
    if older_than is not None:
        limit = next((step for step, path in found if path == older_than), None)
        found = [(step, path) for step, path in found if limit is None or step < limit]
    problems = []
    for _, path in reversed(found):
        try:
            state = read(path)
            if accept is not None:
                try:
                    accept(state)
                except CheckpointError as e:
                    raise CheckpointError(f"{path}: {e}") from None
            return path, state
        except CheckpointError as e:
            problems.append(str(e))
            warn(f"warning: {e}; trying the previous checkpoint")
    if problems:
        raise CheckpointError(
            f"every checkpoint in {directory} is damaged or refused ({'; '.join(problems)}); "
            f"move them away to start the run over"
        )
    return None
