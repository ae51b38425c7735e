"""HDF5 shards made to hurt the reader: sizes declared far beyond the file, sequences longer than
the run's max_seq_length in a later shard, scalar datasets, data kept outside the file, a FIFO.
Each is refused in one line naming the file (and the sample), before anything large is read."""

from __future__ import annotations

import os
import time

import h5py
import numpy as np
import pytest

from common.errors import DataError
from data.hdf5io import inspect, read_file, write_varlength
from data.loader import PretrainingLoader
from data.synthetic import random_block

VLEN16, VLEN8 = h5py.vlen_dtype(np.int16), h5py.vlen_dtype(np.int8)


def _declared_only(path, layout: str, n: int) -> None:
    """Datasets of n rows that are declared but never written: the file stays a few KB."""
    with h5py.File(path, "w") as f:
        if layout == "fixed":
            for key, shape, dtype in (
                ("input_ids", (n, 512), np.int16),
                ("input_mask", (n, 512), np.int8),
                ("segment_ids", (n, 512), np.int8),
                ("masked_lm_positions", (n, 76), np.int16),
                ("masked_lm_ids", (n, 76), np.int16),
                ("next_sentence_labels", (n,), np.int8),
            ):
                f.create_dataset(key, shape, dtype=dtype)
            return
        keys = ["input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids"]
        if layout == "packed":  # masked-LM only, as the packed shard that took inspect 7 s
            keys += ["packed_input_len", "packed_masked_lm_len"]
            f.attrs["next_sentence"] = np.int8(0)
        else:
            f.create_dataset("next_sentence_labels", (n,), dtype=np.int8)
        for key in keys:
            f.create_dataset(key, (n,), dtype=VLEN8 if key == "segment_ids" else VLEN16)


@pytest.mark.parametrize("layout", ["fixed", "varlength", "packed"])
def test_declared_sizes_beyond_the_file_are_refused_before_reading(tmp_path, layout):
    path = tmp_path / "part_00000_of_00001.hdf5"
    _declared_only(path, layout, 20_000_000)
    assert os.path.getsize(path) < 16_000
    start = time.monotonic()
    with pytest.raises(DataError, match=rf"^{path}: '\w+' declares shape \(20000000,?.*\) .* but the file stores 0; "):
        inspect(path)
    with pytest.raises(DataError, match="declares shape"):
        read_file(path)
    with pytest.raises(DataError, match="declares shape"):
        PretrainingLoader(tmp_path, 8)
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("length", [600, 100])
def test_every_shard_is_checked_against_max_seq_length(tmp_path, length):
    # MLPerf's varlength files carry no max_seq_length attribute; the second shard is read only
    # after the first one's steps, so a check of the first shard alone would miss it.
    good = random_block(16, seed=1, max_seq_length=64, max_predictions=8, vocab_size=100)
    long = random_block(16, seed=2, max_seq_length=length, max_predictions=8, vocab_size=100, min_len=length - 8)
    write_varlength(tmp_path / "part_00000_of_00002.hdf5", good)
    write_varlength(tmp_path / "part_00001_of_00002.hdf5", long)
    loader = PretrainingLoader(tmp_path, 8, lanes=1, prefetch=False, max_seq_length=64, vocab_size=100)
    want = r"part_00001_of_00002.hdf5: sample \d+ has \d+ tokens, more than max_seq_length 64$"
    with pytest.raises(DataError, match=want):
        for _ in zip(range(loader.steps_per_epoch), loader):
            pass
    skip = PretrainingLoader(tmp_path, 8, prefetch=False, max_seq_length=64, vocab_size=100, on_corrupt="skip")
    assert all(int(next(iter(skip)).seq_lens.max()) <= 64 for _ in range(4))


def test_scalar_external_linked_and_virtual_datasets_are_refused(tmp_path):
    block = random_block(4, seed=3, max_seq_length=32, max_predictions=4, vocab_size=100)
    path = tmp_path / "scalar.hdf5"
    write_varlength(path, block)
    with h5py.File(path, "a") as f:
        del f["input_ids"]
        f.create_dataset("input_ids", (), dtype=VLEN16)
    with pytest.raises(DataError, match=rf"^{path}: 'input_ids' is a scalar, expected one entry per sample$"):
        read_file(path)

    outside = tmp_path / "outside.bin"
    outside.write_bytes(bytes(8))
    path = tmp_path / "external.hdf5"
    write_varlength(path, block)
    with h5py.File(path, "a") as f:
        del f["next_sentence_labels"]
        f.create_dataset("next_sentence_labels", (4,), dtype=np.int8, external=[(str(outside), 0, 4)])
    with pytest.raises(DataError, match=rf"^{path}: 'next_sentence_labels' is stored in the external file .*; refused"):
        inspect(path)

    path = tmp_path / "link.hdf5"
    write_varlength(path, block)
    with h5py.File(path, "a") as f:
        del f["next_sentence_labels"]
        f["next_sentence_labels"] = h5py.ExternalLink(str(tmp_path / "fifo"), "/labels")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(DataError, match=rf"^{path}: 'next_sentence_labels' links to '.*fifo', outside this file"):
        inspect(path)

    path = tmp_path / "virtual.hdf5"
    write_varlength(path, block)
    with h5py.File(path, "a") as f:
        layout = h5py.VirtualLayout((4,), np.int8)
        layout[:] = h5py.VirtualSource(str(tmp_path / "elsewhere.hdf5"), "labels", shape=(4,))
        del f["next_sentence_labels"]
        f.create_virtual_dataset("next_sentence_labels", layout)
    with pytest.raises(DataError, match=rf"^{path}: 'next_sentence_labels' is a virtual dataset"):
        inspect(path)


def test_a_fifo_is_refused_at_once(tmp_path):
    path = tmp_path / "part_00000_of_00001.hdf5"
    os.mkfifo(path)
    start = time.monotonic()
    with pytest.raises(DataError, match=rf"^{path}: HDF5 file is a FIFO, not a regular file; refused$"):
        read_file(path)
    assert time.monotonic() - start < 1.0
