"""Hostile training checkpoints and transformers directories (issue 33): files that would hang the
run (FIFOs, ``/dev/zero``), DCP storage paths the manifest does not cover, unreadable records,
compressed records (decompression bombs), partial restores, malformed metadata, manifests and
counters. Each is refused at once in one line naming the file and the rule; a run that also
has an older good checkpoint names each refused one and resumes from the good one.

The sharded checkpoints are written as the code before the single-file format wrote them
(``old_dcp_dir``: torch.distributed.checkpoint's own ``save`` of the weights and the moments by
name, ``state.pt`` and ``MANIFEST.json``), then damaged the way an attacker who can also
rewrite the manifest would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import struct
import time
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

from bert import distributed_checkpoint as dc
from bert.checkpoint import training as tc
from bert.checkpoint.safe_load import CheckpointError, read_config_and_weights
from bert.model.config import BertConfig, ConfigError
from bert.model.pretraining import BertForPreTraining
from bert.optim.optimizers import param_groups_for
from tests.bert.checkpoint.test_tf_reader import PREFIX
from tests.faults.common import run_in_process, spawn_ranks, summary

BASE = ("train.max_steps=4", "checkpoint.interval_steps=2")
DATA = "__0_0.distcp"
EMBEDDING = "model/embeddings.word.weight"


def write_manifest(path, step: int, files: list[str] | None = None) -> None:
    """What an attacker who edits the files can also do: a manifest that matches them."""
    names = sorted(n for n in os.listdir(path) if n != tc.MANIFEST) if files is None else files
    entries = {}
    for name in names:
        data = open(os.path.join(path, name), "rb").read() if os.path.isfile(os.path.join(path, name)) else b""
        entries[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(os.path.join(path, tc.MANIFEST), "w") as f:
        json.dump({"format": "bert-sharded-checkpoint/1", "step": step, "files": entries}, f)


def old_dcp_dir(directory, step: int, good: dict) -> str:
    """The single-file checkpoint ``good`` as the previous code's sharded directory of ``step``."""
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=96))
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups_for(model, 0.01)
    ordered = [name_of[id(p)] for g in groups for p in g["params"]]
    tensors = {f"model/{k}": v for k, v in good["model"].items()}
    for index, moments in good["optimizer"]["state"].items():
        tensors |= {f"optim/{ordered[index]}/{k}": v for k, v in moments.items() if v.dim()}
    saved_groups = good["optimizer"]["param_groups"]
    plain = {k: v for k, v in good.items() if k not in ("model", "optimizer")}
    plain["counters"] = {**good["counters"], "step": step}
    plain["optimizer_groups"] = [
        {k: v for k, v in g.items() if k != "params"} | {"size": len(g["params"])} for g in saved_groups
    ]
    path = os.path.join(directory, f"step_{step:08d}")
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(path))
    tc.write_file(os.path.join(path, tc.STATE), plain)
    write_manifest(path, step)
    return path


def metadata(path):
    return dc.read_metadata(path)


def write_metadata(path, md, step: int) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    write_manifest(path, step)


def rewrite_records(path, step: int, change) -> None:
    """Rebuild the data file with ``change(key, record bytes)`` applied to each record."""
    md = metadata(path)
    raw = open(os.path.join(path, DATA), "rb").read()
    out = io.BytesIO()
    for index, info in sorted(md.storage_data.items(), key=lambda item: item[1].offset):
        record = change(index.fqn, raw[info.offset : info.offset + info.length])
        md.storage_data[index] = dataclasses.replace(info, offset=out.tell(), length=len(record))
        out.write(record)
    open(os.path.join(path, DATA), "wb").write(out.getvalue())
    write_metadata(path, md, step)


def compressed(key: str, record: bytes) -> bytes:
    """The embedding's record with its tensor data deflated (a small record that would inflate
    to any size), padded by a stored entry to the size its tensor needs."""
    if key != EMBEDDING:
        return record
    src, dst = zipfile.ZipFile(io.BytesIO(record)), io.BytesIO()
    with zipfile.ZipFile(dst, "w") as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info), zipfile.ZIP_DEFLATED if "/data/" in info.filename else 0)
        z.writestr("pad", os.urandom(len(record)))
    return dst.getvalue()


