"""Random batches in MLPerf's fixed layout for tests (seeded; no files needed)."""

from __future__ import annotations

import numpy as np

from data.batch import UnpaddedBatch, unpad


def fixed_layout(lengths, vocab_size: int, seq_len: int | None = None, max_predictions: int = 20,
                 seed: int = 0) -> dict[str, np.ndarray]:
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
        seg[i, n // 2:n] = 1
        mask[i, :n] = 1
        k = min(max_predictions, max(1, round(0.15 * (n - 1)))) if n > 1 else 0
        pos = np.sort(rng.choice(np.arange(1, n), size=k, replace=False)) if k else np.zeros(0, np.int64)
        mpos[i, :k] = pos
        mids[i, :k] = rng.integers(1, vocab_size, k)
    nsp = rng.integers(0, 2, b)
    return dict(input_ids=ids, segment_ids=seg, input_mask=mask, masked_lm_positions=mpos,
                masked_lm_ids=mids, next_sentence_labels=nsp)


def random_batch(lengths, vocab_size: int, seed: int = 0, **kw) -> UnpaddedBatch:
    return unpad(**fixed_layout(lengths, vocab_size, seed=seed, **kw))
