"""Sequence lengths for the benchmarks: a built-in approximation of MLPerf BERT's, or the real
lengths of a prepared data directory.

The built-in distribution is a stand-in, not a measurement: about 22% of samples fill all
512 tokens, 10% are short samples of uniform length (``short_seq_prob`` 0.1), and the rest
follow a gamma distribution (shape 2, mean ~165) clipped to [20, 511], which puts the mean
near 250 tokens, about half of 512, as the MLPerf packing analyses report for the
Wikipedia data. With ``--data-dir`` the benchmarks read the true lengths instead: the sums
of ``input_mask`` (fixed layout) or the lengths of ``input_ids`` (varlength layout) of the
``*.hdf5`` files there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MAX_LEN = 512


class LengthsError(ValueError):
    """A data directory whose lengths cannot be read (message names file and key)."""


def builtin_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    kind = rng.random(n)
    full = np.full(n, MAX_LEN)
    short = rng.integers(8, MAX_LEN + 1, n)
    body = np.clip(np.rint(rng.gamma(2.0, 82.0, n)), 20, MAX_LEN - 1).astype(np.int64)
    return np.where(kind < 0.22, full, np.where(kind < 0.32, short, body)).astype(np.int64)


def data_dir_lengths(data_dir: str, limit: int = 200_000) -> np.ndarray:
    """All sample lengths of the HDF5 shards in data_dir (at most ``limit``)."""
    import h5py

    files = sorted(Path(data_dir).glob("*.hdf5")) + sorted(Path(data_dir).glob("*.h5"))
    if not files:
        raise LengthsError(f"{data_dir}: no *.hdf5 files")
    out: list[np.ndarray] = []
    total = 0
    for path in files:
        try:
            with h5py.File(path, "r") as f:
                if "input_mask" in f:
                    lens = np.asarray(f["input_mask"][: limit - total]).astype(bool).sum(1)
                elif "input_ids" in f:
                    lens = np.array([len(x) for x in f["input_ids"][: limit - total]])
                else:
                    raise LengthsError(f"{path}: neither 'input_mask' nor 'input_ids' found")
        except OSError as e:
            raise LengthsError(f"{path}: cannot read ({e})") from None
        out.append(lens.astype(np.int64))
        total += len(lens)
        if total >= limit:
            break
    lengths = np.concatenate(out)
    if not len(lengths) or lengths.min() < 1:
        raise LengthsError(f"{data_dir}: found an empty sample or no samples")
    return lengths


class LengthSampler:
    """Draws batches of sequence lengths (seeded)."""

    def __init__(self, data_dir: str | None = None, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.pool = data_dir_lengths(data_dir) if data_dir else None
        self.source = f"data dir {data_dir}" if data_dir else "built-in MLPerf-like distribution"

    def batch(self, n: int) -> list[int]:
        if self.pool is not None:
            return [int(x) for x in self.rng.choice(self.pool, n)]
        return [int(x) for x in builtin_lengths(self.rng, n)]
