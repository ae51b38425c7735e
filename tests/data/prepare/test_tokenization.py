"""Vocabulary loading, the BERT uncased WordPiece tokenizer, and the deterministic WordPiece
vocabulary learner."""

from __future__ import annotations

import pytest

from common.errors import DataError
from data.prepare.tokenization import Vocab, load_vocab, make_tokenizer, train_wordpiece

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def test_tokenizer_is_bert_uncased_wordpiece(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text(
        "\n".join(SPECIALS + ["the", "lob", "##ster", "##s", "is", "blue", ",", ".", "cafe", "un", "##k"]) + "\n"
    )
    vocab = load_vocab(path)
    tok = make_tokenizer(vocab)
    enc = tok.encode("The LOBSTERS, Café is [UNK] unk blue.", add_special_tokens=False)
    assert enc.tokens == ["the", "lob", "##ster", "##s", ",", "cafe", "is", "[UNK]", "un", "##k", "blue", "."]
    assert enc.ids[7] == vocab.unk_id == 1
    assert tok.encode("zebra", add_special_tokens=False).ids == [vocab.unk_id]


def test_vocab_file_errors(tmp_path):
    p = tmp_path / "v.txt"
    p.write_text("\n".join(SPECIALS + ["a", "a"]) + "\n")
    with pytest.raises(DataError, match=r"v.txt: line 7: duplicate vocabulary entry 'a'"):
        load_vocab(p)
    p.write_bytes(b"[PAD]\n[UNK]\n\xff\n")
    with pytest.raises(DataError, match=r"v.txt: line 3: vocabulary is not UTF-8"):
        load_vocab(p)
    p.write_text("\n".join(SPECIALS[:2] + ["", "x"]))
    with pytest.raises(DataError, match=r"v.txt: line 3: empty vocabulary entry"):
        load_vocab(p)
    with pytest.raises(DataError, match=r"missing \[CLS\], \[SEP\], \[MASK\]"):
        Vocab(["[PAD]", "[UNK]", "x"], "mem")
    with pytest.raises(DataError, match="at most 32768 entries"):
        Vocab(SPECIALS + [f"w{i}" for i in range(32768)], "big")
    with pytest.raises(DataError, match="cannot read the vocabulary"):
        load_vocab(tmp_path / "missing.txt")


def test_train_wordpiece_merges_frequent_pairs_deterministically():
    text = ["the lower lowest newer newest", "low lower lowest", "new newer newest wider widest"] * 20
    a = train_wordpiece(iter(text), 60)
    assert a == train_wordpiece(iter(text), 60)
    assert a[:5] == SPECIALS and len(a) == len(set(a)) <= 60
    # Every character in both forms, then merges: frequent words end up whole.
    assert {"l", "##o", "##w", "n", "##e"} <= set(a)
    # "##w ##e" is the most frequent pair (lower, lowest, newer, newest: 160 times): merged first.
    first = a.index("w") + 1
    assert a[first] == "##we"
    assert {"low", "new", "lowest", "newest", "wider"} <= set(a)
    # A larger budget only adds pieces after the same first ones.
    b = train_wordpiece(iter(text), 80)
    assert b[: len(a)] == a
    # Covered words tokenise to known pieces.
    tok = make_tokenizer(Vocab(b, "trained"))
    assert "[UNK]" not in tok.encode("lowest newer", add_special_tokens=False).tokens


def test_train_wordpiece_bounds():
    with pytest.raises(DataError, match="--train-vocab 3: must lie in"):
        train_wordpiece(iter(["a b"]), 3)
    with pytest.raises(DataError, match="no words"):
        train_wordpiece(iter(["", "   "]), 100)
    # A budget smaller than the alphabet keeps the word-initial characters first.
    v = train_wordpiece(iter(["abcdefghij klmnopqrst"]), 12)
    assert len(v) == 12 and v[:5] == SPECIALS


def test_same_ids_as_transformers_bert_tokenizer(tmp_path):
    """Our tokenizer against transformers' pure-Python BertTokenizer (do_lower_case=True)."""
    transformers = pytest.importorskip("transformers")
    pieces = [
        "the",
        "quick",
        "brown",
        "fox",
        "jump",
        "##s",
        "##ed",
        "over",
        "lazy",
        "dog",
        "cafe",
        "naive",
        "a",
        "##b",
        "##c",
        "b",
        "c",
        ",",
        ".",
        "!",
        "'",
        "(",
        ")",
        "-",
        "1",
        "##2",
        "##3",
        "2",
        "3",
        "中",
        "文",
        "resume",
        "##s",
        "x",
        "##x",
        "e",
        "##e",
        "un",
        "##believ",
        "##able",
    ]
    vocab_list = SPECIALS + list(dict.fromkeys(pieces))
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(vocab_list) + "\n")
    ref = transformers.BertTokenizer(str(path), do_lower_case=True)
    ours = make_tokenizer(load_vocab(path))
    texts = [
        "The QUICK brown fox jumps over the lazy dog.",
        "Café naïve résumés!",
        "unbelievable, (abc) 123-321",
        "中文 x xxx eee",
        "  tabs\tand\nnewlines  ",
        "zzz unknownword fox's",
        "a" * 120 + " fox",
    ]
    for t in texts:
        want = ref.convert_tokens_to_ids(ref.tokenize(t))
        assert ours.encode(t, add_special_tokens=False).ids == want, t
