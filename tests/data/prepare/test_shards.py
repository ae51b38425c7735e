"""data.prepare on a synthetic corpus: MLPerf layout, masking and NSP semantics, eval
hold-out, determinism across worker counts, the input formats, and every bad text input.

The corpus (``corpus`` below) starts every sentence with ``docD sK``, whole-word
vocabulary entries, so each token's document and sentence can be read back from the ids.
"""

from __future__ import annotations

import json
import string
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from common.errors import DataError, cli_main
from common.files import file_digest
from data.hdf5io import read_file
from data.prepare.shards import PrepareConfig, prepare
from data.prepare.shards import main as prepare_main
from data.prepare.text import parse_documents, split_sentences
from tests.helpers import REPO

# ---- a text corpus whose tokens say where they came from -----------------------------------


def word_vocab(num_words: int, num_docs: int, max_sentences: int = 12) -> list[str]:
    """The specials, letters, digits and '.', then whole words ``w0``.., ``s0``.. and
    ``doc0``.. (in that order, so a token's kind and number follow from its id)."""
    letters = list(string.ascii_lowercase + string.digits + ".")
    words = [f"{kind}{i}" for kind, n in (("w", num_words), ("s", max_sentences), ("doc", num_docs)) for i in range(n)]
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *("##" + c for c in letters), *words]


def corpus(num_docs: int, seed: int, num_words: int = 200, sentences=(1, 12), words=(3, 30)) -> list[list[str]]:
    """Documents of sentences. Sentence k of document d starts with the words ``docD sK``,
    so tests can tell which document and sentence a token came from."""
    rng = np.random.default_rng(seed)
    docs = []
    for d in range(num_docs):
        doc = []
        for k in range(int(rng.integers(sentences[0], sentences[1] + 1))):
            n = int(rng.integers(words[0], words[1] + 1))
            doc.append(" ".join([f"doc{d}", f"s{k}"] + [f"w{w}" for w in rng.integers(0, num_words, n)]) + " .")
        docs.append(doc)
    return docs


def write_bert_text(path, docs: list[list[str]]) -> Path:
    """Write documents in the ``bert`` input format (a sentence per line, blank line between)."""
    path = Path(path)
    path.write_text("\n\n".join("\n".join(doc) for doc in docs) + "\n", encoding="utf-8")
    return path


NUM_DOCS, NUM_WORDS, MAX_SENT = 300, 200, 12
SEQ, PRED = 64, 10
VOCAB = word_vocab(NUM_WORDS, NUM_DOCS, MAX_SENT)
S_BASE = VOCAB.index("s0")
DOC_BASE = VOCAB.index("doc0")
MASK_ID, CLS_ID, SEP_ID = VOCAB.index("[MASK]"), VOCAB.index("[CLS]"), VOCAB.index("[SEP]")


def _write_vocab(path: Path, tokens=VOCAB) -> Path:
    path.write_text("\n".join(tokens) + "\n")
    return path


def _config(src: Path, vocab: Path, out: Path, **kw) -> PrepareConfig:
    args = dict(
        inputs=[str(src)],
        output_dir=str(out),
        input_format="bert",
        vocab=str(vocab),
        max_seq_length=SEQ,
        max_predictions=PRED,
        dupe_factor=5,
        seed=7,
        shards=3,
        eval_samples=200,
        workers=1,
    )
    args.update(kw)
    return PrepareConfig(**args)


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    src = write_bert_text(d / "corpus.txt", corpus(NUM_DOCS, seed=1, num_words=NUM_WORDS, sentences=(1, MAX_SENT)))
    return src, _write_vocab(d / "vocab.txt")


@pytest.fixture(scope="module")
def prepared(corpus_files, tmp_path_factory):
    src, vocab = corpus_files
    out = tmp_path_factory.mktemp("out1")
    result = prepare(_config(src, vocab, out), log=lambda m: None)
    return out, result.manifest


def _all_train(out: Path):
    files = sorted((out / "train").glob("part_*.hdf5"))
    return [read_file(f, vocab_size=len(VOCAB)) for f in files]


