"""data.prepare --objective mlm: whole documents as masked-LM-only samples, split at the
context length, from a WordPiece vocab or a ``tokenizers`` JSON (BPE), in the varlength and
packed layouts, read back by the loader into the batch types; and hostile input.

Every word of the synthetic corpus is one vocabulary entry, so the token count of each
document is known and the samples can be compared with the documents they come from.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest

from common.errors import DataError, cli_main
from data.collate import collate_unpadded
from data.hdf5io import inspect, read_file, write_varlength
from data.loader import PretrainingLoader
from data.packing import collate_packed
from data.prepare.shards import PrepareConfig, prepare
from data.prepare.shards import main as prepare_main
from data.samples import SampleBlock

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [f"w{i}" for i in range(300)]
VOCAB = SPECIALS + WORDS
CLS, SEP = VOCAB.index("[CLS]"), VOCAB.index("[SEP]")
SEQ = 16  # context: a piece holds SEQ - 2 = 14 document tokens
PIECE = SEQ - 2


def _docs(seed: int = 3) -> list[list[list[int]]]:
    """Documents (lists of sentences of word indices) of every length class that matters: one
    token, exactly one piece (a sample of exactly SEQ tokens), one token more than a piece,
    several pieces, and random ones."""
    rng = np.random.default_rng(seed)

    def doc(n: int) -> list[list[int]]:
        ids = rng.integers(0, len(WORDS), n).tolist()
        cuts = sorted(set(rng.integers(1, n, min(3, n - 1)).tolist())) if n > 1 else []
        return [ids[a:b] for a, b in zip([0, *cuts], [*cuts, n])]

    lengths = [1, PIECE, PIECE + 1, 3 * PIECE + 5, 2 * PIECE] + rng.integers(1, 60, 25).tolist()
    return [doc(int(n)) for n in lengths]


def _write(path: Path, docs, extra: str = "") -> Path:
    """bert format: a sentence per line, a blank line between documents; ``extra`` is appended
    as one more document (hostile text)."""
    parts = ["\n".join(" ".join(WORDS[i] for i in s) for s in d) for d in docs]
    path.write_text("\n\n".join(parts + ([extra] if extra else [])) + "\n")
    return path


def _config(src: Path, out: Path, **kw) -> PrepareConfig:
    args = dict(
        inputs=[str(src)],
        output_dir=str(out),
        objective="mlm",
        format="varlength",
        max_seq_length=SEQ,
        max_predictions=SEQ,
        masked_lm_prob=0.3,
        dupe_factor=2,
        seed=11,
        shards=2,
        eval_samples=0,
    )
    args.update(kw)
    if not any(k in args for k in ("vocab", "tokenizer", "train_vocab")):
        vocab = src.parent / "vocab.txt"
        vocab.write_text("\n".join(VOCAB) + "\n")
        args["vocab"] = str(vocab)
    return PrepareConfig(**args)


def _samples(out: Path, vocab_size: int = len(VOCAB)) -> SampleBlock:
    files = sorted((out / "train").glob("part_*.hdf5"))
    return SampleBlock.concat([read_file(f, vocab_size=vocab_size) for f in files])


def _originals(block: SampleBlock) -> list[tuple[int, ...]]:
    """Each sample's ids with the masked tokens put back."""
    ids = block.input_ids.copy()
    starts = np.concatenate([[0], np.cumsum(block.seq_lens)])
    owner_start = np.repeat(starts[:-1], block.masked_counts)
    ids[owner_start + block.masked_positions] = block.masked_ids
    return [tuple(ids[a:b].tolist()) for a, b in zip(starts[:-1], starts[1:])]


def _expected_pieces(docs, to_id) -> Counter:
    want: Counter = Counter()
    for d in docs:
        flat = [to_id(i) for s in d for i in s]
        for a in range(0, len(flat), PIECE):
            want[(CLS, *flat[a : a + PIECE], SEP)] += 1
    return want


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlm")
    docs = _docs()
    # A document of control characters only: BERT's normaliser removes them, no token is left.
    src = _write(d / "docs.txt", docs, extra="\x01\x02 \x03")
    out = d / "out"
    result = prepare(_config(src, out), log=lambda m: None)
    return docs, out, result.manifest


