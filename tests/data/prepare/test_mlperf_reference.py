"""data.prepare.mlperf_reference, data.prepare.mlperf_dataset and data.prepare.verify against MLPerf's
reference preprocessing.

The golden files in fixtures/mlperf_reference/ were made by running NVIDIA's reference
scripts (create_pretraining_data.py, chop, convert_fixed2variable, shuffle_indices/samples,
pick_eval_samples, hdf5_md5) on the small text there (accents, CJK, odd punctuation and
control characters, long and one-sentence documents, blank-line runs, CRLF and lone CR):
``make_fixtures.py`` says how. Every file our pipeline writes must have the content digest of
the reference's file at the same path, and pass the reference's checksum lists.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from common.errors import DataError, cli_main
from data.prepare.mlperf_dataset import DatasetConfig, Layout, _checks, build, chop_sizes, shuffle_permutation
from data.prepare.mlperf_reference import RefParams, RefTokenizer, RefVocab, read_documents
from data.prepare.verify import main as verify_main
from data.prepare.verify import shard_checksum

FIX = Path(__file__).resolve().parent / "fixtures" / "mlperf_reference"
TEXT, VOCAB = FIX / "text", FIX / "vocab.txt"


def content_digest(path) -> str:
    """md5 over every dataset of an HDF5 file: name, dtype, shape and values (row by row for
    variable-length data), in name order: stronger than NVIDIA's checksum, which reads input_ids only."""
    h = hashlib.md5()
    with h5py.File(path, "r") as f:
        for name in sorted(f.keys()):
            ds = f[name]
            base = h5py.check_vlen_dtype(ds.dtype)
            h.update(f"{name}|{(base or ds.dtype).str}|{'vlen' if base is not None else ''}|{ds.shape}|".encode())
            if base is None:
                h.update(np.ascontiguousarray(ds[()]).tobytes())
                continue
            for row in ds[()]:
                row = np.ascontiguousarray(row, dtype=base)
                h.update(len(row).to_bytes(8, "little") + row.tobytes())
    return h.hexdigest()


def _expected(name: str) -> dict:
    return json.loads((FIX / name / "expected.json").read_text())


def _config(name: str, out: Path, **kw) -> DatasetConfig:
    c = _expected(name)["config"]
    params = RefParams(
        max_seq_length=c["max_seq_length"], max_predictions=c["max_predictions"], dupe_factor=c["dupe_factor"]
    )
    args = {
        "text_dir": str(TEXT),
        "eval_text": str(TEXT / "eval.txt"),
        "vocab": str(VOCAB),
        "output_dir": str(out),
        "shards": c["shards"],
        "params": params,
        "eval_samples": c["eval_samples"],
        "checksums": str(FIX / name),
    }
    return DatasetConfig(**(args | kw))


def _mismatches(name: str, out: Path) -> list[str]:
    bad = []
    for rel, digest in _expected(name)["files"].items():
        p = out / "hdf5" / rel
        if not p.exists():
            bad.append(f"{rel} missing")
        elif content_digest(p) != digest:
            bad.append(f"{rel} differs")
    return bad


@pytest.fixture(scope="module")
def s128(tmp_path_factory):
    """The 128/20 pipeline, the shuffle in groups of ~1000 samples (several scatter and gather tasks)."""
    out = tmp_path_factory.mktemp("s128")
    result = build(_config("s128", out, group_rows=1000), log=lambda m: None)
    return out, result


def test_every_file_equals_the_reference_pipelines_at_128(s128):
    out, result = s128
    assert _mismatches("s128", out) == []
    # The reference's checksum lists were checked by build itself.
    assert sorted(Path(p).name for p in result["verified"]) == [
        "7_shards_varlength.chk",
        "7_shards_varlength_shuffled.chk",
        "eval_varlength.chk",
    ]
    with h5py.File(out / "hdf5/training/part-00000-of-00500.hdf5") as f:
        assert {k: (f[k].dtype.str, f[k].shape[1:]) for k in f} == {
            "input_ids": ("<i2", (128,)),
            "input_mask": ("|i1", (128,)),
            "segment_ids": ("|i1", (128,)),
            "masked_lm_positions": ("<i2", (20,)),
            "masked_lm_ids": ("<i2", (20,)),
            "next_sentence_labels": ("|i1", ()),
        }


