"""Vocabularies and the tokenizer that ``data.prepare`` runs on every sentence (or document).

A WordPiece ``vocab.txt`` (BERT's uncased WordPiece by the ``tokenizers`` library) or a
``tokenizers`` JSON (run as the file defines it, less its post-processor, padding and
truncation), encoded under the bounds of docs/data.md#files-the-readers-refuse;
``train_wordpiece`` learns a vocabulary deterministically (docs/data.md#preparing-data).
"""

from __future__ import annotations

import heapq
import json
import math
import os
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from itertools import chain
from pathlib import Path

from common.errors import DataError
from common.files import UnsafeFile, read_checked, write_text

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MAX_VOCAB_SIZE = 32768  # the fixed and varlength HDF5 layouts store token ids as int16
# A tokenizers JSON's (ModernBERT: 50,368): the token store is uint16, files hold int32 ids (hdf5io.id_dtype).
MAX_WIDE_VOCAB_SIZE = 65536
MAX_WORD_CHARS = 100
MAX_TOKENIZER_BYTES = 64 << 20  # a vocab.txt or tokenizer JSON (ModernBERT's: 3.5 MB)
# Bounds on what a tokenizer JSON's pipeline may do to a document (docs/data.md#tokenizer-json):
MAX_GROWTH = 100  # characters a chain of Replace normalizers may make of one
TOKENS_PER_CHAR = 8  # byte-level BPE needs up to 4 per character
PIECE_CHARS = 1000  # a long document is encoded in pieces this long, cut before a whitespace run
BATCH_CHARS = 16_000  # characters per encode call, timed
MIN_CHARS_PER_S = 10_000  # a call slower than this after SLOW_AFTER_S stops the run
SLOW_AFTER_S = 1.0
_RUN_START = re.compile(r"(?<=\S)\s")
# A ^C or exit is never a tokenizer's fault (a Rust panic, caught as BaseException, is).
_ABORTS = (KeyboardInterrupt, SystemExit, GeneratorExit)


class Vocab:
    """A WordPiece vocabulary: ``tokens[i]`` is the piece with id i; ``cls_id`` etc. those of the specials."""

    def __init__(self, tokens: list[str], source: str, max_size: int = MAX_VOCAB_SIZE):
        self.tokens = tokens
        self.source = source
        self.ids = {t: i for i, t in enumerate(tokens)}
        if len(self.ids) != len(tokens):
            first: dict[str, int] = {}
            line, t = next((line, t) for line, t in enumerate(tokens, 1) if first.setdefault(t, line) != line)
            raise DataError(f"{source}: line {line}: duplicate vocabulary entry {t!r}")
        if missing := [t for t in SPECIAL_TOKENS if t not in self.ids]:
            raise DataError(f"{source}: vocabulary is missing {', '.join(missing)}")
        if len(tokens) > max_size:
            why = "the HDF5 layouts store ids as int16" if max_size == MAX_VOCAB_SIZE else "ids are stored as uint16"
            raise DataError(f"{source}: {len(tokens)} entries, but {why} (at most {max_size} entries)")
        self.unk_id, self.cls_id, self.sep_id, self.mask_id = (self.ids[t] for t in SPECIAL_TOKENS[1:])

    def __len__(self) -> int:
        return len(self.tokens)


def load_vocab(path: str | os.PathLike) -> Vocab:
    """Read a BERT ``vocab.txt`` (one piece per line, the line number is the id)."""
    path = Path(path)
    raw = _read(path, "vocabulary")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line}: vocabulary is not UTF-8") from e
    tokens = text.split("\n")
    if tokens and tokens[-1] == "":
        tokens.pop()
    tokens = [t.rstrip("\r") for t in tokens]
    if not tokens:
        raise DataError(f"{path}: the vocabulary is empty")
    for line, t in enumerate(tokens, 1):
        if not t.strip():
            raise DataError(f"{path}: line {line}: empty vocabulary entry")
    return Vocab(tokens, str(path))


def _read(path: Path, what: str) -> bytes:
    try:
        return read_checked(path, max_bytes=MAX_TOKENIZER_BYTES, what=what)
    except UnsafeFile as e:
        raise DataError(str(e)) from e
    except OSError as e:
        raise DataError(f"{path}: cannot read the {what} ({e.strerror or e})") from e