def _originals(block):
    """Per sample: (original ids with masked tokens restored, ids as stored, len of A)."""
    tok_off = np.concatenate([[0], np.cumsum(block.seq_lens)])
    msk_off = np.concatenate([[0], np.cumsum(block.masked_counts)])
    for i in range(len(block)):
        ids = block.input_ids[tok_off[i] : tok_off[i + 1]]
        seg = block.segment_ids[tok_off[i] : tok_off[i + 1]]
        pos = block.masked_positions[msk_off[i] : msk_off[i + 1]]
        orig = ids.copy()
        orig[pos] = block.masked_ids[msk_off[i] : msk_off[i + 1]]
        la = int((seg == 0).sum()) - 2
        yield orig, ids, pos, la


def test_mlperf_layout(prepared):
    out, manifest = prepared
    files = sorted((out / "train").glob("*.hdf5"))
    assert [f.name for f in files] == [f"part_{i:05d}_of_00003.hdf5" for i in range(3)]
    want = {
        "input_ids": ((SEQ,), np.int16),
        "input_mask": ((SEQ,), np.int8),
        "segment_ids": ((SEQ,), np.int8),
        "masked_lm_positions": ((PRED,), np.int16),
        "masked_lm_ids": ((PRED,), np.int16),
        "next_sentence_labels": ((), np.int8),
    }
    for f in files + [out / "eval" / "part_eval_10k.hdf5"]:
        with h5py.File(f) as h:
            assert set(h.keys()) == set(want)
            n = h["next_sentence_labels"].shape[0]
            for key, (tail, dtype) in want.items():
                assert h[key].dtype == dtype, (f, key)
                assert h[key].shape == (n, *tail), (f, key)
    # The manifest matches the files.
    assert manifest["parameters"]["max_seq_length"] == SEQ and "workers" not in manifest["parameters"]
    for entry in manifest["train"]["files"] + [manifest["eval"]]:
        path = out / (entry["name"] if "name" in entry else entry["file"])
        assert file_digest(path) == entry["md5"]
        assert len(read_file(path)) == entry["samples"]
    assert manifest["eval"]["samples"] == 200
    assert manifest["vocab"]["md5"] == file_digest(out / "vocab.txt")
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert not list(out.glob(".prepare-tmp-*"))


def test_sequences_are_cls_a_sep_b_sep(prepared):
    out, _ = prepared
    for block in _all_train(out):
        for orig, _ids, pos, la in _originals(block):
            n = len(orig)
            assert orig[0] == CLS_ID and orig[la + 1] == SEP_ID and orig[n - 1] == SEP_ID
            assert la >= 1 and n - la - 3 >= 1 and n <= SEQ
            specials = np.isin(orig, [CLS_ID, SEP_ID])
            assert specials.sum() == 3
            # Masked positions: sorted, never a special token.
            assert np.all(np.diff(pos) > 0) and not specials[pos].any()


def test_masking_statistics(prepared):
    out, _ = prepared
    chosen = kept = masked = replaced = tokens = 0
    for block in _all_train(out):
        lens = block.seq_lens.astype(np.int64)
        want = np.minimum(PRED, np.maximum(1, np.rint(lens * 0.15))).astype(np.int64)
        np.testing.assert_array_equal(block.masked_counts, want)
        for orig, ids, pos, _ in _originals(block):
            tokens += len(orig)
            chosen += len(pos)
            masked += int((ids[pos] == MASK_ID).sum())
            kept += int((ids[pos] == orig[pos]).sum())
            replaced += int(((ids[pos] != MASK_ID) & (ids[pos] != orig[pos])).sum())
    assert chosen > 10000
    assert 0.14 < chosen / tokens < 0.16
    assert abs(masked / chosen - 0.8) < 0.015
    assert abs(kept / chosen - 0.1) < 0.01
    assert abs(replaced / chosen - 0.1) < 0.01


