"""``SampleBlock``: a set of pretraining samples as flat numpy arrays (struct of arrays).

What moves between the loader, the rebalancer (which selects and exchanges samples) and
``data.collate``; selecting, concatenating and collating are a few vectorised numpy calls.
For n samples with lengths L_i and m_i masked positions:
    input_ids [sum L] int32, segment_ids [sum L] int8, seq_lens [n] int32,
    masked_positions [sum m] int32 (positions within the sample, never 0),
    masked_ids [sum m] int32, masked_counts [n] int32, nsp_labels [n] int8.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from common.errors import DataError


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _check_most(where: str, values: np.ndarray, limit: int | None, what: str, name: str = "") -> None:
    """DataError ``{where}sample r has N {what}, more than {name}{limit}`` for the largest value over ``limit``."""
    if limit is not None and len(values) and int(values.max()) > limit:
        r = int(np.argmax(values))
        raise DataError(f"{where}sample {r} has {int(values[r])} {what}, more than {name}{limit}")


def _within(counts: np.ndarray) -> np.ndarray:
    """[sum counts] int64: each entry's place within its range, for consecutive ranges of counts[i] entries."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(_offsets(counts)[:-1], counts)


def _gather_ranges(values: np.ndarray, offsets: np.ndarray, counts: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Concatenate values[offsets[i]:offsets[i]+counts[i]] for i in idx, vectorised."""
    lens = counts[idx]
    return values[np.repeat(offsets[idx], lens) + _within(lens)]


@dataclass
class SampleBlock:
    input_ids: np.ndarray
    segment_ids: np.ndarray
    seq_lens: np.ndarray
    masked_positions: np.ndarray
    masked_ids: np.ndarray
    masked_counts: np.ndarray
    nsp_labels: np.ndarray

    def __len__(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.seq_lens.sum())

    def select(self, idx, offsets: tuple[np.ndarray, np.ndarray] | None = None) -> SampleBlock:
        """The samples at ``idx``, in that order. ``offsets``: this block's (token, masked) range
        starts (``_offsets`` of its counts), for a caller that selects from one block many times."""
        idx = np.asarray(idx, dtype=np.int64)
        tok_off, msk_off = offsets or (_offsets(self.seq_lens), _offsets(self.masked_counts))
        return SampleBlock(
            input_ids=_gather_ranges(self.input_ids, tok_off, self.seq_lens, idx),
            segment_ids=_gather_ranges(self.segment_ids, tok_off, self.seq_lens, idx),
            seq_lens=self.seq_lens[idx],
            masked_positions=_gather_ranges(self.masked_positions, msk_off, self.masked_counts, idx),
            masked_ids=_gather_ranges(self.masked_ids, msk_off, self.masked_counts, idx),
            masked_counts=self.masked_counts[idx],
            nsp_labels=self.nsp_labels[idx],
        )

    @staticmethod
    def concat(blocks: list[SampleBlock]) -> SampleBlock:
        if not blocks:
            return SampleBlock.empty()
        return SampleBlock(*(np.concatenate([getattr(b, f.name) for b in blocks]) for f in fields(SampleBlock)))

    @staticmethod
    def empty() -> SampleBlock:
        int8 = ("segment_ids", "nsp_labels")  # the rest is int32
        return SampleBlock(*(np.zeros(0, np.int8 if f.name in int8 else np.int32) for f in fields(SampleBlock)))

    def equals(self, other: SampleBlock) -> bool:
        return all(np.array_equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))
