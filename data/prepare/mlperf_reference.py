"""MLPerf's reference preprocessing, sample for sample: ``python -m data.prepare --reference``.

Reproduces ``create_pretraining_data.py`` run on each text part with ``random.Random(seed)``, bit
for bit: one fixed-layout HDF5 file per input file, so ``mlperf_dataset``'s chop, shuffle and
checksums match the published ones. Pure-ASCII lines go through ``tokenizers``, the others through
the Python tokenizer below: [docs/data.md](../docs/data.md#how-it-matches-the-reference).
"""

from __future__ import annotations

import bisect
import os
import random
import re
import unicodedata
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate, chain

import numpy as np

from common.errors import DataError
from data.hdf5io import write_fixed_arrays
from data.prepare.tokenization import make_tokenizer

MAX_WORD_CHARS = 200  # the reference WordPiece's max_input_chars_per_word
_HF_BATCH = 8192  # lines per tokenizers batch


class RefVocab:
    """A vocab.txt read as the reference does: lines stripped, ids numbered by first occurrence."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.ids: dict[str, int] = {}
        try:
            with open(path, encoding="utf-8", newline=None) as fh:
                for line in fh:
                    self.ids.setdefault(line.strip(), len(self.ids))
        except OSError as e:
            raise DataError(f"{path}: cannot read the vocabulary ({e.strerror or e})") from e
        except UnicodeDecodeError:
            raise DataError(f"{path}: vocabulary is not UTF-8") from None
        if missing := [t for t in ("[UNK]", "[CLS]", "[SEP]", "[MASK]") if t not in self.ids]:
            raise DataError(f"{path}: vocabulary is missing {', '.join(missing)}")
        if len(self.ids) > 32768:
            raise DataError(f"{path}: {len(self.ids)} entries, but the HDF5 layout stores ids as int16")

    def __len__(self) -> int:
        return len(self.ids)


def _is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    return ch not in "\t\n\r" and unicodedata.category(ch) in ("Cc", "Cf")


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    return 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or unicodedata.category(ch)[0] == "P"


# BERT's _is_chinese_char: the CJK ideograph blocks.
_CJK = re.compile(
    "[\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f\U0002b740-\U0002b81f"
    "\U0002b820-\U0002ceaf\uf900-\ufaff\U0002f800-\U0002fa1f]"
)


class RefTokenizer:
    """BERT's uncased tokenizer with the reference's exact behaviour; ``encode_many`` gives ids."""

    def __init__(self, vocab: RefVocab):
        self.vocab = vocab
        self.unk = vocab.ids["[UNK]"]
        self._word_cache: dict[str, list[int]] = {}

    @cached_property
    def _hf(self):
        # The reference splits "[UNK]" in the text like any other word.
        return make_tokenizer(self.vocab, MAX_WORD_CHARS, unk_in_text=False)

    def _wordpiece(self, word: str) -> list[int]:
        ids = self.vocab.ids
        if len(word) > MAX_WORD_CHARS:
            return [self.unk]
        out, start = [], 0
        while start < len(word):  # the longest piece in the vocabulary at each start
            for end in range(len(word), start, -1):
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in ids:
                    out.append(ids[piece])
                    break
            else:
                return [self.unk]
            start = end
        return out

    def _word(self, token: str) -> list[int]:
        """A whitespace-separated token -> ids: lower case, strip accents, split punctuation, WordPiece."""
        hit = self._word_cache.get(token)
        if hit is not None:
            return hit
        text = "".join(ch for ch in unicodedata.normalize("NFD", token.lower()) if unicodedata.category(ch) != "Mn")
        # Punctuation split off: the reference joins the pieces with spaces and splits again (str.split).
        words = "".join(f" {ch} " if _is_punctuation(ch) else ch for ch in text).split()
        ids = [i for word in words for i in self._wordpiece(word)]
        if len(self._word_cache) > 1_000_000:
            self._word_cache.clear()
        self._word_cache[token] = ids
        return ids

    def encode_python(self, line: str) -> list[int]:
        """The pure-Python path (any text)."""
        kept = (ch for ch in line if ch not in "\x00\ufffd" and not _is_control(ch))
        text = "".join(" " if _is_whitespace(ch) else f" {ch} " if _CJK.match(ch) else ch for ch in kept)
        return [i for token in text.split() for i in self._word(token)]

    def encode_many(self, lines: list[str]) -> list[list[int]]:
        """Ids of each line: ASCII lines through ``tokenizers``, the others in Python."""
        out: list[list[int] | None] = [None] * len(lines)
        ascii_idx = [i for i, s in enumerate(lines) if s.isascii()]
        for b in range(0, len(ascii_idx), _HF_BATCH):
            idx = ascii_idx[b : b + _HF_BATCH]
            for i, enc in zip(idx, self._hf.encode_batch_fast([lines[i] for i in idx], add_special_tokens=False)):
                out[i] = enc.ids
        return [self.encode_python(s) if ids is None else ids for s, ids in zip(lines, out)]


@dataclass
class Documents:
    """Documents as flat token arrays: ``tokens[d]`` int32 [tokens of document d],
    ``offsets[d]`` its sentence boundaries (a list, sentence k is [offsets[k], offsets[k+1]))."""

    tokens: list[np.ndarray]
    offsets: list[list[int]]

    def __len__(self) -> int:
        return len(self.tokens)


def _first_bad_line(path) -> int:
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return n
    return 0


def read_documents(path: str | os.PathLike, tokenizer: RefTokenizer) -> Documents:
    """The reference's document list for one text file, in file order (before the shuffle)."""
    try:
        with open(path, encoding="utf-8", newline=None) as fh:
            lines = [line.strip() for line in fh]
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from e
    except UnicodeDecodeError:
        raise DataError(f"{path}: line {_first_bad_line(path)}: not UTF-8") from None
    docs: list[list[list[int]]] = [[]]
    encoded = iter(tokenizer.encode_many([s for s in lines if s]))
    for s in lines:
        if not s:
            docs.append([])
        elif ids := next(encoded):
            docs[-1].append(ids)
    docs = [d for d in docs if d]
    offsets = [[0, *accumulate(map(len, d))] for d in docs]
    tokens = [np.fromiter(chain.from_iterable(d), dtype=np.int32, count=o[-1]) for d, o in zip(docs, offsets)]
    return Documents(tokens, offsets)