def _docs_and_sentences(tokens):
    t = np.asarray(tokens)
    return set((t[t >= DOC_BASE] - DOC_BASE).tolist()), (t[(t >= S_BASE) & (t < DOC_BASE)] - S_BASE)


def test_next_sentence_pairs(prepared):
    """Actual-next pairs: B continues A in the same document. Random-next pairs: B comes from
    another document. About half are random (more, since one-sentence chunks always are)."""
    out, _ = prepared
    checked = {0: 0, 1: 0}
    labels = []
    for block in _all_train(out):
        labels.append(block.nsp_labels)
        for (orig, _, _, la), nsp in zip(_originals(block), block.nsp_labels):
            docs_a, sent_a = _docs_and_sentences(orig[1 : la + 1])
            docs_b, sent_b = _docs_and_sentences(orig[la + 2 : -1])
            assert len(docs_a) <= 1 and len(docs_b) <= 1
            if not docs_a or not docs_b:
                continue  # truncation removed the markers
            checked[int(nsp)] += 1
            if nsp == 0:
                assert docs_a == docs_b
                if len(sent_a) and len(sent_b):
                    assert sent_a.max() < sent_b.min()
            else:
                assert docs_a != docs_b
    assert min(checked.values()) > 1000
    frac = float(np.concatenate(labels).mean())
    assert 0.5 <= frac <= 0.65, frac


def test_eval_documents_never_in_training(prepared):
    out, manifest = prepared
    eval_docs, train_docs = set(), set()
    for orig, *_ in _originals(read_file(out / "eval" / "part_eval_10k.hdf5")):
        eval_docs |= _docs_and_sentences(orig)[0]
    for block in _all_train(out):
        for orig, *_ in _originals(block):
            train_docs |= _docs_and_sentences(orig)[0]
    assert eval_docs and train_docs
    assert not eval_docs & train_docs
    assert len(eval_docs) <= manifest["documents"]["eval"]
    assert len(eval_docs | train_docs) > 0.9 * NUM_DOCS


def _tree(out: Path) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.timeout(120)
def test_identical_for_any_worker_count(corpus_files, prepared, tmp_path, monkeypatch):
    """Output of one process doing everything in one task == output of two worker processes
    with the text cut into several chunks and the documents into several pairing tasks."""
    import data.prepare.shards
    import data.prepare.text

    src, vocab = corpus_files
    out1, _ = prepared
    out2 = tmp_path / "w2"
    monkeypatch.setattr(data.prepare.text, "CHUNK_BYTES", 20_000)
    monkeypatch.setattr(data.prepare.shards, "PAIR_TASK_TOKENS", (5_000, 5_000))
    logged = []
    prepare(_config(src, vocab, out2, workers=2), log=logged.append)
    assert any("(8 chunk(s)" in m for m in logged), logged
    assert any("(7 task(s)" in m for m in logged), logged
    a, b = _tree(out1), _tree(out2)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k], k


def test_varlength_output_holds_the_same_samples(corpus_files, prepared, tmp_path):
    src, vocab = corpus_files
    out1, _ = prepared
    out2 = tmp_path / "var"
    prepare(_config(src, vocab, out2, format="varlength"), log=lambda m: None)
    for a, b in zip(sorted((out1 / "train").glob("*.hdf5")), sorted((out2 / "train").glob("*.hdf5"))):
        assert read_file(a).equals(read_file(b))
        with h5py.File(b) as h:
            assert "input_mask" not in h and h.attrs["max_seq_length"] == SEQ