def garbage(key: str, record: bytes) -> bytes:
    return os.urandom(len(record)) if key == EMBEDDING else record


def stored_outside(path, step):
    """Every record read from a copy beside the directory; the data file left out of the manifest."""
    shutil.copy(os.path.join(path, DATA), os.path.join(path, "..", "elsewhere.distcp"))
    md = metadata(path)
    md.storage_data = {
        i: dataclasses.replace(s, relative_path="../elsewhere.distcp") for i, s in md.storage_data.items()
    }
    write_metadata(path, md, step)
    write_manifest(path, step, [n for n in os.listdir(path) if n not in (tc.MANIFEST, DATA)])


def symlinked_outside(path, step):
    shutil.move(os.path.join(path, DATA), os.path.join(path, "..", f"moved-{step}.distcp"))
    os.symlink(os.path.join("..", f"moved-{step}.distcp"), os.path.join(path, DATA))


def fifo_entry(path, step):
    os.mkfifo(os.path.join(path, "extra.bin"))
    write_manifest(path, step)


def dev_zero_entry(path, step):
    os.symlink("/dev/zero", os.path.join(path, "zeros.bin"))
    write_manifest(path, step)


def sixteen_bytes(path, step):
    """The data file replaced by 16 bytes of garbage under a valid manifest (DCP raised a
    CheckpointException, a BaseException, that no handler caught)."""
    open(os.path.join(path, DATA), "wb").write(os.urandom(16))
    write_manifest(path, step)


def empty_chunks(path, step):
    md = metadata(path)
    md.state_dict_metadata[EMBEDDING].chunks = []
    write_metadata(path, md, step)


def no_moment(path, step):
    md = metadata(path)
    del md.state_dict_metadata[next(k for k in md.state_dict_metadata if k.endswith("/exp_avg_sq"))]
    write_metadata(path, md, step)


def manifest_text(text):
    def damage(path, step):
        with open(os.path.join(path, tc.MANIFEST), "w") as f:
            f.write(text)

    return damage


def manifest_names_dotdot(path, step):
    manifest = json.load(open(os.path.join(path, tc.MANIFEST)))
    manifest["files"][".."] = {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    json.dump(manifest, open(os.path.join(path, tc.MANIFEST), "w"))


def no_step_counter(path, step):
    state = tc.read_file(os.path.join(path, tc.STATE))
    del state["counters"]["step"]
    tc.write_file(os.path.join(path, tc.STATE), state)
    write_manifest(path, step)


def metadata_bytes(data: bytes):
    def damage(path, step):
        open(os.path.join(path, ".metadata"), "wb").write(data)
        write_manifest(path, step)

    return damage


# A pickle whose allow-listed call raises KeyError, and one declaring a 2**50-byte string.
KEY_ERROR = b"ctorch.serialization\n_get_layout\n(Vnope\ntR."
HUGE_STRING = b"\x80\x04\x8d" + struct.pack("<Q", 1 << 50) + b"abc."
NEGATIVE_SIZE = pickle.dumps(
    Metadata({"x": TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([-1]), [])}, storage_data={})
)

# (damage, what the warning says), one sharded checkpoint each, newest first when tried.
HOSTILE_DIRS = [
    (stored_outside, "is stored in '../elsewhere.distcp', not a data file the manifest lists; refused"),
    (symlinked_outside, f"{DATA}: file leads outside"),
    (fifo_entry, "extra.bin: file is a FIFO, not a regular file; refused"),
    (dev_zero_entry, "zeros.bin: file leads outside"),
    (
        lambda p, s: rewrite_records(p, s, garbage),
        f"the record of '{EMBEDDING}' at (0, 0): not a readable torch.save archive",
    ),
    (lambda p, s: rewrite_records(p, s, compressed), "is compressed"),
    (sixteen_bytes, f"bytes at 0) cannot hold its 384 bytes inside {DATA}"),  # mlm_bias: 96 floats
    (empty_chunks, f"the chunks of '{EMBEDDING}' hold 0 elements, the tensor 12288: every element must be stored once"),
    (no_moment, "missing optim/embeddings.word.weight/exp_avg_sq"),
    (metadata_bytes(KEY_ERROR), ".metadata: not DCP metadata (KeyError: 'nope')"),
    (metadata_bytes(HUGE_STRING), ".metadata: not DCP metadata (UnpicklingError"),
    (manifest_text("[]"), "MANIFEST.json: not a sharded training checkpoint's manifest"),
    (manifest_text("[" * 100_000), "MANIFEST.json: not readable JSON"),
    (manifest_names_dotdot, "MANIFEST.json: 'files' names '..', not a file of this directory"),
    (no_step_counter, "counter 'step' is None, not an integer >= 0"),
]