def test_every_file_equals_the_reference_pipelines_at_512(tmp_path):
    result = build(_config("s512", tmp_path), log=lambda m: None)
    assert _mismatches("s512", tmp_path) == []
    assert len(result["verified"]) == 3


@pytest.mark.slow  # two worker processes
def test_restart_redoes_only_what_is_missing_and_in_parallel(s128, tmp_path):
    src, _ = s128
    out = tmp_path / "run"
    shutil.copytree(src, out)
    layout = Layout(out / "hdf5", 7)
    removed = [
        layout.training / "part-00001-of-00500.hdf5",
        layout.stage_dir("chop") / "part_00003_of_00007.hdf5",
        layout.stage_dir("varlength") / "part_00006_of_00007.hdf5",
        layout.stage_dir("shuffled") / "part_00000_of_00007.hdf5",
        layout.stage_dir("shuffled") / "part_00004_of_00007.hdf5",
        out / "hdf5/eval_varlength/part_eval_10k.hdf5",
        out / "hdf5/eval/part_eval_10k.hdf5",
    ]
    for p in removed:
        p.unlink()
    # What a killed writer leaves behind is a temporary name, never the final one.
    stray = layout.stage_dir("shuffled") / ".part_00000_of_00007.hdf5.tmp999"
    stray.write_bytes(b"half")
    kept = layout.stage_dir("chop") / "part_00000_of_00007.hdf5"
    before = kept.stat().st_mtime_ns
    build(_config("s128", out, workers=2, group_rows=700), log=lambda m: None)
    assert _mismatches("s128", out) == []
    assert kept.stat().st_mtime_ns == before  # finished files are not redone
    assert not stray.exists()


def test_a_finished_file_that_changed_fails_the_checksums(s128, tmp_path):
    src, _ = s128
    out = tmp_path / "run"
    shutil.copytree(src, out)
    shard = Layout(out / "hdf5", 7).stage_dir("shuffled") / "part_00003_of_00007.hdf5"
    with h5py.File(shard, "r+") as f:
        row = f["input_ids"][0]
        row[1] ^= 1
        f["input_ids"][0] = row
    with pytest.raises(
        DataError,
        match=r"1 file\(s\) differ from the published checksums:\n  shuffled: .*"
        r"part_00003_of_00007.hdf5: checksum",
    ):
        build(_config("s128", out), log=lambda m: None)


def test_a_restart_with_other_parameters_is_refused(s128, tmp_path):
    src, _ = s128
    shutil.copytree(src, tmp_path / "run")
    cfg = _config("s128", tmp_path / "run")
    cfg.params = RefParams(max_seq_length=128, max_predictions=20, dupe_factor=9)
    with pytest.raises(DataError, match="made with other params"):
        build(cfg, log=lambda m: None)


def test_verify_accepts_the_reference_checksums_and_names_a_changed_or_missing_shard(s128, tmp_path, capsys):
    out, _ = s128
    layout = Layout(out / "hdf5", 7)
    chk = FIX / "s128" / "7_shards_varlength.chk"
    assert verify_main([str(layout.stage_dir("varlength")), "--checksums", str(chk)]) == 0
    d = tmp_path / "shards"
    shutil.copytree(layout.stage_dir("varlength"), d)
    with h5py.File(d / "part_00002_of_00007.hdf5", "r+") as f:
        row = f["input_ids"][5]
        row[3] += 1  # one token of one sample
        f["input_ids"][5] = row
    (d / "part_00005_of_00007.hdf5").unlink()
    capsys.readouterr()
    assert verify_main([str(d), "--checksums", str(chk)]) == 1
    err = capsys.readouterr().err
    assert "part_00002_of_00007.hdf5: checksum" in err and "part_00005_of_00007.hdf5: missing" in err
    assert "part_00001" not in err and "2 of 7 file(s)" in err


