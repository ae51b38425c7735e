"""FlashMask's mask semantics and builders, its dense reference, and the packed layout's
``reference`` path: pure PyTorch, shared by ``kernels.flashmask``, the data and the tests.

For key column j the masked query rows are [LTS_j, LTE_j) and [UTS_j, UTE_j);
``startend_row_indices [B, H or 1, Sk, n]`` int32 gives n of those bounds, the rest implicit
(which n with which ``causal``: docs/kernels.md, "The kernel module's contract").
[docs/packing.md](../docs/packing.md).
Shapes: B packed rows, S / Sq / Sk sequence lengths, H heads, D head dim, n bounds per column.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.interface import PackedLayout, check_window


class FlashMaskSpec(NamedTuple):
    """A mask in FlashMask's form: pass as ``flashmask_attention(q, k, v, *spec)``."""

    startend_row_indices: Tensor  # [B, H or 1, Sk, n] int32
    causal: bool


class TileCounts(NamedTuple):
    """Tiles by class. ``checked``: tiles the bounds' min/max could not classify, whose element
    mask the kernel built to decide (they are among the other three; 0 from the dense count)."""

    skipped: int
    partial: int
    unmasked: int
    checked: int = 0

    @property
    def total(self) -> int:
        return self.skipped + self.partial + self.unmasked


# ------------------------------------------------------------------------------ semantics


def check_startend_row_indices(
    startend_row_indices: Tensor,
    causal: bool,
    batch: int | None = None,
    heads: int | None = None,
    seqlen_k: int | None = None,
) -> int:
    """Check dtype and shape (never values); returns n, the bounds per column."""
    t = startend_row_indices
    if not isinstance(t, Tensor) or t.dtype != torch.int32 or t.dim() != 4:
        what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"startend_row_indices: expected an int32 tensor [batch, heads or 1, seqlen_k, n], got {what}")
    b, h, s, n = t.shape
    allowed = (1, 2) if causal else (2, 4)
    if n not in allowed:
        raise ValueError(
            f"startend_row_indices: n = {n} bounds per column with causal={causal}; expected one of {allowed}"
        )
    if batch is not None and b != batch:
        raise ValueError(f"startend_row_indices: batch {b} != the query's batch {batch}")
    if heads is not None and h not in (1, heads):
        raise ValueError(f"startend_row_indices: {h} heads; expected 1 (broadcast) or {heads}")
    if seqlen_k is not None and s != seqlen_k:
        raise ValueError(f"startend_row_indices: {s} columns != the key's seqlen {seqlen_k}")
    return n


