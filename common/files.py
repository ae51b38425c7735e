"""Files published whole, and digests of files read in pieces: the one place both are written.

Every output appears under its final name complete or not at all: written under a temporary
name in the same directory, fsynced, renamed, the directory fsynced. ``open_checked`` /
``read_checked`` open what the application reads: a regular file only, never blocking, else
``UnsafeFile`` naming the file and the rule (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's or a directory's data and metadata to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_temporary(name: str) -> bool:
    """Whether a file name is one of this module's temporary names (what a killed writer left)."""
    return re.search(r"\.tmp\d+(\.\w+)?$", name) is not None


# Temporary files and directories are ``.<name>.tmp<pid><suffix>``: hidden, one per process; the
# suffix stays last, as savefig and np.save choose by it. A killed writer leaves such a name.
def _temp_name(path: Path, suffix: str) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}{suffix}")


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Make the written file (or directory) ``tmp`` durable and rename it over ``path``."""
    tmp, path = Path(tmp), Path(path)
    for root, _, files in os.walk(tmp):  # a file: walks nothing
        for name in files:
            fsync_path(os.path.join(root, name))
    fsync_path(tmp)
    os.replace(tmp, path)
    # The rename made durable; some file systems cannot open a directory (they order their metadata themselves).
    with contextlib.suppress(OSError):
        fsync_path(path.parent)


@contextlib.contextmanager
def publishing_fd(path: str | os.PathLike, suffix: str | None = None) -> Iterator[int]:
    """Yield a descriptor on a new temporary file beside ``path`` (``suffix`` ends its name, default
    ``path``'s), created exclusively, never through a link (a killed writer's leftover is removed
    first). On a clean exit it is closed and published as ``path``; on an error closed and removed,
    ``path`` left as it was."""
    path = Path(path)
    tmp = _temp_name(path, path.suffix if suffix is None else suffix)
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        try:
            yield fd
        finally:
            os.close(fd)
        publish(tmp, path)
    finally:
        with contextlib.suppress(OSError):  # never hides the error that got here
            os.remove(tmp)


@contextlib.contextmanager
def publishing(path: str | os.PathLike, suffix: str | None = None) -> Iterator[Path]:
    """``publishing_fd`` for a writer that opens the file by its name: yields the temporary path."""
    path = Path(path)
    with publishing_fd(path, suffix):
        yield _temp_name(path, path.suffix if suffix is None else suffix)


@contextlib.contextmanager
def publishing_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a new empty directory beside ``path``; fill it. On a clean exit it replaces ``path`` without
    removing the old one first (renamed to ``.NAME.old``, which the next call puts back after a kill between
    the renames: docs/reliability.md); on an error it is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.with_name(f".{path.name}.old")
    if os.path.lexists(old):
        if os.path.lexists(path):
            remove_tree(old)  # the swap had finished: the leftover is the replaced one
        else:
            os.replace(old, path)  # killed between the renames: the old one is the last good one
    tmp = _temp_name(path, "")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed process that had this pid
    tmp.mkdir()
    try:
        yield tmp
        moved = os.path.lexists(path)
        if moved:
            os.replace(path, old)
        try:
            publish(tmp, path)
        except BaseException:
            if moved and not os.path.lexists(path):
                os.replace(old, path)
            raise
        remove_tree(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_tree(path: str | os.PathLike) -> None:
    """Remove a directory tree, a file or a link (never what a link points to), if there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Publish ``text`` as the file ``path``."""
    with publishing(path) as tmp, open(tmp, "wb") as f:
        f.write(text.encode(encoding))


# What open_checked calls a file that is not a regular one, by its type (stat.S_IFMT).
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}
_KINDS.update(dict.fromkeys((stat.S_IFCHR, stat.S_IFBLK), "a device"))


class UnsafeFile(OSError):
    """A file the application will not read: its message is one line naming the file and the rule."""


def open_checked(path: str | os.PathLike, *, max_bytes: int | None = None, what: str = "file"):
    """Open ``path`` for binary reading, refusing in one line (``UnsafeFile``) anything but a regular
    file (a FIFO, a device, a directory) or one over ``max_bytes`` (a missing file is
    ``FileNotFoundError``). The open does not block, so a FIFO never hangs it; the file reads normally."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise UnsafeFile(f"{path}: {what} cannot be opened ({e.strerror})") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise UnsafeFile(f"{path}: {what} is {kind}, not a regular file; refused")
        if max_bytes is not None and st.st_size > max_bytes:
            raise UnsafeFile(
                f"{path}: {what} is {st.st_size:,} bytes, over the {max_bytes:,} this format allows; refused"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_checked(path: str | os.PathLike, *, max_bytes: int, what: str = "file") -> bytes:
    """The whole of a checked file (``open_checked``), never more than ``max_bytes`` read even
    if it grows while being read."""
    with open_checked(path, max_bytes=max_bytes, what=what) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafeFile(f"{os.fspath(path)}: {what} grew past {max_bytes:,} bytes while read; refused")
    return data


def file_digest(path: str | os.PathLike, name: str = "md5") -> str:
    """Hex digest (hashlib algorithm ``name``, md5 as ``md5sum`` prints it) of a regular file
    (``open_checked``: ``/dev/zero`` is refused, not hashed forever), read in 1 MiB pieces so a
    shard is never held in memory."""
    h = hashlib.new(name)
    with open_checked(path) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