def test_eval_from_a_separate_input(corpus_files, tmp_path):
    """--eval-input (MLPerf's eval.txt): every eval sample comes from those documents and
    every --input document is used for training."""
    _, vocab = corpus_files
    train_corpus = corpus(200, seed=8, num_words=NUM_WORDS)  # documents doc0..doc199
    src = write_bert_text(tmp_path / "train.txt", train_corpus)
    eval_corpus = corpus(50, seed=9, num_words=NUM_WORDS)  # documents doc0..doc49, renamed doc250..doc299
    eval_src = write_bert_text(
        tmp_path / "eval.txt", [[f"doc{250 + k}" + s[s.index(" ") :] for s in d] for k, d in enumerate(eval_corpus)]
    )
    out = tmp_path / "o"
    r = prepare(_config(src, vocab, out, eval_inputs=[str(eval_src)], eval_samples=150, shards=1), log=lambda m: None)
    eval_docs = set()
    for orig, *_ in _originals(read_file(out / "eval" / "part_eval_10k.hdf5")):
        eval_docs |= _docs_and_sentences(orig)[0]
    assert eval_docs and all(250 <= d < 300 for d in eval_docs)
    docs = r.manifest["documents"]
    assert docs["train"] == docs["usable"] - docs["eval"] and docs["eval"] == sum(len(d) >= 2 for d in eval_corpus)
    train_docs = set()
    for block in _all_train(out):
        for orig, *_ in _originals(block):
            train_docs |= _docs_and_sentences(orig)[0]
    assert not train_docs & eval_docs
    usable = {d for d, doc in enumerate(train_corpus) if len(doc) >= 2}
    assert train_docs <= usable and len(train_docs) >= 0.95 * len(usable)


def test_rerun_replaces_shards_of_an_earlier_run(corpus_files, tmp_path):
    src, vocab = corpus_files
    out = tmp_path / "o"
    prepare(_config(src, vocab, out, shards=3, dupe_factor=1, eval_samples=0), log=lambda m: None)
    prepare(_config(src, vocab, out, shards=2, dupe_factor=1, eval_samples=0), log=lambda m: None)
    assert sorted(p.name for p in (out / "train").iterdir()) == ["part_00000_of_00002.hdf5", "part_00001_of_00002.hdf5"]
    assert not (out / "eval").exists()


# ----------------------------------------------------------------- text formats


def test_wikitext_sections_are_documents():
    lines = [
        " ",
        " = Lobster = ",
        " ",
        " The lobster is blue . It is 60 @.@ 5 cm long @-@ ish , or <unk> . ",
        " ",
        " = = Description = = ",
        " Mr. Smith saw H. gammarus . Then he left . ",
        " = = Empty = = ",
        " ",
    ]
    docs = parse_documents(lines, "wikitext")
    assert docs == [
        ["The lobster is blue .", "It is 60.5 cm long-ish , or [UNK] ."],
        ["Mr. Smith saw H. gammarus .", "Then he left ."],
    ]


def test_text_paragraphs_are_documents():
    lines = [
        "First line of a",
        "paragraph. Second sentence!",
        "",
        "",
        "Only one here.",
        "",
        "Dr. No met 3 people. Yes.",
    ]
    assert parse_documents(lines, "text") == [
        ["First line of a paragraph.", "Second sentence!"],
        ["Only one here."],
        ["Dr. No met 3 people.", "Yes."],
    ]
    assert split_sentences('He said "Go." Then "Stop." e.g. this. 2 more.') == [
        'He said "Go."',
        'Then "Stop." e.g. this.',
        "2 more.",
    ]


def test_bert_format_documents():
    assert parse_documents(["a b", "c", "", "", "d", "e f", ""], "bert") == [["a b", "c"], ["d", "e f"]]


@pytest.mark.timeout(120)
def test_train_vocab_on_plain_text(tmp_path):
    # Prose in the ``text`` format with a vocabulary learnt from it, twice: same bytes.
    rng = np.random.default_rng(3)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega"]
    paras = []
    for _ in range(120):
        sents = [" ".join(rng.choice(words, rng.integers(4, 15))).capitalize() + "." for _ in range(rng.integers(2, 6))]
        paras.append(" ".join(sents))
    src = tmp_path / "prose.txt"
    src.write_text("\n\n".join(paras) + "\n")
    outs = []
    for k in range(2):
        out = tmp_path / f"o{k}"
        r = prepare(
            PrepareConfig(
                inputs=[str(src)],
                output_dir=str(out),
                input_format="text",
                train_vocab=300,
                max_seq_length=32,
                max_predictions=5,
                dupe_factor=2,
                shards=2,
                eval_samples=20,
            ),
            log=lambda m: None,
        )
        outs.append(_tree(out))
    assert outs[0] == outs[1]
    vocab = outs[0]["vocab.txt"].decode().split("\n")[:-1]
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and len(vocab) <= 300
    assert set(words) <= set(vocab)  # frequent words become whole pieces
    assert r.manifest["vocab"]["size"] == len(vocab)
    assert r.manifest["train"]["samples"] > 100


