"""common.files: files published whole (temporary name, fsync, rename, fsync of the directory) and
streamed digests; and the project publishes every file through it (no rename by hand)."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import os
from pathlib import Path

import pytest

from common import files
from common.files import file_digest, is_temporary, publish, publishing, publishing_dir, write_text

REPO = Path(__file__).resolve().parents[2]
PROJECT = ("bench", "bert", "data", "kernels", "launch")


@pytest.fixture
def fsyncs(monkeypatch):
    """Every fsync made, as the path of the file or directory synced (Linux: /proc/self/fd)."""
    synced, real_fsync = [], os.fsync

    def tracking_fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", tracking_fsync)
    return synced


def test_write_text_publishes_file_then_directory_durably(tmp_path, fsyncs):
    path = tmp_path / "out.json"
    path.write_text("old")
    write_text(path, "new ü\n")
    assert path.read_text(encoding="utf-8") == "new ü\n"
    assert os.listdir(tmp_path) == ["out.json"]  # no temporary file left
    temp, directory = fsyncs
    assert temp.parent == tmp_path and temp.name.startswith(".out.json.tmp") and directory == tmp_path


def test_an_error_while_writing_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "curves.png"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="half-way"), publishing(path) as tmp:
        assert tmp.suffix == ".png" and tmp.parent == tmp_path  # savefig picks its format by the suffix
        tmp.write_bytes(b"half")
        raise RuntimeError("half-way")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["curves.png"]


def test_publishing_dir_replaces_a_directory_whole(tmp_path, fsyncs):
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.bin").write_bytes(b"x")
    with publishing_dir(out) as staging:
        assert not out.joinpath("config.json").exists()
        (staging / "config.json").write_text("{}")
    assert sorted(os.listdir(out)) == ["config.json"]
    assert sorted(os.listdir(tmp_path)) == ["export"]
    assert [p.name for p in fsyncs[:1]] == ["config.json"]  # the files, then the directory, before the rename
    assert fsyncs[-1] == tmp_path
    with pytest.raises(OSError), publishing_dir(out) as staging:
        (staging / "half").write_text("")
        raise OSError("disk full")
    assert sorted(os.listdir(out)) == ["config.json"] and sorted(os.listdir(tmp_path)) == ["export"]


def test_a_killed_writer_leaves_a_name_that_cleanup_recognises(tmp_path, monkeypatch):
    """The names written just before the rename (where a kill leaves them) and a staging
    directory never finished are all recognised; no final name is."""
    left = []

    def killed_before_rename(src, dst):
        left.append(Path(src).name)
        raise OSError("killed")

    monkeypatch.setattr(os, "replace", killed_before_rename)
    for name in ("state.json", "inverse.npy", "part_00001_of_00004.hdf5"):
        with contextlib.suppress(OSError):
            write_text(tmp_path / name, "x")
    staging = publishing_dir(tmp_path / "task_00003")
    staging.__enter__()  # a staging directory, never published (kept open: no cleanup ran)
    left += os.listdir(tmp_path)
    assert len(left) == 4
    assert left and all(is_temporary(n) for n in left), left
    finals = ["state.json", "inverse.npy", "part_00001_of_00004.hdf5", "task_00003", "tmp1", "a.tmp"]
    assert not any(is_temporary(n) for n in finals)


def test_publish_moves_a_written_file_into_place(tmp_path):
    tmp = tmp_path / "staged.hdf5"
    tmp.write_bytes(b"shard")
    (tmp_path / "train").mkdir()
    publish(tmp, tmp_path / "train" / "part.hdf5")
    assert (tmp_path / "train" / "part.hdf5").read_bytes() == b"shard" and not tmp.exists()


def test_digests_stream_the_file(tmp_path, monkeypatch):
    data = os.urandom(3 * (1 << 20) + 17)
    path = tmp_path / "shard.hdf5"
    path.write_bytes(data)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail("read the whole file into memory"))
    assert file_digest(path) == hashlib.md5(data).hexdigest()
    assert file_digest(path, "sha256") == hashlib.sha256(data).hexdigest()


def test_vocab_md5_of_the_mlperf_dataset_is_streamed(tmp_path, monkeypatch):
    """The dataset builder recorded the vocabulary's md5 by reading the file whole."""
    from data.prepare import mlperf_dataset

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n")
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"{self}: read whole"))
    md5 = hashlib.md5(b"[PAD]\n[UNK]\n").hexdigest()
    assert mlperf_dataset.file_digest(vocab) == md5
    assert not hasattr(mlperf_dataset, "_md5")


# ---- no file is published by hand ---------------------------------------------------------


def hand_renames(source: str) -> list[int]:
    """Lines that rename a file by hand: ``os.replace``/``os.rename``/``shutil.move``, or a
    ``Path.replace``/``Path.rename`` (one argument: ``str.replace`` takes two)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        attr = node.func.attr
        if (owner, attr) in (("os", "replace"), ("os", "rename"), ("os", "renames"), ("shutil", "move")):
            lines.append(node.lineno)
        elif attr in ("replace", "rename") and len(node.args) == 1 and not node.keywords and owner != "os":
            lines.append(node.lineno)
    return lines


def test_every_file_is_published_through_common_files():
    files = [REPO / "run_pretraining.py"] + [p for pkg in PROJECT for p in sorted((REPO / pkg).rglob("*.py"))]
    offenders = [
        f"{p.relative_to(REPO)}:{line}: {p.read_text().splitlines()[line - 1].strip()}"
        for p in files
        for line in hand_renames(p.read_text())
    ]
    assert not offenders, "renames by hand (use files.publishing / write_text / publish):\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "source, lines",
    [
        ("os.replace(tmp, path)\nos.rename(a, b)\n", [1, 2]),
        ("tmp.replace(path)\ntmp.rename(path)\nshutil.move(a, b)\n", [1, 2, 3]),
        ("name.replace('-', '_')\ncfg = dataclasses.replace(cfg, x=1)\nreplace(cfg, x=2)\n", []),
    ],
)
def test_the_rename_check_finds_each_spelling(source, lines):
    assert hand_renames(source) == lines


def test_open_checked_refuses_what_is_not_a_regular_file_at_once(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it for reading in blocking mode would wait for a writer forever
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "big").write_bytes(b"y" * 11)
    cases = {
        fifo: "a FIFO",
        tmp_path / "zero": "a device",
        tmp_path: "a directory",
        tmp_path / "big": "11 bytes, over the 10",
    }
    for path, rule in cases.items():
        with pytest.raises(files.UnsafeFile) as e:
            files.read_checked(path, max_bytes=10, what="test file")
        assert rule in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(files.UnsafeFile, match="a device"):
        files.file_digest(tmp_path / "zero")  # was: hashing /dev/zero forever
    (tmp_path / "ok").write_bytes(b"0123456789")
    assert files.read_checked(tmp_path / "ok", max_bytes=10) == b"0123456789"
    with pytest.raises(FileNotFoundError):
        files.read_checked(tmp_path / "missing", max_bytes=10)
