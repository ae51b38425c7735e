"""Synthetic data for tests and benchmarks: random SampleBlocks, HDF5 shards and text corpora.

Everything here is seeded by its caller, so a failing test reproduces.
"""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np

from data.hdf5io import write_file
from data.samples import SampleBlock


def random_block(
    n: int, seed: int, max_seq_length: int = 128, max_predictions: int = 20, vocab_size: int = 1000, min_len: int = 5
) -> SampleBlock:
    """n samples shaped like prepared data: [CLS] A [SEP] B [SEP], sorted masked positions
    that avoid the special tokens, lengths uniform in [min_len, max_seq_length]."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(min_len, max_seq_length + 1, n).astype(np.int32)
    len_a = np.array([rng.integers(1, ln - 3 + 1) for ln in lens], dtype=np.int64)
    rows = []
    for ln, la in zip(lens.tolist(), len_a.tolist()):
        tok = rng.integers(5, vocab_size, ln).astype(np.int32)
        tok[0], tok[la + 1], tok[ln - 1] = 2, 3, 3
        seg = (np.arange(ln) >= la + 2).astype(np.int8)
        cand = np.setdiff1d(np.arange(1, ln - 1), [la + 1])
        k = int(min(max_predictions, max(1, round(ln * 0.15)), len(cand)))
        pos = np.sort(rng.choice(cand, k, replace=False)).astype(np.int32)
        rows.append((tok, seg, pos, rng.integers(5, vocab_size, k).astype(np.int32), k))
    ids, segs, positions, labels, counts = zip(*rows)
    return SampleBlock(
        input_ids=np.concatenate(ids),
        segment_ids=np.concatenate(segs),
        seq_lens=lens,
        masked_positions=np.concatenate(positions),
        masked_ids=np.concatenate(labels),
        masked_counts=np.array(counts, np.int32),
        nsp_labels=rng.integers(0, 2, n).astype(np.int8),
    )


def write_shards(
    directory,
    sizes: list[int],
    seed: int,
    layout: str = "fixed",
    max_seq_length: int = 64,
    max_predictions: int = 10,
    vocab_size: int = 1000,
) -> list[Path]:
    """HDF5 files ``part_%05d_of_%05d.hdf5`` with the given sample counts."""

    paths = [Path(directory) / f"part_{i:05d}_of_{len(sizes):05d}.hdf5" for i in range(len(sizes))]
    for i, (p, n) in enumerate(zip(paths, sizes)):
        block = random_block(n, seed * 1000 + i, max_seq_length, max_predictions, vocab_size)
        write_file(p, block, layout, max_seq_length, max_predictions)
    return paths


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