def _growth(node) -> float:
    """How many characters a tokenizer JSON's normalizer can make of one, at most (Replace, Sequence; others: 1)."""
    if not isinstance(node, dict):
        return 1.0
    if node.get("type") == "Sequence" and isinstance(node.get("normalizers"), list):
        return math.prod(map(_growth, node["normalizers"]), start=1.0)
    if node.get("type") == "Replace":
        content, pattern = node.get("content"), node.get("pattern")
        text = pattern.get("String") if isinstance(pattern, dict) else None
        n = len(content) if isinstance(content, str) else 0
        return (n / len(text)) if isinstance(text, str) and text else n + 1.0  # a regex may match ""
    return 1.0


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def load_tokenizer(path: str | os.PathLike, is_json: bool | None = None):
    """(Vocab, tokenizers.Tokenizer) of a ``tokenizers`` JSON or a WordPiece vocab.txt
    (``is_json``; None: a JSON when the name ends in ``.json``).

    A JSON's vocabulary (added tokens included) must number its entries 0..V-1 without gaps,
    so that ``len(vocab)`` bounds every id the tokenizer can produce."""
    path = Path(path)
    if not (path.suffix == ".json" if is_json is None else is_json):
        vocab = load_vocab(path)
        return vocab, make_tokenizer(vocab)
    from tokenizers import Tokenizer

    raw = _read(path, "tokenizer")
    try:
        raw = raw.decode("utf-8")
        growth = _growth(json.loads(raw).get("normalizer"))
    except UnicodeDecodeError:
        raise DataError(f"{path}: the tokenizer file is not UTF-8") from None
    except (ValueError, RecursionError, AttributeError) as e:
        raise DataError(f"{path}: not a tokenizers JSON file ({_first_line(e)})") from e
    if growth > MAX_GROWTH:
        raise DataError(f"{path}: its normalizer can make {growth:,.0f} characters of one (at most {MAX_GROWTH})")
    try:
        tok = Tokenizer.from_str(raw)
    except _ABORTS:
        raise
    except BaseException as e:  # a bare Exception for every parse error; a bad regex may panic
        raise DataError(f"{path}: not a tokenizers JSON file ({_first_line(e)})") from e
    tok.no_padding()  # the preparation decides lengths, not the file
    tok.no_truncation()
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    if gaps := [i for i in range(len(by_id)) if i not in by_id]:
        raise DataError(f"{path}: the vocabulary has no entry with id {gaps[0]} (ids must be 0..{len(by_id) - 1})")
    return Vocab([by_id[i] for i in range(len(by_id))], str(path), max_size=MAX_WIDE_VOCAB_SIZE), tok


def _pieces(text: str) -> list[str]:
    """``text`` in pieces of at most PIECE_CHARS, cut before a whitespace run where one lies within the bound."""
    out, start = [], 0
    while len(text) - start > PIECE_CHARS:
        runs = _RUN_START.finditer(text, start + 1, start + PIECE_CHARS)
        cut = max((m.start() for m in runs), default=start + PIECE_CHARS)
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def encode(tok, texts: list[str], source: str) -> list:
    """``tok.encode_batch_fast(texts, add_special_tokens=False)`` under the bounds above (long
    texts encoded in pieces and merged; docs/data.md#files-the-readers-refuse): every breach,
    a Rust panic included, is a one-line DataError naming ``source``."""
    from tokenizers import Encoding

    pieces = [_pieces(t) if len(t) > PIECE_CHARS else [t] for t in texts]
    flat = [p for ps in pieces for p in ps]
    encoded, a = [], 0
    while a < len(flat):
        b, chars = a, 0
        while b < len(flat) and (b == a or chars + len(flat[b]) <= BATCH_CHARS):
            chars += len(flat[b])
            b += 1
        start = time.monotonic()
        try:
            encoded += tok.encode_batch_fast(flat[a:b], add_special_tokens=False)
        except _ABORTS:
            raise
        except BaseException as e:
            raise DataError(f"{source}: the tokenizer failed on {flat[a][:40]!r}...: {_first_line(e)}") from e
        took = time.monotonic() - start
        if took > SLOW_AFTER_S + chars / MIN_CHARS_PER_S:
            raise DataError(
                f"{source}: the tokenizer took {took:.1f} s for {chars:,} characters from {flat[a][:40]!r} "
                f"(under {MIN_CHARS_PER_S:,} a second: a pathological regex?)"
            )
        a = b
    out, i = [], 0
    for text, ps in zip(texts, pieces):
        e = encoded[i] if len(ps) == 1 else Encoding.merge(encoded[i : i + len(ps)], growing_offsets=True)
        i += len(ps)
        if len(e.ids) > TOKENS_PER_CHAR * len(text) + 16:
            raise DataError(
                f"{source}: the tokenizer made {len(e.ids):,} tokens of {len(text):,} characters "
                f"from {text[:40]!r} (at most {TOKENS_PER_CHAR} a character)"
            )
        out.append(e)
    return out


def write_vocab(path: str | os.PathLike, tokens: list[str]) -> None:
    """Write ``vocab.txt`` under a temporary name, then rename it into place."""
    try:
        write_text(path, "".join(t + "\n" for t in tokens))
    except OSError as e:
        raise DataError(f"{path}: cannot write the vocabulary ({e.strerror or e})") from e


def _normalizer_and_pretokenizer():
    from tokenizers import normalizers, pre_tokenizers

    return (
        normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True),
        pre_tokenizers.BertPreTokenizer(),
    )


