"""Synthetic data for tests and benchmarks: random SampleBlocks and HDF5 shards.

Everything here is seeded by its caller, so a failing test reproduces.
"""

from __future__ import annotations

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
