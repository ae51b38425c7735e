"""Random batches in MLPerf's fixed layout for tests (seeded; no files needed)."""

from __future__ import annotations

import numpy as np

from data.batch import UnpaddedBatch, unpad


def fixed_layout(
    lengths, vocab_size: int, seq_len: int | None = None, max_predictions: int = 20, seed: int = 0
) -> dict[str, np.ndarray]:
    """Arrays of the fixed layout for sequences of the given lengths.

    Real tokens avoid id 0 ([PAD]); about 15% of each sequence's non-[CLS] positions are
    masked (at least one where the sequence has more than one token), padded with 0.
    """
    rng = np.random.default_rng(seed)
    b = len(lengths)
    s = seq_len or max(lengths)
    ids = np.zeros((b, s), np.int64)
    seg = np.zeros((b, s), np.int64)
    mask = np.zeros((b, s), np.int64)
    mpos = np.zeros((b, max_predictions), np.int64)
    mids = np.zeros((b, max_predictions), np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1, vocab_size, n)
        seg[i, n // 2 : n] = 1
        mask[i, :n] = 1
        k = min(max_predictions, max(1, round(0.15 * (n - 1)))) if n > 1 else 0
        pos = np.sort(rng.choice(np.arange(1, n), size=k, replace=False)) if k else np.zeros(0, np.int64)
        mpos[i, :k] = pos
        mids[i, :k] = rng.integers(1, vocab_size, k)
    nsp = rng.integers(0, 2, b)
    return dict(
        input_ids=ids,
        segment_ids=seg,
        input_mask=mask,
        masked_lm_positions=mpos,
        masked_lm_ids=mids,
        next_sentence_labels=nsp,
    )


def random_batch(lengths, vocab_size: int, seed: int = 0, **kw) -> UnpaddedBatch:
    return unpad(**fixed_layout(lengths, vocab_size, seed=seed, **kw))


def write_fixed_file(path, lengths, vocab_size: int, seq_len: int, max_predictions: int = 20, seed: int = 0) -> None:
    """One HDF5 file in MLPerf's fixed layout (DESIGN.md), written with h5py directly."""
    write_arrays(path, fixed_layout(lengths, vocab_size, seq_len=seq_len, max_predictions=max_predictions, seed=seed))


def write_arrays(path, a: dict[str, np.ndarray]) -> None:
    """The fixed layout's arrays, in its dtypes, into one HDF5 file."""
    import h5py

    with h5py.File(path, "w") as f:
        f.create_dataset("input_ids", data=a["input_ids"].astype(np.int16))
        f.create_dataset("input_mask", data=a["input_mask"].astype(np.int8))
        f.create_dataset("segment_ids", data=a["segment_ids"].astype(np.int8))
        f.create_dataset("masked_lm_positions", data=a["masked_lm_positions"].astype(np.int16))
        f.create_dataset("masked_lm_ids", data=a["masked_lm_ids"].astype(np.int16))
        f.create_dataset("next_sentence_labels", data=a["next_sentence_labels"].astype(np.int8))


def write_dataset(
    root,
    num_files: int = 4,
    per_file: int = 48,
    eval_samples: int = 40,
    vocab_size: int = 96,
    seq_len: int = 64,
    seed: int = 0,
):
    """A tiny training set (train/part_*.hdf5) and eval file; returns (train_dir, eval_file)."""
    import os

    rng = np.random.default_rng(seed)
    train = os.path.join(root, "train")
    os.makedirs(train, exist_ok=True)
    os.makedirs(os.path.join(root, "eval"), exist_ok=True)
    for i in range(num_files):
        lengths = rng.integers(8, seq_len + 1, per_file)
        write_fixed_file(
            os.path.join(train, f"part_{i:05d}_of_{num_files:05d}.hdf5"),
            lengths,
            vocab_size,
            seq_len,
            seed=seed * 1000 + i,
        )
    eval_file = os.path.join(root, "eval", "part_eval_10k.hdf5")
    write_fixed_file(eval_file, rng.integers(8, seq_len + 1, eval_samples), vocab_size, seq_len, seed=seed + 999)
    return train, eval_file


def write_learnable_dataset(
    root, num_files: int = 4, per_file: int = 64, eval_samples: int = 200, vocab_size: int = 96, seq_len: int = 64
):
    """Like ``write_dataset``, but masked-LM accuracy can rise: each sequence repeats a motif
    of 1 to 3 random ids from 5..vocab_size-1, and each masked position holds [MASK] (id 4)
    with the true id as its label, so a model that learns to copy the token one period away
    predicts it. Returns (train_dir, eval_file)."""
    import os

    def write(path, n, seed):
        rng = np.random.default_rng(seed)
        a = fixed_layout(rng.integers(8, seq_len + 1, n), vocab_size, seq_len=seq_len, seed=seed)
        span = vocab_size - 5
        for i in range(n):
            length = int(a["input_mask"][i].sum())
            motif = 5 + rng.integers(0, span, rng.integers(1, 4))
            a["input_ids"][i, :length] = np.resize(motif, length)
            k = int((a["masked_lm_positions"][i] > 0).sum())
            pos = a["masked_lm_positions"][i, :k]
            a["masked_lm_ids"][i, :k] = a["input_ids"][i, pos]
            a["input_ids"][i, pos] = 4
        write_arrays(path, a)

    train = os.path.join(root, "train")
    os.makedirs(train, exist_ok=True)
    os.makedirs(os.path.join(root, "eval"), exist_ok=True)
    for i in range(num_files):
        write(os.path.join(train, f"part_{i:05d}_of_{num_files:05d}.hdf5"), per_file, seed=i)
    eval_file = os.path.join(root, "eval", "part_eval_10k.hdf5")
    write(eval_file, eval_samples, seed=999)
    return train, eval_file