def test_every_document_whole_or_split_at_the_context(prepared):
    docs, out, manifest = prepared
    block = _samples(out)
    got = Counter(_originals(block))
    want = _expected_pieces(docs, lambda i: len(SPECIALS) + i)
    assert got == Counter({k: 2 * v for k, v in want.items()})  # dupe_factor 2
    lens = block.seq_lens
    assert lens.max() == SEQ and lens.min() == 3  # a piece of exactly the context; a one-token document
    assert (block.segment_ids == 0).all() and (block.nsp_labels == 0).all()
    assert manifest["documents"]["skipped_short"] == 1  # the control-character document
    assert manifest["documents"]["usable"] == len(docs)
    assert manifest["train"]["random_next"] == 0 and manifest["parameters"]["objective"] == "mlm"


def test_masking_rate_and_specials(prepared):
    _, out, _ = prepared
    block = _samples(out)
    want = np.minimum(SEQ, np.maximum(1, np.rint(block.seq_lens * 0.3)))
    assert np.array_equal(block.masked_counts, np.minimum(want, block.seq_lens - 2))
    starts = np.repeat(np.concatenate([[0], np.cumsum(block.seq_lens)[:-1]]), block.masked_counts)
    assert (block.masked_positions >= 1).all()
    assert (block.masked_positions < np.repeat(block.seq_lens, block.masked_counts) - 1).all()  # never [SEP]
    assert (block.masked_ids != CLS).all() and (block.masked_ids != SEP).all()
    assert len(starts) == len(block.masked_ids)


def test_files_hold_no_next_sentence_labels(prepared):
    _, out, _ = prepared
    f = sorted((out / "train").glob("*.hdf5"))[0]
    with h5py.File(f, "r") as h:
        assert "next_sentence_labels" not in h and int(h.attrs["next_sentence"]) == 0
        assert h["input_ids"].dtype.metadata["vlen"] == np.int16
        assert int(h.attrs["vocab_size"]) == len(VOCAB)
    info = inspect(f)
    assert info.layout == "varlength" and not info.next_sentence and info.vocab_size == len(VOCAB)
    assert info.max_seq_length == SEQ


def test_the_loader_gives_unpadded_and_packed_batches(prepared):
    _, out, _ = prepared
    loader = PretrainingLoader(out / "train", global_batch_size=8, seed=1, prefetch=False)
    assert loader.next_sentence is False and loader.vocab_size == len(VOCAB)
    block = next(iter(loader))
    batch = collate_unpadded(block).check_values(len(VOCAB))
    assert batch.nsp_labels.tolist() == [0] * 8
    assert batch.cu_seqlens[-1].item() == int(block.seq_lens.sum())
    packed = collate_packed(block, SEQ).check_values(len(VOCAB))
    assert packed.input_ids.shape[1] == SEQ and packed.nsp_labels.tolist() == [0] * 8
    assert next(iter(loader.batches("packed", SEQ))).startend_row_indices.shape[2] == SEQ
    loader.close()


def test_packed_layout_holds_the_same_samples(prepared, tmp_path):
    docs, out, _ = prepared
    src = Path(prepared[1]).parent / "docs.txt"
    packed_out = tmp_path / "packed"
    prepare(_config(src, packed_out, format="packed"), log=lambda m: None)
    f = sorted((packed_out / "train").glob("*.hdf5"))[0]
    info = inspect(f)
    assert info.layout == "packed" and not info.next_sentence and info.num_packs < info.num_samples
    with h5py.File(f, "r") as h:
        assert "next_sentence_labels" not in h
        assert max(len(x) for x in h["input_ids"][:]) <= SEQ
    assert Counter(_originals(_samples(packed_out))) == Counter(_originals(_samples(out)))