@dataclass(frozen=True)
class RefParams:
    max_seq_length: int = 512
    max_predictions: int = 76
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 10
    seed: int = 12345

    def __post_init__(self):
        if not 5 <= self.max_seq_length <= 32767:
            raise DataError(f"--max-seq-length {self.max_seq_length}: must lie in [5, 32767]")
        if not 1 <= self.max_predictions <= self.max_seq_length:
            raise DataError(f"--max-predictions {self.max_predictions}: must lie in [1, max_seq_length]")
        if self.dupe_factor < 1:
            raise DataError(f"--dupe-factor {self.dupe_factor}: must be >= 1")


def pair_spans(offs, d: int, n_docs: int, offsets_of, max_num_tokens: int, short_seq_prob: float, rng: random.Random):
    """One pass of the reference's ``create_instances_from_document`` over document ``d`` of
    ``n_docs``, its sentence k being tokens [offs[k], offs[k+1]): yields each pair, before
    truncation, as (a0, a1, r, b0, b1, is_random), segment B from document r (``offsets_of(r)``:
    its ``offs``). The caller's draws for a pair come before the next pair's, as in the reference."""
    n = len(offs) - 1
    target = rng.randint(2, max_num_tokens) if rng.random() < short_seq_prob else max_num_tokens
    start = i = 0  # start: first sentence of the chunk being gathered
    while i < n:
        if i == n - 1 or offs[i + 1] - offs[start] >= target:
            k = i - start + 1
            a_end = start + (rng.randint(1, k - 1) if k >= 2 else 1)
            if k == 1 or rng.random() < 0.5:
                for _ in range(10):
                    r = rng.randint(0, n_docs - 1)
                    if r != d:
                        break
                roffs = offsets_of(r)
                j = rng.randint(0, len(roffs) - 2)
                # Whole sentences from j on, until B reaches the target less A's length or the document ends.
                target_b = target - (offs[a_end] - offs[start])
                end = min(bisect.bisect_left(roffs, roffs[j] + target_b, j + 1), len(roffs) - 1)
                yield offs[start], offs[a_end], r, roffs[j], roffs[end], True
                i = a_end - 1  # the chunk's sentences after A start the next chunk
            else:
                yield offs[start], offs[a_end], d, offs[a_end], offs[i + 1], False
            start = i + 1
        i += 1