# -------------------------------------------------------------------- bad input


def _run_cli(capsys, argv) -> tuple[int, str]:
    code = cli_main(prepare_main, argv)
    err = capsys.readouterr().err.strip()
    return code, err


def _base_args(src, vocab, out):
    return [
        "--input",
        str(src),
        "--vocab",
        str(vocab),
        "--output-dir",
        str(out),
        "--max-seq-length",
        str(SEQ),
        "--max-predictions",
        str(PRED),
        "--dupe-factor",
        "1",
        "--shards",
        "1",
        "--eval-samples",
        "0",
    ]


def test_eval_held_out_from_few_short_documents(corpus_files, tmp_path, capsys):
    """The new user's run: 201 two-sentence documents and 5 eval samples. One document's pairs
    would do, but a random next segment needs a second document: two are held out."""
    _, vocab = corpus_files
    src = tmp_path / "in"
    src.mkdir()
    write_bert_text(src / "docs.txt", corpus(201, seed=8, num_words=NUM_WORDS, sentences=(2, 2)))
    out = tmp_path / "o"
    code, err = _run_cli(
        capsys,
        [
            "--input",
            str(src),
            "--vocab",
            str(vocab),
            "--output-dir",
            str(out),
            "--max-seq-length",
            "64",
            "--max-predictions",
            "10",
            "--shards",
            "1",
            "--eval-samples",
            "5",
        ],
    )
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["documents"]["eval"] == 2 and manifest["documents"]["train"] == 199
    assert manifest["eval"]["samples"] == 5
    eval_docs = set()
    for orig, *_ in _originals(read_file(out / "eval" / "part_eval_10k.hdf5")):
        eval_docs |= _docs_and_sentences(orig)[0]
    train_docs = set()
    for block in _all_train(out):
        for orig, *_ in _originals(block):
            train_docs |= _docs_and_sentences(orig)[0]
    assert 1 <= len(eval_docs) <= 2 and not eval_docs & train_docs


@pytest.mark.parametrize(
    "num_docs, eval_samples, want",
    [
        (
            3,
            5,
            "too little text for --eval-samples 5: the eval set is held out from at most half of the documents "
            "and needs 2 of them, but there are 3 usable documents",
        ),
        (8, 1000, "too little text for --eval-samples 1000: holding out half of the 8 documents gives only"),
    ],
)
def test_eval_hold_out_says_what_is_too_little(corpus_files, tmp_path, capsys, num_docs, eval_samples, want):
    _, vocab = corpus_files
    src = write_bert_text(tmp_path / "c.txt", corpus(num_docs, seed=9, num_words=NUM_WORDS, sentences=(2, 2)))
    args = _base_args(src, vocab, tmp_path / "o")
    args[args.index("--eval-samples") + 1] = str(eval_samples)
    code, err = _run_cli(capsys, args)
    assert code == 2 and err.splitlines()[-1].startswith(f"error: {want}") and "Traceback" not in err


def test_invalid_utf8_is_replaced_counted_and_reported(corpus_files, tmp_path, capsys):
    _, vocab = corpus_files
    docs = corpus(20, seed=5, num_words=NUM_WORDS)
    src = write_bert_text(tmp_path / "bad.txt", docs)
    raw = src.read_bytes().split(b"\n")
    raw[3] = raw[3] + b" \xff\xfe w1"
    raw[10] = b"\xc3" + raw[10]
    src.write_bytes(b"\n".join(raw))
    out = tmp_path / "o"
    code, err = _run_cli(capsys, _base_args(src, vocab, out))
    assert code == 0
    assert f"{src}: 3 invalid UTF-8 byte sequence(s) replaced with U+FFFD (first at line 4)" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["invalid_utf8_replaced"] == {str(src): 3}


