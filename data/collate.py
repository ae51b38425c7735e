"""SampleBlock -> the batch types the model takes, with vectorised numpy (no loop over tokens):
``collate_unpadded`` and ``collate_padded`` give exactly what ``data.batch.unpad`` / ``pad`` give
for the same samples (``data.loader.make_collator`` picks these or ``data.dali_loader``'s).
"""

from __future__ import annotations

import numpy as np
import torch

from common.errors import DataError
from data.batch import PaddedBatch, UnpaddedBatch
from data.samples import SampleBlock, _check_most, _offsets, _within

COLLATE_BACKENDS = ("torch", "dali")
LAYOUTS = ("unpadded", "padded", "packed")


def check_backend(backend: str) -> None:
    """A collation backend (the loaders check it when built, before any batch is asked for)."""
    if backend not in COLLATE_BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {', '.join(COLLATE_BACKENDS)}")


def _long(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


def _check_block(block: SampleBlock, seq_len: int | None = None) -> None:
    """Refuse an empty block, and (with ``seq_len``) one whose longest sample does not fit a row."""
    if len(block) == 0:
        raise DataError("cannot collate an empty SampleBlock")
    _check_most("", block.seq_lens, seq_len, "tokens", "seq_len ")


def _row_index(counts: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """For rows holding counts[i] entries each, left-aligned in a [len(counts), width] array: the
    flat index of every entry [sum counts] and its place within its row [sum counts]."""
    within = _within(counts)
    return np.repeat(np.arange(len(counts), dtype=np.int64) * width, counts) + within, within


def _rows(values: np.ndarray, dest: np.ndarray, rows: int, seq_len: int) -> torch.Tensor:
    """[rows, seq_len] int64: ``values`` at the flat indices ``dest``, 0 elsewhere."""
    out = np.zeros(rows * seq_len, np.int64)
    out[dest] = values
    return torch.from_numpy(out.reshape(rows, seq_len))


def collate_unpadded(block: SampleBlock) -> UnpaddedBatch:
    """All sequences of ``block`` concatenated: T tokens, cu_seqlens [B+1] int32."""
    _check_block(block)
    lens = block.seq_lens.astype(np.int64)
    cu = _offsets(lens)  # [B+1]
    position_ids = _within(lens)  # [T]
    mlm_positions = block.masked_positions.astype(np.int64) + np.repeat(cu[:-1], block.masked_counts)  # [M]
    return UnpaddedBatch(
        input_ids=_long(block.input_ids),
        segment_ids=_long(block.segment_ids),
        position_ids=torch.from_numpy(position_ids),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        max_seqlen=int(lens.max()),
        mlm_positions=torch.from_numpy(mlm_positions),
        mlm_labels=_long(block.masked_ids),
        nsp_labels=_long(block.nsp_labels),
        host_seqlens=tuple(lens.tolist()),
    )


def collate_padded(block: SampleBlock, seq_len: int) -> PaddedBatch:
    """Each sequence in a row of ``seq_len``; mlm_positions index the flat B*S tokens."""
    _check_block(block, seq_len)
    b = len(block)
    lens = block.seq_lens.astype(np.int64)
    dest, within = _row_index(lens, seq_len)  # [T] into B*S, [T] position in the sequence
    mask = np.arange(seq_len)[None, :] < lens[:, None]  # [B, S]
    mlm_rows = np.repeat(np.arange(b, dtype=np.int64), block.masked_counts)
    return PaddedBatch(
        input_ids=_rows(block.input_ids, dest, b, seq_len),
        segment_ids=_rows(block.segment_ids, dest, b, seq_len),
        position_ids=_rows(within, dest, b, seq_len),
        attention_mask=torch.from_numpy(mask),
        mlm_positions=torch.from_numpy(mlm_rows * seq_len + block.masked_positions),
        mlm_labels=_long(block.masked_ids),
        nsp_labels=_long(block.nsp_labels),
    )