def test_every_hostile_checkpoint_is_named_at_once_and_the_good_one_resumes(dataset, good_run, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(good_run, out)
    checkpoints = out / "checkpoints"
    good = tc.read(str(checkpoints / "step_00000002.pt"))
    expected = {}
    for step, (damage, message) in enumerate(HOSTILE_DIRS, start=3):
        path = old_dcp_dir(checkpoints, step, good)
        damage(path, step)
        expected[path] = message
    step = 3 + len(HOSTILE_DIRS)
    os.mkfifo(checkpoints / f"step_{step:08d}.pt")
    os.symlink("/dev/zero", checkpoints / f"step_{step + 1:08d}.pt")
    expected[str(checkpoints / f"step_{step:08d}.pt")] = "a checkpoint is a FIFO, not a regular file; refused"
    expected[str(checkpoints / f"step_{step + 1:08d}.pt")] = "a checkpoint is a device, not a regular file; refused"
    capsys.readouterr()
    started = time.monotonic()
    s = run_in_process(dataset, out, *BASE)
    printed = capsys.readouterr().out
    warnings = [line for line in printed.splitlines() if line.startswith("warning:")]
    for path, message in expected.items():
        named = [w for w in warnings if w.startswith((f"warning: {path}: ", f"warning: {path}/"))]
        assert len(named) == 1 and message in named[0], (path, message, "\n".join(warnings))
        assert named[0].endswith("; trying the previous checkpoint")
    assert len(warnings) == len(expected), warnings
    assert "resumed from step 2" in printed and s["steps"] == 4
    assert time.monotonic() - started < 60  # nothing waited on a FIFO or read /dev/zero


def test_an_old_sharded_checkpoint_is_read_whole(good_run, tmp_path):
    good = tc.read(str(good_run / "checkpoints" / "step_00000002.pt"))
    path = old_dcp_dir(tmp_path, 3, good)
    whole = dc.read_tensors(path, tc.verify_dir(path)["files"])
    for name, value in good["model"].items():
        assert torch.equal(whole[f"model/{name}"], value), name
    assert sum(k.startswith("optim/") for k in whole) == 2 * len(good["optimizer"]["state"])


def two_chunk_dir(tmp_path, chunks):
    """A DCP directory of one tensor x of 4 elements stored as the given (offset, size) chunks."""
    path = str(tmp_path / "two")
    dcp.save({"x": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(path))
    md = metadata(path)
    entry = md.state_dict_metadata["x"]
    out, storage = io.BytesIO(), {}
    for offset, size in chunks:
        start = out.tell()
        torch.save(torch.arange(float(offset), float(offset + size)), out)
        index = dc.MetadataIndex("x", torch.Size([offset]))
        storage[index] = dataclasses.replace(
            next(iter(md.storage_data.values())), offset=start, length=out.tell() - start
        )
    entry.chunks = [
        dataclasses.replace(entry.chunks[0], offsets=torch.Size([o]), sizes=torch.Size([n])) for o, n in chunks
    ]
    md.storage_data = storage
    open(os.path.join(path, DATA), "wb").write(out.getvalue())
    write_metadata(path, md, 1)
    return path


@pytest.mark.parametrize(
    "chunks, message",
    [
        ([(0, 2), (2, 2)], None),
        ([(0, 3), (1, 1)], "overlaps another chunk"),
        ([(0, 2), (2, 3)], "leaves the tensor's (4,)"),
        ([(0, 2)], "hold 2 elements, the tensor 4"),
    ],
    ids=["exact", "overlap", "beyond", "gap"],
)
def test_chunks_must_cover_every_element_once(tmp_path, chunks, message):
    path = two_chunk_dir(tmp_path, chunks)
    files = {DATA: {"bytes": os.path.getsize(os.path.join(path, DATA))}}
    if message is None:
        assert torch.equal(dc.read_tensors(path, files)["x"], torch.arange(4.0))
        return
    with pytest.raises(CheckpointError, match=re.escape(message)) as e:
        dc.read_tensors(path, files)
    assert str(e.value).startswith(path) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "data, message",
    [
        (KEY_ERROR, "KeyError: 'nope'"),
        (HUGE_STRING, "UnpicklingError: pickle data was truncated"),
        (b"\x80\x04]\x94.", "a list without dicts of tensors and storage"),
        (NEGATIVE_SIZE, "'x': its size or dtype is not a training checkpoint's"),
        (b"", "EOFError"),
        (b"cos\nsystem\n(Vtrue\ntR.", "refused os.system"),
    ],
    ids=["key-error", "huge-string", "a-list", "negative-size", "empty", "payload"],
)
def test_metadata_decoding_errors_are_one_line(tmp_path, data, message):
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(CheckpointError) as e:
        dc.tensor_shapes(str(tmp_path))
    assert str(e.value).startswith(f"{tmp_path / '.metadata'}: ") and message in str(e.value)
    assert "\n" not in str(e.value)


NO_TENSORS = {"model": {}, "optimizer": {"state": {}, "param_groups": []}, "counters": {}}


@pytest.mark.timeout(10)  # a regression blocks on the FIFO: failed by the timeout, not hung
@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: os.mkfifo(d / "step_00000003.pt"), "step_00000003.pt: a checkpoint is a FIFO"),
        (lambda d: os.symlink("/dev/zero", d / "step_00000003.pt"), "step_00000003.pt: a checkpoint is a device"),
        (lambda d: fifo_entry(old_dcp_dir(d, 3, NO_TENSORS), 3), "extra.bin: file is a FIFO"),
    ],
    ids=["fifo", "dev-zero", "fifo-in-manifest"],
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
    fifo_entry(old_dcp_dir(checkpoints, 3, tc.read(str(checkpoints / "step_00000002.pt"))), 3)
    os.symlink("/dev/zero", checkpoints / "step_00000004.pt")
    os.mkfifo(checkpoints / "step_00000005.pt")
    jobs = spawn_ranks(2, out, dataset, *BASE, log_dir=str(tmp_path))
    for rank, job in enumerate(jobs):
        assert job.wait(180, f"rank {rank}") == 0, job.output()[-4000:]
    log = jobs[0].output()
    for name, rule in [("step_00000005.pt", "is a FIFO"), ("step_00000004.pt", "is a device"), ("extra.bin", "FIFO")]:
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