def test_short_documents_are_skipped_and_counted(corpus_files, tmp_path):
    _, vocab = corpus_files
    docs = corpus(40, seed=6, num_words=NUM_WORDS, sentences=(1, 4))
    src = write_bert_text(tmp_path / "c.txt", docs)
    r = prepare(_config(src, vocab, tmp_path / "o", eval_samples=0, shards=1), log=lambda m: None)
    short = sum(len(d) < 2 for d in docs)
    assert short > 0
    assert r.manifest["documents"]["skipped_short"] == short
    assert r.manifest["documents"]["usable"] == 40 - short
    r1 = prepare(_config(src, vocab, tmp_path / "o1", eval_samples=0, shards=1, min_sentences=1), log=lambda m: None)
    assert r1.manifest["documents"]["skipped_short"] == 0


@pytest.mark.parametrize("case", ["empty_file", "whitespace_only", "empty_dir", "missing", "all_short"])
def test_empty_input(corpus_files, tmp_path, capsys, case):
    _, vocab = corpus_files
    src = tmp_path / "in.txt"
    if case == "empty_file":
        src.write_bytes(b"")
        want = f"{src}: empty input"
    elif case == "whitespace_only":
        src.write_text("\n  \n\t\n")
        want = f"{src}: empty input"
    elif case == "empty_dir":
        src = tmp_path / "d"
        src.mkdir()
        want = f"{src}: empty input"
    elif case == "missing":
        want = f"{src}: no such file or directory"
    else:
        src.write_text("one sentence only .\n\nanother lonely one .\n")
        want = "0 usable document(s)"
    out = tmp_path / "o"
    code, err = _run_cli(capsys, _base_args(src, vocab, out))
    assert code == 2
    assert len(err.splitlines()) == 1 and want in err and "Traceback" not in err
    assert not (out / "train").exists() and not list(out.glob(".prepare-tmp-*"))