def test_checksum_is_nvidias_construction(s128):
    import hashlib

    out, _ = s128
    path = out / "hdf5/eval_varlength/part_eval_10k.hdf5"
    with h5py.File(path) as f:
        rows = [hashlib.md5(str(r.tolist()).encode()).hexdigest() for r in f["input_ids"][:]]
    assert shard_checksum(path) == hashlib.md5(str(rows).encode()).hexdigest()
    assert (FIX / "s128/eval_varlength.chk").read_text().split() == ["part_eval_10k.hdf5", shard_checksum(path)]


def test_published_checksums_apply_only_with_mlperfs_shards_and_parameters(tmp_path):
    def names(**kw):
        cfg = DatasetConfig(text_dir="t", eval_text="e", vocab="v", output_dir=str(tmp_path), **kw)
        return sorted(p.name for _, p in _checks(cfg))

    assert names(shards=4320) == [
        "4320_shards_varlength.chk",
        "4320_shards_varlength_shuffled.chk",
        "eval_varlength.chk",
    ]
    assert names(shards=2048) == ["2048_shards_varlength.chk", "eval_varlength.chk"]
    assert names(shards=100) == ["eval_varlength.chk"]
    assert names(shards=4320, params=RefParams(dupe_factor=5)) == []
    assert names(shards=4320, eval_samples=500) == ["4320_shards_varlength.chk", "4320_shards_varlength_shuffled.chk"]
    lines = (
        Path(__file__).resolve().parents[3] / "data/prepare/checksums/4320_shards_varlength_shuffled.chk"
    ).read_text()
    assert len(lines.splitlines()) == 4320


def test_prepare_reference_cli_writes_the_reference_file(tmp_path, capsys):
    from data.prepare.shards import main as prepare_main

    part = TEXT / "part-00001-of-00500"
    args = [
        "--reference",
        "--input",
        str(part),
        "--vocab",
        str(VOCAB),
        "--output-dir",
        str(tmp_path),
        "--max-seq-length",
        "128",
        "--max-predictions",
        "20",
    ]
    assert cli_main(prepare_main, args) == 0
    assert (
        content_digest(tmp_path / (part.name + ".hdf5"))
        == _expected("s128")["files"]["training/part-00001-of-00500.hdf5"]
    )
    capsys.readouterr()
    assert cli_main(prepare_main, args + ["--shards", "3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --reference does not take --shards (it writes one "
        "fixed-layout file per input file, as the reference script does)"
    )


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    from data.prepare.mlperf_dataset import main as dataset_main

    base = [
        "--eval-text",
        str(TEXT / "eval.txt"),
        "--vocab",
        str(VOCAB),
        "--output-dir",
        str(tmp_path),
        "--shards",
        "4",
    ]
    assert cli_main(dataset_main, ["--text-dir", str(tmp_path / "nope")] + base) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nope'}: no such directory\n"
    (tmp_path / "bad.txt").write_text("[PAD]\n[CLS]\n")
    assert (
        cli_main(dataset_main, ["--text-dir", str(TEXT)] + base[:2] + ["--vocab", str(tmp_path / "bad.txt")] + base[4:])
        == 2
    )
    assert "vocabulary is missing [UNK], [SEP], [MASK]" in capsys.readouterr().err
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("one line.\n\ncaf\xe9 au lait.\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt: line 3: not UTF-8$"):
        read_documents(bad, RefTokenizer(RefVocab(VOCAB)))


def test_ascii_lines_tokenize_the_same_through_tokenizers_and_python():
    """The tokenizers library is used for pure-ASCII lines only: there it equals the
    reference-behaviour Python tokenizer, control characters and long words included."""
    tok = RefTokenizer(RefVocab(VOCAB))
    rng = random.Random(5)
    alphabet = [chr(c) for c in range(128)]
    lines = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))) for _ in range(1500)]
    lines += ["a" * 199 + " " + "b" * 200 + " " + "c" * 201, "[UNK] [CLS] [SEP] [MASK] ##s", "U.S.A. 3.14 it's"]
    lines += [
        s.strip() for f in sorted(TEXT.iterdir()) for s in f.read_text(encoding="utf-8").splitlines() if s.isascii()
    ]
    hf = tok.encode_many(lines)
    assert [tok.encode_python(s) for s in lines] == hf
    # ...and not on all text: tokenizers drops private-use characters, the reference keeps them.
    s = "priv\ue000ate"
    assert tok._hf.encode(s, add_special_tokens=False).ids != tok.encode_python(s)
    assert tok.encode_many([s]) == [tok.encode_python(s)] == [[tok.unk]]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 10, 1000])