class _Rows:
    """The fixed-layout rows of the instances, grown as they are made."""

    def __init__(self, s: int, p: int, cap: int = 1024):
        self.s, self.n = s, 0
        self.a = {
            "input_ids": np.zeros((cap, s), np.int16),
            "len_a": np.zeros(cap, np.int32),
            "len": np.zeros(cap, np.int32),
            "masked_lm_positions": np.zeros((cap, p), np.int16),
            "masked_lm_ids": np.zeros((cap, p), np.int16),
            "next_sentence_labels": np.zeros(cap, np.int8),
        }

    def add(self, ids: np.ndarray, len_a: int, positions: list[int], labels: list[int], is_random: bool):
        if self.n == len(self.a["len"]):  # full: double every array
            self.a = {k: np.concatenate([v, np.zeros_like(v)]) for k, v in self.a.items()}
        a, r = self.a, self.n
        a["input_ids"][r, : len(ids)] = ids
        a["len_a"][r] = len_a
        a["len"][r] = len(ids)
        a["masked_lm_positions"][r, : len(positions)] = positions
        a["masked_lm_ids"][r, : len(labels)] = labels
        a["next_sentence_labels"][r] = is_random
        self.n += 1

    def fixed_arrays(self, order: list[int]) -> dict:
        """The six fixed-layout arrays, rows taken in ``order``."""
        out = {k: v[np.asarray(order, dtype=np.int64)] for k, v in self.a.items()}
        lens, len_a = out.pop("len")[:, None], out.pop("len_a")[:, None]
        col = np.arange(self.s)[None, :]
        out["input_mask"] = (col < lens).astype(np.int8)
        out["segment_ids"] = ((col >= len_a + 2) & (col < lens)).astype(np.int8)
        return out


class _Maker:
    """Makes the instances of one input file, drawing from ``rng`` in the reference's order."""

    def __init__(self, docs: Documents, vocab: RefVocab, prm: RefParams, rng: random.Random):
        self.docs, self.prm, self.rng = docs, prm, rng
        self.vocab_size = len(vocab)
        self.cls, self.sep, self.mask = vocab.ids["[CLS]"], vocab.ids["[SEP]"], vocab.ids["[MASK]"]
        self.rows = _Rows(prm.max_seq_length, prm.max_predictions)

    def document(self, d: int) -> None:
        docs, max_num_tokens = self.docs, self.prm.max_seq_length - 3
        spans = pair_spans(
            docs.offsets[d], d, len(docs), lambda r: docs.offsets[r], max_num_tokens, self.prm.short_seq_prob, self.rng
        )
        for a0, a1, r, b0, b1, is_random in spans:
            self._instance((d, a0, a1), (r, b0, b1), is_random, max_num_tokens)

    def _instance(self, a, b, is_random: bool, max_num_tokens: int) -> None:
        rng = self.rng
        (da, a0, a1), (db, b0, b1) = a, b
        while (a1 - a0) + (b1 - b0) > max_num_tokens:
            front = rng.random() < 0.5
            if a1 - a0 > b1 - b0:
                a0, a1 = (a0 + 1, a1) if front else (a0, a1 - 1)
            else:
                b0, b1 = (b0 + 1, b1) if front else (b0, b1 - 1)
        la, lb = a1 - a0, b1 - b0
        ids = np.empty(la + lb + 3, np.int32)
        ids[0] = self.cls
        ids[1 : la + 1] = self.docs.tokens[da][a0:a1]
        ids[la + 1] = self.sep
        ids[la + 2 : la + 2 + lb] = self.docs.tokens[db][b0:b1]
        ids[-1] = self.sep
        # Masking: candidates are every position but [CLS] and the two [SEP]s.
        cand = list(range(1, la + 1)) + list(range(la + 2, la + 2 + lb))
        rng.shuffle(cand)
        num = min(self.prm.max_predictions, max(1, round(len(ids) * self.prm.masked_lm_prob)))
        picked = []
        for pos in cand[:num]:
            label = int(ids[pos])
            if rng.random() < 0.8:
                ids[pos] = self.mask
            elif rng.random() >= 0.5:
                ids[pos] = rng.randint(0, self.vocab_size - 1)
            picked.append((pos, label))
        picked.sort()
        self.rows.add(ids, la, [p for p, _ in picked], [t for _, t in picked], is_random)


def make_instances(docs: Documents, vocab: RefVocab, prm: RefParams) -> dict:
    """The reference's instances for one file's documents, as the six fixed-layout arrays."""
    rng = random.Random(prm.seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    shuffled = Documents([docs.tokens[i] for i in order], [docs.offsets[i] for i in order])
    maker = _Maker(shuffled, vocab, prm, rng)
    for _ in range(prm.dupe_factor):
        for d in range(len(shuffled)):
            maker.document(d)
    out_order = list(range(maker.rows.n))
    rng.shuffle(out_order)
    return maker.rows.fixed_arrays(out_order)


def prepare_file(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    vocab: RefVocab,
    prm: RefParams,
    tokenizer: RefTokenizer | None = None,
) -> int:
    """Text file -> the reference's fixed-layout HDF5 (written atomically); returns its sample count."""
    docs = read_documents(src, tokenizer or RefTokenizer(vocab))  # none: an empty file, as the reference writes
    arrays = make_instances(docs, vocab, prm)
    write_fixed_arrays(dst, arrays)
    return len(arrays["next_sentence_labels"])
