"""Tokenizer files made to hurt the preparation: a FIFO, padding and truncation set in the JSON,
a normalizer that multiplies the text, a bad regex, a panic, a tokenizer too slow. Each is
refused in one line naming the file, or (padding, truncation) switched off; long documents
encoded in pieces give the same ids as in one call."""

from __future__ import annotations

import json
import os
import time

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

import data.prepare.tokenization as tokenization
from common.errors import DataError, cli_main
from data.prepare.shards import main as prepare_main
from data.prepare.tokenization import encode, load_tokenizer, make_tokenizer, train_wordpiece

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TEXT = "The quick brown fox jumps over the lazy dog; it was not amused, was it?  Tokens   and spaces.\n"


def _byte_level(path, normalizer=None):
    """A byte-level BPE without merges: one token per byte of the normalised text."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(SPECIALS + alphabet)}, [], unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.save(str(path))
    return path


def _edit(path, **changes):
    spec = json.loads(path.read_text())
    spec.update(changes)
    path.write_text(json.dumps(spec))
    return path


def test_a_fifo_as_tokenizer_is_refused_at_once(tmp_path, capsys):
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    (tmp_path / "in.txt").write_text(TEXT * 4)
    start = time.monotonic()
    with pytest.raises(DataError, match=rf"^{fifo}: tokenizer is a FIFO, not a regular file; refused$"):
        load_tokenizer(fifo)
    args = ["--input", str(tmp_path / "in.txt"), "--tokenizer", str(fifo), "--output-dir", str(tmp_path / "o")]
    assert cli_main(prepare_main, args) == 2
    assert time.monotonic() - start < 1.0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "FIFO" in err[0]


def test_padding_and_truncation_of_the_file_are_switched_off(tmp_path):
    plain = _byte_level(tmp_path / "plain.json")
    want = Tokenizer.from_file(str(plain)).encode(TEXT, add_special_tokens=False).ids
    hostile = _edit(
        _byte_level(tmp_path / "hostile.json"),
        padding={
            "strategy": {"Fixed": 10**7},
            "direction": "Right",
            "pad_to_multiple_of": None,
            "pad_id": 0,
            "pad_type_id": 0,
            "pad_token": "[PAD]",
        },  # fmt: skip
        truncation={"direction": "Right", "max_length": 1, "strategy": "LongestFirst", "stride": 0},
    )
    _, tok = load_tokenizer(hostile)
    assert [e.ids for e in encode(tok, [TEXT, TEXT], str(hostile))] == [want, want]


def test_amplifying_normalizers_are_refused(tmp_path):
    path = _byte_level(tmp_path / "replace.json", normalizers.Replace("a", "b" * 10_000))
    with pytest.raises(DataError, match=rf"^{path}: its normalizer can make 10,000 characters of one"):
        load_tokenizer(path)
    # NFKC makes 18 characters of U+FDFA: no Replace, but 33 byte tokens a character when encoded.
    path = _byte_level(tmp_path / "nfkc.json", normalizers.NFKC())
    _, tok = load_tokenizer(path)
    with pytest.raises(DataError, match=rf"^{path}: the tokenizer made [\d,]+ tokens of 50 characters"):
        encode(tok, ["\ufdfa" * 50], str(path))


def test_bad_regex_panic_and_slowness_are_one_line(tmp_path, monkeypatch):
    path = _byte_level(tmp_path / "regex.json")
    split = {"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated", "invert": False}
    _edit(path, pre_tokenizer=split)
    with pytest.raises(DataError, match=rf"^{path}: not a tokenizers JSON file \(.+\)$"):
        load_tokenizer(path)

    class Panic(BaseException):  # what pyo3 raises for a Rust panic: not an Exception
        pass

    class Panicking:
        def encode_batch_fast(self, texts, add_special_tokens):
            raise Panic("called `Result::unwrap()` on an `Err` value")

    with pytest.raises(DataError, match=r"^tok.json: the tokenizer failed on 'text'...: called `Result::unwrap"):
        encode(Panicking(), ["text"], "tok.json")

    _, tok = load_tokenizer(_byte_level(tmp_path / "slow.json"))
    monkeypatch.setattr(tokenization, "SLOW_AFTER_S", 0.0)
    monkeypatch.setattr(tokenization, "MIN_CHARS_PER_S", 10**12)  # every call is too slow now
    with pytest.raises(DataError, match=r"^slow.json: the tokenizer took [\d.]+ s for 94 characters from 'The quick"):
        encode(tok, [TEXT], "slow.json")


def test_long_documents_encode_in_pieces_as_in_one_call(tmp_path):
    _, bpe = load_tokenizer(_byte_level(tmp_path / "bpe.json"))
    doc = TEXT * 40 + "x" * 2500 + TEXT * 3  # the run without whitespace is cut at 1,000 characters
    wordpiece = make_tokenizer(tokenization.Vocab(train_wordpiece([TEXT] * 3, 120), "trained"))
    for tok in (bpe, wordpiece):
        got = encode(tok, [TEXT * 40, doc, TEXT], "t")
        want = tok.encode_batch_fast([TEXT * 40, doc, TEXT], add_special_tokens=False)
        assert [e.ids for e in got][::2] == [e.ids for e in want][::2] and len(got[0].ids) > 500
    assert got[1].ids[-5:] == want[1].ids[-5:]  # WordPiece: the 2,500 x's are 3 [UNK] words, not one