def intervals(startend_row_indices: Tensor, causal: bool, seqlen_q: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(LTS, LTE, UTS, UTE), each [B, H or 1, Sk] int64, with the implicit bounds filled in
    (no upper interval is UTS = UTE = 0)."""
    n = check_startend_row_indices(startend_row_indices, causal)
    x = startend_row_indices.long()
    lts = x[..., 0]
    full = torch.full_like(lts, seqlen_q)
    zero = torch.zeros_like(lts)
    if causal:
        return lts, (x[..., 1] if n == 2 else full), zero, zero
    if n == 2:
        return lts, full, zero, x[..., 1]
    return lts, x[..., 1], x[..., 2], x[..., 3]


def to_dense(startend_row_indices: Tensor, causal: bool, seqlen_q: int) -> Tensor:
    """The boolean mask [B, H or 1, seqlen_q, seqlen_k], True where query i must not see key j
    (bounds clip to [0, seqlen_q])."""
    lts, lte, uts, ute = (x.unsqueeze(-2) for x in intervals(startend_row_indices, causal, seqlen_q))  # [B, H, 1, Sk]
    rows = torch.arange(seqlen_q, device=startend_row_indices.device).view(-1, 1)  # [Sq, 1]
    masked = ((rows >= lts) & (rows < lte)) | ((rows >= uts) & (rows < ute))
    if causal:
        cols = torch.arange(startend_row_indices.shape[2], device=rows.device).view(1, -1)
        masked = masked | (rows < cols)
    return masked


def flashmask_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    startend_row_indices: Tensor,
    causal: bool = False,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    dropout_keep: Tensor | None = None,
) -> Tensor:
    """Attention with the dense mask, in PyTorch and in the inputs' dtype; same arguments as
    ``flashmask_attention``. ``dropout_keep`` [B, H, Sq, Sk] bool replaces the random dropout
    mask (True = kept). Rows with every key masked give zeros."""
    b, sq, h, d = query.shape
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    mask = to_dense(startend_row_indices, causal, sq)  # [B, H or 1, Sq, Sk]
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, H, S, D]
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, H, Sq, Sk]
    empty = mask.all(-1, keepdim=True)  # rows that see nothing
    probs = scores.masked_fill(mask, float("-inf")).masked_fill(empty, 0.0).softmax(-1)
    probs = probs.masked_fill(mask, 0.0)
    if dropout_keep is not None:
        probs = probs * dropout_keep.to(probs.dtype) / (1.0 - dropout_p)
    elif dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return (probs @ v).transpose(1, 2)


def reference_tile_counts(
    startend_row_indices: Tensor, causal: bool, seqlen_q: int, heads: int, block_m: int, block_n: int
) -> TileCounts:
    """Tiles of block_m queries x block_n keys, over the batch and ``heads`` heads, whose
    dense mask is all masked / mixed / all unmasked (edge tiles: their in-range part)."""
    mask = to_dense(startend_row_indices, causal, seqlen_q)  # [B, Hm, Sq, Sk]
    b, hm, sq, sk = mask.shape
    nm, nn = -(-sq // block_m), -(-sk // block_n)

    def tiles(fill: bool) -> Tensor:
        padded = torch.full((b, hm, nm * block_m, nn * block_n), fill, dtype=torch.bool, device=mask.device)
        padded[:, :, :sq, :sk] = mask
        return padded.view(b, hm, nm, block_m, nn, block_n)

    all_masked = tiles(True).all(5).all(3)  # [B, Hm, NM, NN]
    none_masked = ~tiles(False).any(5).any(3)
    per_head = heads // hm
    skipped, unmasked = int(all_masked.sum()) * per_head, int(none_masked.sum()) * per_head
    total = b * heads * nm * nn
    return TileCounts(skipped, total - skipped - unmasked, unmasked)


# --------------------------------------------------------------------------------- builders
# Each returns a FlashMaskSpec with bounds [batch, 1, seqlen, n]. Builders that take lengths
# per row (documents, blocks) accept rows that do not fill seqlen where the mask can express
# it: the remaining tokens are padding, masked for every query (their own rows output zeros).


def _spec(columns: list[Tensor], causal: bool) -> FlashMaskSpec:
    """columns: per row a [S, n] tensor of bounds."""
    return FlashMaskSpec(torch.stack(columns).unsqueeze(1).to(torch.int32).contiguous(), causal)


def _row_lengths(lengths: Sequence[int], seqlen: int, what: str, row: int, fill: bool = False) -> Tensor:
    lens = torch.as_tensor(list(lengths), dtype=torch.int64)
    if lens.numel() == 0 or bool((lens < 1).any()):
        raise ValueError(f"{what}: row {row} needs lengths >= 1, got {lens.tolist()}")
    total = int(lens.sum())
    if total > seqlen or (fill and total != seqlen):
        need = "must sum to" if fill else "exceed"
        raise ValueError(f"{what}: row {row} lengths {lens.tolist()} (sum {total}) {need} seqlen {seqlen}")
    return lens


def _segments(lens: Tensor, seqlen: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """For each of the seqlen columns: (start, end, index) of its segment and a real-token flag.

    Padding columns get index -1, end 0 and start seqlen: as (LTS, UTE) both intervals cover
    every row, so a key block holding a document's end and padding is still one interval's
    (min/max skipping stays exact); as a causal LTS (end), 0 masks every row."""
    ends = lens.cumsum(0)
    starts = ends - lens
    seg = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    pad = seqlen - int(ends[-1])
    real = torch.cat([torch.ones(seg.numel(), dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)])
    zeros = torch.zeros(pad, dtype=torch.int64)
    return (torch.cat([starts[seg], zeros + seqlen]), torch.cat([ends[seg], zeros]), torch.cat([seg, zeros - 1]), real)


def _documents(seq_lens: Sequence[Sequence[int]], seqlen: int) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """``_segments`` of each row of documents ``seq_lens`` (checked)."""
    return [_segments(_row_lengths(lengths, seqlen, "seq_lens", r), seqlen) for r, lengths in enumerate(seq_lens)]


def causal_mask(batch: int, seqlen: int) -> FlashMaskSpec:
    """Plain causal attention: query i sees keys j <= i."""
    return _spec([torch.full((seqlen, 1), seqlen)] * batch, causal=True)


def sliding_window_mask(batch: int, seqlen: int, window: int) -> FlashMaskSpec:
    """Causal with a window: query i sees keys i - window < j <= i (LTS_j = j + window)."""
    if window < 1:
        raise ValueError(f"window: must be >= 1, got {window}")
    lts = (torch.arange(seqlen) + window).clamp(max=seqlen)
    return _spec([lts.view(-1, 1)] * batch, causal=True)


def causal_document_mask(seq_lens: Sequence[Sequence[int]], seqlen: int) -> FlashMaskSpec:
    """Documents packed in rows, causal within each (LTS_j = end of j's document)."""
    return _spec([end.view(-1, 1) for _, end, _, _ in _documents(seq_lens, seqlen)], causal=True)


def document_mask(seq_lens: Sequence[Sequence[int]], seqlen: int) -> FlashMaskSpec:
    """Documents packed in rows, bidirectional within each: (LTS, UTE) = (end, start) of the
    key's document. This is the packed BERT batch's mask."""
    return _spec([torch.stack([end, start], 1) for start, end, _, _ in _documents(seq_lens, seqlen)], causal=False)


def window_bounds(startend_row_indices: Tensor, window: int, n: int = 4) -> Tensor:
    """Bidirectional bounds (LTS, UTE) [B, H or 1, S, 2], as ``document_mask`` gives, with a
    sliding window added: query i also stops seeing key j when |i - j| > window // 2.

    Key j's rows outside the band are [j + window//2 + 1, S) and [0, j - window//2); joined
    with its masked [LTS, S) and [0, UTE) they stay one lower and one upper interval. Returns
    n = 4 bounds (LTS, LTE = S, UTS = 0, UTE) [B, H or 1, S, 4] int32, or with ``n=2`` the
    same mask as (LTS, UTE) (the two middle bounds are the implicit ones)."""
    check_window(window)
    check_startend_row_indices(startend_row_indices, causal=False)
    if startend_row_indices.shape[-1] != 2 or n not in (2, 4):
        raise ValueError(
            f"window_bounds: needs bidirectional (LTS, UTE) bounds [B, H or 1, S, 2] and n in (2, 4), "
            f"got {tuple(startend_row_indices.shape)} and n={n}"
        )
    s = startend_row_indices.shape[2]
    half = window // 2
    j = torch.arange(s, device=startend_row_indices.device)
    lts = torch.minimum(startend_row_indices[..., 0].long(), (j + half + 1).clamp(max=s))
    ute = torch.maximum(startend_row_indices[..., 1].long(), (j - half).clamp(min=0))
    bounds = [lts, ute] if n == 2 else [lts, torch.full_like(lts, s), torch.zeros_like(lts), ute]
    return torch.stack(bounds, -1).to(torch.int32).contiguous()


def document_window_mask(seq_lens: Sequence[Sequence[int]], seqlen: int, window: int, n: int = 4) -> FlashMaskSpec:
    """Documents packed in rows, each with a sliding window: query i sees key j when both lie
    in one document and |i - j| <= window // 2 (the packed layout's local attention)."""
    return FlashMaskSpec(window_bounds(document_mask(seq_lens, seqlen).startend_row_indices, window, n), False)


def shared_question_mask(samples: Sequence[Sequence[Sequence[int]]], seqlen: int) -> FlashMaskSpec:
    """Rows of samples, each [question, answer 1, ..., answer k] lengths, causal: every answer
    sees its sample's question and itself, not the other answers or other samples."""
    rows = []
    for r, row in enumerate(samples):
        parts = [list(s) for s in row]
        if not parts or any(len(s) < 2 for s in parts):
            raise ValueError(f"samples: row {r} needs samples of a question and at least one answer, got {parts}")
        lens = _row_lengths([x for s in parts for x in s], seqlen, "samples", r)
        _, end, seg, real = _segments(lens, seqlen)
        per_sample = torch.tensor([len(s) for s in parts])
        sample_of_seg = torch.repeat_interleave(torch.arange(len(parts)), per_sample)
        sample_end = torch.tensor([sum(s) for s in parts]).cumsum(0)[sample_of_seg]  # per segment
        first = torch.cat([torch.tensor([True] + [False] * (len(s) - 1)) for s in parts])
        # A question column is masked from its sample's end on, an answer column from its own end on.
        seg_lts = torch.where(first, sample_end, lens.cumsum(0))
        lts = torch.where(real, seg_lts[seg.clamp(min=0)], end)
        rows.append(lts.view(-1, 1))
    return _spec(rows, causal=True)


def global_sliding_window_mask(batch: int, seqlen: int, num_global: int, window: int) -> FlashMaskSpec:
    """Bidirectional: query i sees key j when |i - j| < window, or either is one of the first
    num_global tokens."""
    if window < 1 or num_global < 0:
        raise ValueError(f"window >= 1 and num_global >= 0 needed, got {window}, {num_global}")
    j = torch.arange(seqlen)
    local = j >= num_global
    lts = torch.where(local, (j + window).clamp(max=seqlen), seqlen)
    lte = torch.full_like(j, seqlen)
    uts = torch.where(local, torch.full_like(j, num_global), 0)
    ute = torch.where(local, (j - window + 1).clamp(min=num_global), 0)
    return _spec([torch.stack([lts, lte, uts, ute], 1)] * batch, causal=False)


def causal_blockwise_mask(block_lens: Sequence[Sequence[int]], seqlen: int) -> FlashMaskSpec:
    """Rows of blocks that fill the row, causal: each block sees itself; the last block sees
    everything before it (in-context examples followed by the query)."""
    rows = []
    for r, lengths in enumerate(block_lens):
        lens = _row_lengths(lengths, seqlen, "block_lens", r, fill=True)
        _, end, seg, _ = _segments(lens, seqlen)
        last_start = seqlen - int(lens[-1])
        in_last = seg == lens.numel() - 1
        # The last block's columns have no lower interval: empty, placed at last_start where it
        # sits between every query block's rows (keeps min/max classification exact).
        lts = torch.where(in_last, last_start, end)
        lte = torch.full_like(lts, last_start)
        rows.append(torch.stack([lts, lte], 1))
    return _spec(rows, causal=True)


def prefix_lm_causal_mask(prefix_lens: Sequence[int], seqlen: int) -> FlashMaskSpec:
    """Per row a bidirectional prefix, then causal: query i sees key j when j < prefix or j <= i."""
    rows = []
    j = torch.arange(seqlen)
    for r, p in enumerate(prefix_lens):
        if not 0 <= p <= seqlen:
            raise ValueError(f"prefix_lens: row {r} prefix {p} outside [0, {seqlen}]")
        rows.append(torch.stack([torch.full_like(j, seqlen), torch.where(j < p, 0, j)], 1))
    return _spec(rows, causal=False)


def prefix_lm_document_mask(
    seq_lens: Sequence[Sequence[int]], prefix_lens: Sequence[Sequence[int]], seqlen: int
) -> FlashMaskSpec:
    """Documents packed in rows, each a prefix-LM: within its document, query i sees key j when
    j is in the document's prefix or j <= i."""
    rows = []
    for r, (lengths, prefixes) in enumerate(zip(seq_lens, prefix_lens, strict=True)):
        lens = _row_lengths(lengths, seqlen, "seq_lens", r)
        pre = torch.as_tensor(list(prefixes), dtype=torch.int64)
        if pre.shape != lens.shape or bool((pre < 0).any() | (pre > lens).any()):
            raise ValueError(
                f"prefix_lens: row {r} needs one prefix in [0, length] per document, got "
                f"{pre.tolist()} for lengths {lens.tolist()}"
            )
        start, end, seg, real = _segments(lens, seqlen)
        j = torch.arange(seqlen)
        in_prefix = real & (j < start + pre[seg.clamp(min=0)])
        ute = torch.where(in_prefix | ~real, start, j)
        rows.append(torch.stack([end, ute], 1))
    return _spec(rows, causal=False)


def qk_sparse_mask(ranges: Sequence[tuple[int, int, int, int]], seqlen: int) -> FlashMaskSpec:
    """Causal with dropped keys and queries; per row (ks, ke, qs, qe) with ke <= qs: the keys
    [ks, ke) are seen only by queries before ke, and the queries [qs, qe) see only keys j >= qs."""
    rows = []
    j = torch.arange(seqlen)
    for r, (ks, ke, qs, qe) in enumerate(ranges):
        if not 0 <= ks <= ke <= qs <= qe <= seqlen:
            raise ValueError(f"ranges: row {r} needs 0 <= ks <= ke <= qs <= qe <= {seqlen}, got {(ks, ke, qs, qe)}")
        dropped_key = (j >= ks) & (j < ke)
        # Columns j >= qs have no lower interval: empty, placed at qe (keeps min/max exact).
        lts = torch.where(dropped_key, ke, torch.where(j < qs, qs, qe))
        lte = torch.where(dropped_key, seqlen, qe)
        rows.append(torch.stack([lts, lte], 1))
    return _spec(rows, causal=True)


def random_eviction_mask(batch: int, seqlen: int, generator: torch.Generator | None = None) -> FlashMaskSpec:
    """Causal, each key j evicted at a random row e_j in (j, seqlen]: queries i >= e_j do not see it."""
    j = torch.arange(seqlen)
    rows = []
    for _ in range(batch):
        u = torch.rand(seqlen, generator=generator)
        evict = j + 1 + (u * (seqlen - j)).long().clamp(max=seqlen - j - 1)  # uniform in [j+1, seqlen]
        rows.append(evict.view(-1, 1))
    return _spec(rows, causal=True)


# -------------------------------------------------------------------- the packed reference


def packed_rows(attend, q: Tensor, k: Tensor, v: Tensor, layout: PackedLayout, dropout_p: float) -> Tensor:
    """``attend`` (``flashmask_reference`` or ``flashmask_attention``) on a packed batch's q, k,
    v [R*S, H, D], viewed as its R rows [R, S, H, D]; returns [R*S, H, D]."""
    bounds = layout.startend_row_indices
    r, _, s, _ = bounds.shape
    n, h, d = q.shape
    out = attend(*(x.view(r, s, h, d) for x in (q, k, v)), bounds, causal=layout.causal, dropout_p=dropout_p)
    return out.reshape(n, h, d)
