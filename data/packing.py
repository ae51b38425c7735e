"""Packing whole sequences into fixed-length rows: first-fit decreasing, ``collate_packed`` (a
``PackedBatch`` in the block's sample order, so its logits line up with ``collate_unpadded``'s)
and ``unpack`` (back to that ``UnpaddedBatch``, for SimReg). [docs/packing.md](../docs/packing.md).
"""

from __future__ import annotations

import numpy as np
import torch

from common.errors import DataError
from data.batch import PackedBatch, UnpaddedBatch
from data.collate import _check_block, _rows
from data.samples import SampleBlock, _within


def first_fit_decreasing(lengths, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Place sequences of ``lengths`` into rows of ``capacity`` tokens: longest first (ties in
    sample order), each into the lowest-numbered row with room; the result depends only on the
    lengths. Returns (row [n] int64, offset [n] int64: where each sequence starts in its row,
    number of rows); DataError for a sequence longer than a row or of length < 1."""
    lens = np.asarray(lengths, dtype=np.int64)
    n = len(lens)
    if capacity < 1:
        raise DataError(f"seq_len {capacity}: must be >= 1")
    if n and (int(lens.min()) < 1 or int(lens.max()) > capacity):
        i = int(np.argmax(lens)) if int(lens.max()) > capacity else int(np.argmin(lens))
        raise DataError(f"sample {i} has {int(lens[i])} tokens; packing needs 1 to seq_len {capacity}")
    row, offset = np.zeros(n, np.int64), np.zeros(n, np.int64)
    if n == 0:
        return row, offset, 0
    size = 1 << (n - 1).bit_length()  # leaves: rows 0..size-1, never more rows than sequences
    free = [capacity] * (2 * size)  # a segment tree: free[node] = the most free space of any row under node
    used = 0
    for i in np.argsort(-lens, kind="stable").tolist():
        need = int(lens[i])
        node = 1
        while node < size:  # descend to the leftmost row with room
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        r = node - size
        row[i] = r
        offset[i] = capacity - free[node]
        free[node] -= need
        used = max(used, r + 1)
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return row, offset, used


def collate_packed(block: SampleBlock, seq_len: int) -> PackedBatch:
    """The samples of ``block`` packed into rows of ``seq_len`` tokens (first-fit decreasing)."""
    _check_block(block)
    lens = block.seq_lens.astype(np.int64)
    row, offset, num_rows = first_fit_decreasing(lens, seq_len)
    start = row * seq_len + offset  # [B] flat index of each sequence's [CLS]
    within = _within(lens)  # [T] place in the sequence
    dest = np.repeat(start, lens) + within  # [T] flat index of each token
    bounds = np.empty((num_rows * seq_len, 2), np.int32)
    bounds[:] = (0, seq_len)  # padding keys: masked for every query row
    bounds[dest, 0] = np.repeat(offset + lens, lens)  # LTS: rows from the sequence's end on
    bounds[dest, 1] = np.repeat(offset, lens)  # UTE: rows before its start
    mlm = np.repeat(start, block.masked_counts.astype(np.int64)) + block.masked_positions
    return PackedBatch(
        input_ids=_rows(block.input_ids, dest, num_rows, seq_len),
        segment_ids=_rows(block.segment_ids, dest, num_rows, seq_len),
        position_ids=_rows(within, dest, num_rows, seq_len),
        startend_row_indices=torch.from_numpy(bounds.reshape(num_rows, 1, seq_len, 2)),
        cls_positions=torch.from_numpy(start),
        seq_lens=torch.from_numpy(lens.astype(np.int32)),
        mlm_positions=torch.from_numpy(mlm.astype(np.int64)),
        mlm_labels=torch.from_numpy(block.masked_ids.astype(np.int64)),
        nsp_labels=torch.from_numpy(block.nsp_labels.astype(np.int64)),
    )


def unpack(batch: PackedBatch) -> tuple[UnpaddedBatch, torch.Tensor]:
    """The same sequences unpadded, and ``token_index`` [T]: the flat R*S index of each of its
    tokens, so ``hidden_states[token_index]`` are the unpadded batch's hidden states."""
    tokens = batch.token_index()  # [T]
    lens = batch.seq_lens.long()
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0))  # [B+1]
    # A masked position's sequence is the last [CLS] at or before it, in flat R*S order.
    order = torch.argsort(batch.cls_positions)
    seq = order[torch.searchsorted(batch.cls_positions[order], batch.mlm_positions, right=True) - 1]
    mlm = cu[seq] + batch.mlm_positions - batch.cls_positions[seq]
    unpadded = UnpaddedBatch(
        input_ids=batch.input_ids.reshape(-1)[tokens],
        segment_ids=batch.segment_ids.reshape(-1)[tokens],
        position_ids=batch.position_ids.reshape(-1)[tokens],
        cu_seqlens=cu.to(torch.int32),
        max_seqlen=int(lens.max()),
        mlm_positions=mlm,
        mlm_labels=batch.mlm_labels,
        nsp_labels=batch.nsp_labels,
    )
    return unpadded, tokens