@pytest.mark.parametrize("missing", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
def test_vocab_missing_a_special_token(corpus_files, tmp_path, capsys, missing):
    src, _ = corpus_files
    vocab = _write_vocab(tmp_path / "v.txt", [t for t in VOCAB if t != missing])
    code, err = _run_cli(capsys, _base_args(src, vocab, tmp_path / "o"))
    assert code == 2 and err == f"error: {vocab}: vocabulary is missing {missing}"


def test_output_dir_that_cannot_be_written(corpus_files, tmp_path, capsys):
    src, vocab = corpus_files
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, err = _run_cli(capsys, _base_args(src, vocab, blocker / "out"))
    assert code == 2 and err.startswith(f"error: {blocker / 'out'}: the output directory cannot be written")


def test_failed_run_leaves_no_files_under_final_names(corpus_files, tmp_path, capsys):
    src, vocab = corpus_files
    out = tmp_path / "o"
    args = _base_args(src, vocab, out)
    args[args.index("--shards") + 1] = "100000"
    code, err = _run_cli(capsys, args)
    assert code == 2 and "would be empty" in err
    assert sorted(p.name for p in out.iterdir()) == []


@pytest.mark.parametrize(
    "flag,value,want",
    [
        ("--max-seq-length", "4", "must lie in [5, 32767]"),
        ("--max-predictions", "0", "must lie in [1, max_seq_length]"),
        ("--masked-lm-prob", "0", "must lie in (0, 1]"),
        ("--dupe-factor", "0", "must lie in [1, 255]"),
    ],
)
def test_bad_parameters(corpus_files, tmp_path, capsys, flag, value, want):
    src, vocab = corpus_files
    args = _base_args(src, vocab, tmp_path / "o")
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    code, err = _run_cli(capsys, args)
    assert code == 2 and err == f"error: {flag} {float(value) if 'prob' in flag else value}: {want}"


@pytest.mark.timeout(60)
def test_cli_process_exit_code_and_one_line(tmp_path):
    """The real ``python -m data.prepare`` process: one line on stderr, status 2."""
    src = tmp_path / "empty.txt"
    src.write_text("")
    vocab = _write_vocab(tmp_path / "v.txt")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "data.prepare",
            "--input",
            str(src),
            "--vocab",
            str(vocab),
            "--output-dir",
            str(tmp_path / "o"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2
    assert p.stderr == f"error: {src}: empty input (no text)\n"


def test_config_needs_exactly_one_vocab_source(tmp_path):
    with pytest.raises(DataError, match="exactly one of --vocab FILE and --train-vocab SIZE"):
        PrepareConfig(inputs=["x"], output_dir=str(tmp_path))


def test_an_option_is_declared_once_as_a_config_field():
    """A field added to PrepareConfig with ``option`` is, from that one declaration, a CLI
    option (type, default and help), reaches the config, and is refused by --reference when
    marked so: no parser line or reference-mode list to keep in step by hand."""
    from dataclasses import dataclass, fields

    from data.prepare.shards import build_parser, option, refused_by_reference

    @dataclass(kw_only=True)
    class Extended(PrepareConfig):
        pair_budget: int = option(7, reference=False, help="pairs per document at most")
        note: str = option("none", help="a free-form note")

    ap = build_parser(Extended)
    text = " ".join(ap.format_help().split())
    assert "--pair-budget PAIR_BUDGET pairs per document at most (default 7) (default: None)" in text
    assert "--note NOTE a free-form note (default: none)" in text
    base = ["--input", "x", "--vocab", "v.txt", "--output-dir", "o"]
    args = ap.parse_args(base + ["--pair-budget", "3"])
    cfg = Extended(**{f.name: getattr(args, f.name) for f in fields(Extended) if getattr(args, f.name) is not None})
    assert (cfg.pair_budget, cfg.note, cfg.inputs, cfg.max_seq_length) == (3, "none", ["x"], 512)
    assert refused_by_reference(args, Extended) == ["--pair-budget"]
    assert refused_by_reference(ap.parse_args(base + ["--note", "hi", "--seed", "1"]), Extended) == []
    # The real parser: every field is an option, and --reference refuses exactly the options
    # that change the layout or the split (what MLPerf's reference script cannot do).
    real = build_parser()
    every = real.parse_args(
        base[:4]
        + ["--output-dir", "o", "--input-format", "text", "--eval-input", "e", "--shards", "2"]
        + ["--eval-samples", "5", "--format", "varlength", "--min-sentences", "1"]
    )
    assert refused_by_reference(every) == [
        "--input-format",
        "--eval-input",
        "--shards",
        "--eval-samples",
        "--format",
        "--min-sentences",
    ]


def test_truncation_matches_the_token_by_token_rule():
    """``truncate_seq_pair`` removes one token at a time from the longer segment (B on ties),
    from the front or back at random; the closed form must give the same lengths, and an
    unbiased front/back split."""
    import random

    from data.prepare.shards import _truncate

    rng = random.Random(0)
    fronts = []
    for la in range(1, 40):
        for lb in range(1, 40):
            for m in (2, 3, 17, 40, 61):
                a, b = la, lb
                while a + b > m:
                    if a > b:
                        a -= 1
                    else:
                        b -= 1
                a0, a1, b0, b1 = _truncate(100, 100 + la, 500, 500 + lb, m, rng)
                assert (a1 - a0, b1 - b0) == (a, b), (la, lb, m)
                assert 100 <= a0 and a1 <= 100 + la and 500 <= b0 and b1 <= 500 + lb
                if la - a:
                    fronts.append(((a0 - 100) / (la - a), la - a))
    removed = sum(n for _, n in fronts)
    assert abs(sum(f * n for f, n in fronts) / removed - 0.5) < 0.01
