"""HDF5 readers/writers for the fixed and varlength layouts, their validation (every bad
file named with the sample), data.prepare.convert round trips and data.prepare.stats."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from common.errors import DataError, cli_main
from data.hdf5io import inspect, read_file, to_fixed_arrays, write_fixed, write_packed, write_varlength
from data.prepare.convert import main as convert_main
from data.prepare.stats import main as stats_main
from data.prepare.stats import shard_stats
from data.synthetic import random_block
from tests.helpers import REPO

S, P, V = 48, 8, 500


@pytest.fixture
def block():
    return random_block(40, seed=11, max_seq_length=S, max_predictions=P, vocab_size=V)


def test_fixed_round_trip_and_mlperf_arrays(block, tmp_path):
    path = tmp_path / "f.hdf5"
    write_fixed(path, block, S, P)
    got = read_file(path, vocab_size=V)
    assert got.equals(block)
    for name, dtype in (
        ("input_ids", np.int32),
        ("segment_ids", np.int8),
        ("seq_lens", np.int32),
        ("masked_positions", np.int32),
        ("masked_ids", np.int32),
        ("masked_counts", np.int32),
        ("nsp_labels", np.int8),
    ):
        assert getattr(got, name).dtype == dtype
    with h5py.File(path) as f:
        mask = f["input_mask"][...]
        np.testing.assert_array_equal(mask.sum(1), block.seq_lens)
        # Unused masked slots are 0, used ones come first.
        mpos = f["masked_lm_positions"][...]
        assert ((mpos != 0).sum(1) == block.masked_counts).all()
    info = inspect(path)
    assert (info.layout, info.num_samples, info.max_seq_length, info.max_predictions) == ("fixed", 40, S, P)


def test_varlength_round_trip(block, tmp_path):
    path = tmp_path / "v.hdf5"
    write_varlength(path, block, S, P)
    assert read_file(path, vocab_size=V).equals(block)
    with h5py.File(path) as f:
        assert "input_mask" not in f
        for key, base in (
            ("input_ids", np.int16),
            ("segment_ids", np.int8),
            ("masked_lm_positions", np.int16),
            ("masked_lm_ids", np.int16),
        ):
            assert h5py.check_vlen_dtype(f[key].dtype) == base
        assert f["next_sentence_labels"].dtype == np.int8
    info = inspect(path)
    assert (info.layout, info.num_samples, info.max_seq_length, info.max_predictions) == ("varlength", 40, S, P)


def test_a_block_of_one_sample_round_trips_in_every_layout(block, tmp_path):
    # h5py reads a list of one row as a 2-D array that the (1,) dataset cannot take.
    one = block.select(np.arange(1))
    for name, write in (("f", write_fixed), ("v", write_varlength), ("p", write_packed)):
        write(tmp_path / f"{name}.hdf5", one, S, P)
        got = read_file(tmp_path / f"{name}.hdf5", vocab_size=V)
        assert got.equals(one), name


def test_row_ranges_and_identical_bytes(block, tmp_path):
    a, b = tmp_path / "a.hdf5", tmp_path / "b.hdf5"
    write_fixed(a, block, S, P)
    write_fixed(b, block, S, P)
    assert a.read_bytes() == b.read_bytes()
    assert read_file(a, start=7, stop=19).equals(block.select(np.arange(7, 19)))
    write_varlength(a, block)
    assert read_file(a, start=30).equals(block.select(np.arange(30, 40)))
    assert not list(tmp_path.glob(".*tmp*"))


def test_convert_round_trip_is_lossless(block, tmp_path, capsys):
    src = tmp_path / "in"
    src.mkdir()
    write_fixed(src / "part_00000_of_00002.hdf5", block, S, P)
    write_fixed(src / "part_00001_of_00002.hdf5", block.select(np.arange(5)), S, P)
    assert cli_main(convert_main, [str(src), str(tmp_path / "var"), "--to", "varlength"]) == 0
    assert cli_main(convert_main, [str(tmp_path / "var"), str(tmp_path / "back"), "--to", "fixed"]) == 0
    for f in src.iterdir():
        assert read_file(tmp_path / "var" / f.name).equals(read_file(f))
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes()
    # Without recorded sizes the fixed layout needs them on the command line.
    with h5py.File(tmp_path / "var" / "part_00000_of_00002.hdf5", "a") as h:
        del h.attrs["max_seq_length"]
    code = cli_main(
        convert_main, [str(tmp_path / "var" / "part_00000_of_00002.hdf5"), str(tmp_path / "x.hdf5"), "--to", "fixed"]
    )
    assert code == 2 and "pass --max-seq-length and --max-predictions" in capsys.readouterr().err
    code = cli_main(
        convert_main,
        [
            str(tmp_path / "var" / "part_00000_of_00002.hdf5"),
            str(tmp_path / "x.hdf5"),
            "--to",
            "fixed",
            "--max-seq-length",
            "30",
            "--max-predictions",
            str(P),
        ],
    )
    err = capsys.readouterr().err
    assert code == 2 and "tokens, more than max_seq_length 30" in err and not (tmp_path / "x.hdf5").exists()


# --------------------------------------------------------------------- bad files


def _fixed_file(tmp_path, block, edit=None) -> Path:
    path = tmp_path / "bad.hdf5"
    arrays = to_fixed_arrays(block, S, P)
    if edit:
        edit(arrays)
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f.create_dataset(k, data=v)
    return path


def _first_masked_row(arrays):
    return int(np.flatnonzero(arrays["masked_lm_positions"][:, 0])[0])


def _bad_cases():
    def drop(key):
        return lambda a: a.pop(key)

    def retype(key, dtype):
        def f(a):
            a[key] = a[key].astype(dtype)

        return f

    def set_id(a):
        a["input_ids"][5, 1] = V + 3

    def set_negative(a):
        a["input_ids"][6, 0] = -1

    def past_end(a):
        n = int(a["input_mask"][9].sum())
        k = int((a["masked_lm_positions"][9] != 0).sum())
        a["masked_lm_positions"][9, k - 1] = n + 2  # the last used slot, still increasing

    def bad_label(a):
        a["masked_lm_ids"][3, 0] = V

    def bad_nsp(a):
        a["next_sentence_labels"][12] = 2

    def bad_mask(a):
        a["input_mask"][4, 0] = 0

    def bad_segment(a):
        a["segment_ids"][8, 1] = 3

    def hole(a):
        a["masked_lm_positions"][2, 0] = 0

    def shape(a):
        a["segment_ids"] = a["segment_ids"][:, :-1]

    return [
        ("missing_key", drop("masked_lm_ids"), "missing key 'masked_lm_ids' (fixed layout)"),
        ("wrong_dtype", retype("input_ids", np.float32), "input_ids has dtype float32, expected an integer type"),
        ("wrong_shape", shape, f"segment_ids has shape (40, {S - 1}), expected (40, {S})"),
        ("id_outside_vocab", set_id, f"sample 5: input_ids holds {V + 3}, outside the vocabulary's {V} entries"),
        ("negative_id", set_negative, "sample 6: input_ids holds -1"),
        ("masked_past_end", past_end, "sample 9: masked position"),  # + "past the sequence end"
        ("label_outside_vocab", bad_label, f"sample 3: masked_lm_ids holds {V}"),
        ("nsp_label", bad_nsp, "sample 12: next_sentence_labels is 2, expected 0 or 1"),
        ("mask_not_prefix", bad_mask, "sample 4: input_mask is not a prefix of ones"),
        ("segment_id", bad_segment, "sample 8: segment_ids holds 3"),
        ("masked_hole", hole, "sample 2: masked_lm_positions has a nonzero entry after the first 0"),
    ]


@pytest.mark.parametrize("name,edit,want", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_fixed_files_are_rejected_with_file_and_sample(block, tmp_path, capsys, name, edit, want):
    path = _fixed_file(tmp_path, block, edit)
    with pytest.raises(DataError) as e:
        read_file(path, vocab_size=V)
    assert str(e.value).startswith(f"{path}: ") and want in str(e.value)
    if name == "masked_past_end":
        assert "past the sequence end" in str(e.value)
    # The stats CLI prints it as one line and exits with 2 (it checks ids against the
    # vocabulary only when a manifest gives its size).
    code = cli_main(stats_main, [str(path)])
    err = capsys.readouterr().err
    if "outside the vocabulary" in want or name == "label_outside_vocab":
        assert code == 0
    else:
        assert code == 2 and err.count("\n") == 1 and want in err


def test_bad_varlength_files(block, tmp_path):
    path = tmp_path / "v.hdf5"
    write_varlength(path, block)
    with h5py.File(path, "a") as f:
        ids = f["masked_lm_positions"][...]
        ids[7] = np.array([1, 2, 200], np.int16)
        f["masked_lm_positions"][7] = ids[7]
        f["masked_lm_ids"][7] = np.array([5, 6, 7], np.int16)
    with pytest.raises(DataError, match=rf"^{path}: sample 7: masked position 200 is past the sequence end"):
        read_file(path)
    write_varlength(path, block)
    with h5py.File(path, "a") as f:
        f["segment_ids"][3] = np.zeros(2, np.int8)
    with pytest.raises(DataError, match=rf"^{path}: sample 3: segment_ids has 2 entries, input_ids has"):
        read_file(path)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_truncated_or_corrupt_files(block, tmp_path, capsys, damage):
    good = tmp_path / "good.hdf5"
    write_fixed(good, block, S, P)
    raw = good.read_bytes()
    path = tmp_path / "part_00000_of_00001.hdf5"
    path.write_bytes(
        {"truncated": raw[: len(raw) // 2], "garbage": b"\x89HDF\r\n" + bytes(range(256)) * 8, "empty": b""}[damage]
    )
    with pytest.raises(DataError, match=rf"^{path}: (not a readable HDF5 file|cannot read sample data)"):
        read_file(path)
    assert cli_main(stats_main, [str(tmp_path / "part_00000_of_00001.hdf5")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(path) in err


def test_truncated_data_is_caught_when_read(block, tmp_path):
    # A file cut inside the sample data: the header still opens, reading fails.
    good = tmp_path / "good.hdf5"
    write_fixed(good, block, S, P)
    raw = good.read_bytes()
    path = tmp_path / "cut.hdf5"
    path.write_bytes(raw[: len(raw) - 200])
    with pytest.raises(DataError, match=rf"^{path}: "):
        read_file(path)


@pytest.mark.timeout(60)
def test_stats_cli_process(tmp_path):
    d = tmp_path / "train"
    d.mkdir()
    blk = random_block(64, seed=2, max_seq_length=S, max_predictions=P, vocab_size=V)
    write_fixed(d / "part_00000_of_00002.hdf5", blk.select(np.arange(30)), S, P)
    write_varlength(d / "part_00001_of_00002.hdf5", blk.select(np.arange(30, 64)), S, P)
    png = tmp_path / "h.png"
    p = subprocess.run(
        [sys.executable, "-m", "data.prepare.stats", str(d), "--png", str(png)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    assert f"{d}: 2 file(s), fixed/varlength layout, 64 samples, {blk.num_tokens} tokens" in p.stdout
    ratio = S * 64 / blk.num_tokens
    assert f"padding ratio (max_seq_length x samples / tokens): {ratio:.3f}" in p.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    s = shard_stats(sorted(d.iterdir()))
    assert s["samples"] == 64 and sum(s["histogram"]["counts"]) == 64
    assert s["length"]["mean"] == pytest.approx(blk.seq_lens.mean())
    assert s["masked_per_sample"]["mean"] == pytest.approx(blk.masked_counts.mean())
    bad = tmp_path / "nothing"
    p = subprocess.run([sys.executable, "-m", "data.prepare.stats", str(bad)], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr == f"error: {bad}: no such file or directory\n"