def test_shuffle_permutation_is_the_reference_shuffle_of_shard_index_pairs(n):
    sizes = [n // 3, n - 2 * (n // 3), n // 3]
    pairs = [(s, i) for s, size in enumerate(sizes) for i in range(size)]
    random.Random(24).shuffle(pairs)
    flat = {p: g for g, p in enumerate((s, i) for s, size in enumerate(sizes) for i in range(size))}
    assert shuffle_permutation(n).tolist() == [flat[p] for p in pairs]


def test_chop_sizes_take_the_excess_from_the_first_shards():
    assert chop_sizes(23, 5).tolist() == [4, 4, 5, 5, 5]
    assert chop_sizes(20, 5).tolist() == [4, 4, 4, 4, 4]  # the reference fails here; equal shards
    with pytest.raises(DataError, match="too few for --shards 5"):
        chop_sizes(9, 5)


def test_the_trainer_loaders_read_the_pipeline_output_unpadded_and_packed(s128, tmp_path):
    from data.collate import collate_unpadded
    from data.hdf5io import read_file
    from data.loader import EvalLoader, PretrainingLoader
    from data.prepare.convert import main as convert_main

    out, _ = s128
    shuffled = Layout(out / "hdf5", 7).stage_dir("shuffled")
    all_samples = [read_file(f) for f in sorted(shuffled.iterdir())]
    total = sum(len(b) for b in all_samples)
    g = 64
    loader = PretrainingLoader(shuffled, g, prefetch=False, seed=1)
    steps = loader.steps_per_epoch
    assert steps == total // g
    blocks = list(itertools.islice(iter(loader), steps))  # one epoch
    batch = collate_unpadded(blocks[0])
    assert int(batch.cu_seqlens[-1]) == len(batch.input_ids) == blocks[0].num_tokens

    def keys(bs):
        return sorted(hash(b.select([i]).input_ids.tobytes()) for b in bs for i in range(len(b)))

    assert set(keys(blocks)) <= set(keys(all_samples))
    assert len(keys(blocks)) == steps * g
    # Packed, after data.prepare.convert: the same samples.
    packed = tmp_path / "packed"
    assert cli_main(convert_main, [str(shuffled), str(packed), "--to", "packed", "--max-seq-length", "128"]) == 0
    assert keys([read_file(f) for f in sorted(packed.iterdir())]) == keys(all_samples)
    ploader = PretrainingLoader(packed, g, prefetch=False, seed=1)
    assert ploader.steps_per_epoch == steps and len(ploader.global_batch(0)) == g
    ev = EvalLoader(out / "hdf5/eval_varlength/part_eval_10k.hdf5", batch_size=64)
    assert ev.num_samples == 300 and np.array_equal(
        ev.block.seq_lens, read_file(out / "hdf5/eval_varlength/part_eval_10k.hdf5").seq_lens
    )