def test_damaged_metadata_and_records_under_a_matching_manifest_are_one_line(tmp_path):
    """150 random byte edits (flips, cuts, insertions) of .metadata or the data file, the manifest
    rewritten to match: each read ends in its tensors or in one CheckpointError line, never
    another exception (the first such run found three: missing fields, zip version fields,
    multi-disk zip records)."""
    base = str(tmp_path / "base")
    tensors = {"model/a": torch.randn(6, 4), "model/b": torch.arange(5), "optim/a/exp_avg": torch.zeros(6, 4)}
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(base))
    tc.write_file(os.path.join(base, tc.STATE), {"counters": {"step": 1}})
    rng, outcomes = random.Random(0), {"read": 0, "refused": 0}
    for i in range(150):
        path = str(tmp_path / f"case{i}")
        shutil.copytree(base, path)
        target = os.path.join(path, rng.choice([".metadata", DATA]))
        raw = bytearray(open(target, "rb").read())
        for _ in range(rng.choice([1, 1, 2, 4, 16])):
            at = rng.randrange(len(raw) or 1)
            raw[at : at + rng.choice([1, 1, 8, 64])] = os.urandom(rng.choice([0, 1, 1, 8, 64]))
        open(target, "wb").write(bytes(raw))
        write_manifest(path, 1)
        try:
            dc.read_tensors(path, tc.read(path) and tc.verify_dir(path)["files"])
            outcomes["read"] += 1
        except CheckpointError as e:
            assert "\n" not in str(e) and str(e).startswith(path), str(e)
            outcomes["refused"] += 1
        shutil.rmtree(path)
    assert outcomes["refused"] > 75, outcomes