def make_tokenizer(vocab: Vocab, max_word_chars: int = MAX_WORD_CHARS, unk_in_text: bool = True):
    """A ``tokenizers.Tokenizer`` for BERT uncased WordPiece over ``vocab.ids``.

    With ``unk_in_text``, ``[UNK]`` written in the text (WikiText's ``<unk>`` is rewritten to
    it) maps to the [UNK] id instead of being split into ``[``, ``unk``, ``]``.
    """
    from tokenizers import AddedToken, Tokenizer, models

    tok = Tokenizer(
        models.WordPiece(
            vocab=dict(vocab.ids),
            unk_token="[UNK]",
            continuing_subword_prefix="##",
            max_input_chars_per_word=max_word_chars,
        )
    )
    tok.normalizer, tok.pre_tokenizer = _normalizer_and_pretokenizer()
    if unk_in_text:
        tok.add_special_tokens([AddedToken("[UNK]", normalized=False, special=True)])
    return tok


def train_wordpiece(
    sentences: Iterable[str], vocab_size: int, min_frequency: int = 2, limit_alphabet: int = 1000
) -> list[str]:
    """Learn a WordPiece vocabulary of at most ``vocab_size`` pieces, deterministically: docs/data.md, Vocabulary."""
    min_entries = len(SPECIAL_TOKENS) + 2
    if vocab_size < min_entries or vocab_size > MAX_VOCAB_SIZE:
        raise DataError(f"--train-vocab {vocab_size}: must lie in [{min_entries}, {MAX_VOCAB_SIZE}]")
    normalizer, pre = _normalizer_and_pretokenizer()
    words: Counter[str] = Counter()
    batch, size = [], 0
    # About 1 MiB at a time (the words do not depend on where batches end); the final "" ends the last.
    for s in chain(sentences, [""]):
        batch.append(s.replace("[UNK]", " "))
        size += len(batch[-1])
        if size > 1 << 20 or not s:
            words.update(w for w, _ in pre.pre_tokenize_str(normalizer.normalize_str("\n".join(batch))))
            batch, size = [], 0
    if not words:
        raise DataError("--train-vocab: the input holds no words to learn a vocabulary from")

    chars: Counter[str] = Counter()
    for w, c in words.items():
        if len(w) <= MAX_WORD_CHARS:
            for ch in w:
                chars[ch] += c
    room = vocab_size - len(SPECIAL_TOKENS)
    alphabet = {ch for ch, _ in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0]))[:limit_alphabet]}

    word_list = sorted(w for w in words if len(w) <= MAX_WORD_CHARS and set(w) <= alphabet)
    initial = {w[0] for w in word_list} | {"##" + ch for w in word_list for ch in w[1:]}
    pieces = list(SPECIAL_TOKENS) + sorted(initial)
    if len(pieces) > vocab_size:
        # Word-initial forms first (they cover every word's start), then ## forms by frequency.
        cont = sorted((p for p in initial if p.startswith("##")), key=lambda p: (-chars[p[2:]], p))
        starts = sorted(p for p in initial if not p.startswith("##"))
        keep = set(starts[:room]) | set(cont[: max(0, room - len(starts))])
        pieces = list(SPECIAL_TOKENS) + sorted(keep)
        word_list = [w for w in word_list if w[0] in keep and all("##" + ch in keep for ch in w[1:])]
    ids = {p: i for i, p in enumerate(pieces)}  # symbol -> id, merged symbols included

    seqs = [[ids[w[0]]] + [ids["##" + ch] for ch in w[1:]] for w in word_list]
    counts = [words[w] for w in word_list]
    pair_count: Counter[tuple[int, int]] = Counter()
    pair_words: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, (seq, c) in enumerate(zip(seqs, counts)):
        for p in zip(seq, seq[1:]):
            pair_count[p] += c
            pair_words[p].add(wi)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)

    while len(pieces) < vocab_size and heap:
        negc, pair = heapq.heappop(heap)
        c = pair_count[pair]
        if c != -negc or c == 0:
            continue  # stale heap entry; the current count was pushed when it changed
        if c < min_frequency:
            break
        a, b = pair
        new = pieces[a] + pieces[b].removeprefix("##")
        if new not in ids:
            ids[new] = len(pieces)
            pieces.append(new)
        nid = ids[new]
        changed: Counter[tuple[int, int]] = Counter()
        for wi in sorted(pair_words.pop(pair, ())):
            seq, wc = seqs[wi], counts[wi]
            for p in zip(seq, seq[1:]):
                changed[p] -= wc
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    out.append(nid)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[wi] = out
            for p in zip(out, out[1:]):
                changed[p] += wc
                pair_words[p].add(wi)
        pair_count.pop(pair, None)
        for p, d in changed.items():
            if p == pair or d == 0:
                continue
            n = pair_count[p] + d
            if n > 0:
                pair_count[p] = n
                heapq.heappush(heap, (-n, p))
            else:
                pair_count.pop(p, None)
    return pieces