def test_eval_set_from_held_out_documents(prepared, tmp_path):
    src = Path(prepared[1]).parent / "docs.txt"
    out = tmp_path / "o"
    m = prepare(_config(src, out, eval_samples=6, dupe_factor=1, eval_masked_lm_prob=0.15), log=lambda m: None)
    ev = read_file(out / "eval" / "part_eval_10k.hdf5", vocab_size=len(VOCAB))
    assert len(ev) == 6 and (ev.nsp_labels == 0).all() and m.manifest["eval"]["samples"] == 6
    assert not inspect(out / "eval" / "part_eval_10k.hdf5").next_sentence
    # trained at 0.3 (the shards), evaluated at 0.15
    want = np.minimum(np.maximum(1, np.rint(ev.seq_lens * 0.15)), ev.seq_lens - 2)
    assert np.array_equal(ev.masked_counts, want) and m.manifest["parameters"]["eval_masked_lm_prob"] == 0.15
    train = _samples(out)
    assert np.array_equal(
        train.masked_counts, np.minimum(np.maximum(1, np.rint(train.seq_lens * 0.3)), train.seq_lens - 2)
    )


def _bpe_json(path: Path, texts: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


def test_bpe_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer

    prose = [
        ["The quick brown fox jumps over the lazy dog.", "It was not amused."],
        ["Tokenizers split words into pieces,", "and BPE merges the frequent pairs."],
        ["A"],
        ["Sliding windows and global layers alternate in ModernBERT."] * 4,
    ] * 3
    src = tmp_path / "prose.txt"
    src.write_text("\n\n".join("\n".join(d) for d in prose) + "\n")
    tj = _bpe_json(tmp_path / "bpe.tok", [" ".join(d) for d in prose])  # --tokenizer: JSON whatever its name
    out = tmp_path / "o"
    m = prepare(_config(src, out, tokenizer=str(tj), dupe_factor=1), log=lambda m: None).manifest
    tok = Tokenizer.from_file(str(tj))
    specials = {tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")}
    want: Counter = Counter()
    for d in prose:
        ids = tok.encode(" ".join(d), add_special_tokens=False).ids
        assert not specials & set(ids)
        for a in range(0, len(ids), PIECE):
            want[(tok.token_to_id("[CLS]"), *ids[a : a + PIECE], tok.token_to_id("[SEP]"))] += 1
    assert Counter(_originals(_samples(out, tok.get_vocab_size()))) == want
    assert (out / "tokenizer.json").read_bytes() == tj.read_bytes() and not (out / "vocab.txt").exists()
    assert m["vocab"] == {"file": "tokenizer.json", "size": tok.get_vocab_size(), "md5": m["vocab"]["md5"]}


def _word_level_json(path: Path, words: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def test_a_vocabulary_wider_than_int16_is_stored_as_int32(tmp_path, capsys):
    words = SPECIALS + [f"x{i}" for i in range(33_000)]
    tj = _word_level_json(tmp_path / "wide.json", words)
    rng = np.random.default_rng(0)
    docs = [[rng.integers(32_000, 33_000, int(n)).tolist()] for n in rng.integers(1, 40, 12)]
    src = tmp_path / "wide.txt"
    src.write_text("\n\n".join(" ".join(f"x{i}" for i in d[0]) for d in docs) + "\n")
    out = tmp_path / "o"
    prepare(_config(src, out, tokenizer=str(tj), dupe_factor=1), log=lambda m: None)
    f = sorted((out / "train").glob("*.hdf5"))[0]
    with h5py.File(f, "r") as h:
        assert h["input_ids"].dtype.metadata["vlen"] == np.int32
        assert h["masked_lm_ids"].dtype.metadata["vlen"] == np.int32
    got = Counter(_originals(_samples(out, len(words))))
    assert got == _expected_pieces(docs, lambda i: len(SPECIALS) + i)
    assert max(max(s) for s in got) > 32_768
    # Read without a vocabulary size, the file's own attribute bounds the ids.
    assert len(read_file(f)) == inspect(f).num_samples
    # The fixed layout (int16) cannot hold it: one line, exit 2, nothing written.
    args = ["--input", str(src), "--tokenizer", str(tj), "--output-dir", str(tmp_path / "f"), "--eval-samples", "0"]
    assert cli_main(prepare_main, args) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {tj}: 33005 entries, but the fixed layout stores ids as int16 (at most 32768); "
        "use --format varlength or packed"
    )
    assert not (tmp_path / "f" / "train").exists()


def _cli(capsys, args) -> tuple[int, str]:
    """(exit code, the error line); progress lines before it are allowed, a traceback is not."""
    code = cli_main(prepare_main, args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if not line.startswith("prepare: ")]
    assert len(errors) <= 1 and "Traceback" not in err, err
    return code, "".join(errors)


@pytest.mark.parametrize("case", ["not_json", "not_utf8", "missing_mask", "id_gap"])
def test_a_hostile_tokenizer_file_is_one_line(tmp_path, capsys, case):
    src = _write(tmp_path / "d.txt", _docs())
    tj = tmp_path / "tok.json"
    if case == "not_json":
        tj.write_text('{"model": ')
        want = f"error: {tj}: not a tokenizers JSON file ("
    elif case == "not_utf8":
        tj.write_bytes(b'{"x": "\xff"}')
        want = f"error: {tj}: the tokenizer file is not UTF-8"
    elif case == "missing_mask":
        _word_level_json(tj, [t for t in VOCAB if t != "[MASK]"])
        want = f"error: {tj}: vocabulary is missing [MASK]"
    else:
        doc = json.loads(_word_level_json(tj, VOCAB).read_text())
        doc["model"]["vocab"]["w7"] = 9999
        tj.write_text(json.dumps(doc))
        want = f"error: {tj}: the vocabulary has no entry with id"
    out = tmp_path / "o"
    code, err = _cli(capsys, ["--input", str(src), "--tokenizer", str(tj), "--output-dir", str(out)])
    assert code == 2 and err.startswith(want), err
    assert not (out / "train").exists()


def test_invalid_utf8_in_documents_is_reported_with_file_and_line(tmp_path, capsys):
    src = _write(tmp_path / "d.txt", _docs())
    raw = src.read_bytes().split(b"\n")
    raw[4] = raw[4] + b" \xff w3"
    src.write_bytes(b"\n".join(raw))
    (tmp_path / "v.txt").write_text("\n".join(VOCAB) + "\n")
    out = tmp_path / "o"
    args = ["--input", str(src), "--vocab", str(tmp_path / "v.txt"), "--output-dir", str(out), "--objective", "mlm"]
    args += ["--format", "varlength", "--max-seq-length", str(SEQ), "--max-predictions", "4"]
    args += ["--eval-samples", "0", "--dupe-factor", "1"]
    code, err = cli_main(prepare_main, args), capsys.readouterr().err
    assert code == 0, err
    assert f"{src}: 1 invalid UTF-8 byte sequence(s) replaced with U+FFFD (first at line 5)" in err


def test_bad_mlm_options(tmp_path, capsys):
    src = _write(tmp_path / "d.txt", _docs())
    (tmp_path / "v.txt").write_text("\n".join(VOCAB) + "\n")
    args = ["--input", str(src), "--vocab", str(tmp_path / "v.txt"), "--output-dir", str(tmp_path / "o")]
    code, err = _cli(capsys, [*args, "--objective", "mlm", "--format", "fixed"])
    assert code == 2 and err == (
        "error: --format fixed: --objective mlm writes varlength or packed files (the fixed layout needs "
        "next_sentence_labels)"
    )
    for extra, want in (
        (["--objective", "pairs"], "argument --objective: invalid choice: 'pairs'"),
        (["--tokenizer", "t.json"], "argument --tokenizer: not allowed with argument --vocab"),
    ):
        with pytest.raises(SystemExit) as e:
            prepare_main([*args, *extra])
        assert e.value.code == 2 and want in capsys.readouterr().err


def test_a_failed_run_leaves_nothing_under_final_names(tmp_path, capsys):
    src = _write(tmp_path / "d.txt", _docs())
    (tmp_path / "v.txt").write_text("\n".join(VOCAB) + "\n")
    out = tmp_path / "o"
    args = ["--input", str(src), "--vocab", str(tmp_path / "v.txt"), "--output-dir", str(out)]
    args += ["--objective", "mlm", "--format", "varlength", "--shards", "100000", "--eval-samples", "0"]
    code, err = _cli(capsys, args)
    assert code == 2 and "would be empty" in err
    assert sorted(p.name for p in out.iterdir()) == []


def test_mixed_nsp_and_mlm_files_are_refused(prepared, tmp_path):
    _, out, _ = prepared
    mlm_file = sorted((out / "train").glob("*.hdf5"))[0]
    block = read_file(mlm_file, vocab_size=len(VOCAB))
    nsp_file = tmp_path / "part_00001_of_00002.hdf5"
    write_varlength(nsp_file, block, SEQ, SEQ)  # with next_sentence_labels
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "part_00000_of_00002.hdf5").write_bytes(mlm_file.read_bytes())
    (mixed / nsp_file.name).write_bytes(nsp_file.read_bytes())
    with pytest.raises(DataError) as e:
        PretrainingLoader(mixed, global_batch_size=4, prefetch=False, vocab_size=len(VOCAB))
    assert str(e.value) == (
        f"{mixed / nsp_file.name}: has next_sentence_labels, but {mixed / 'part_00000_of_00002.hdf5'} "
        "is masked-LM only (no next_sentence_labels)"
    )


def test_a_file_contradicting_its_next_sentence_attribute_is_refused(prepared, tmp_path):
    _, out, _ = prepared
    f = tmp_path / "f.hdf5"
    f.write_bytes(sorted((out / "train").glob("*.hdf5"))[0].read_bytes())
    with h5py.File(f, "a") as h:
        h.create_dataset("next_sentence_labels", data=np.zeros(h["input_ids"].shape[0], np.int8))
    with pytest.raises(DataError, match="attribute next_sentence is 0 but the file has next_sentence_labels"):
        inspect(f)
    with h5py.File(f, "a") as h:
        del h["next_sentence_labels"]
        del h.attrs["next_sentence"]
    with pytest.raises(DataError, match="missing key 'next_sentence_labels' \\(varlength layout\\)"):
        inspect(f)


def test_convert_keeps_a_masked_lm_only_file_so(prepared, tmp_path):
    from data.prepare.convert import convert_file

    _, out, _ = prepared
    src = sorted((out / "train").glob("*.hdf5"))[0]
    n = convert_file(src, tmp_path / "p.hdf5", "packed")
    info = inspect(tmp_path / "p.hdf5")
    assert info.num_samples == n and not info.next_sentence and info.vocab_size == len(VOCAB)
    assert Counter(_originals(read_file(tmp_path / "p.hdf5"))) == Counter(_originals(read_file(src)))
    with pytest.raises(DataError, match="the fixed layout needs next_sentence_labels"):
        convert_file(src, tmp_path / "f.hdf5", "fixed")
    assert not (tmp_path / "f.hdf5").exists()


@pytest.mark.parametrize("layout", ["varlength", "packed"])
def test_samples_of_one_length_and_one_masked_count_are_written(tmp_path, layout):
    """Every sample the same length (documents exactly the context) and the same masked count."""
    from data.hdf5io import write_file

    n, length = 4, 6
    block = SampleBlock(
        input_ids=np.tile(np.array([CLS, 7, 8, 9, 10, SEP], np.int32), n),
        segment_ids=np.zeros(n * length, np.int8),
        seq_lens=np.full(n, length, np.int32),
        masked_positions=np.tile(np.array([1, 3], np.int32), n),
        masked_ids=np.tile(np.array([7, 9], np.int32), n),
        masked_counts=np.full(n, 2, np.int32),
        nsp_labels=np.zeros(n, np.int8),
    )
    write_file(tmp_path / "f.hdf5", block, layout, length, 2, next_sentence=False)
    assert read_file(tmp_path / "f.hdf5").equals(block)
