"""FlashMask attention: column-wise sparse masks, a Triton kernel that skips masked tiles, the
mask builders, a dense PyTorch reference, and the ``flashmask`` attention backend.

FlashMask (Wang et al., 2024) writes a mask column by column in O(S) memory. For key column j
the masked query rows are [LTS_j, LTE_j) and [UTS_j, UTE_j), where ``startend_row_indices``
``[batch, heads or 1, seqlen_k, n]`` int32 gives n of those bounds and the rest are implicit:

    causal  n  bounds given        implicit                     also masked
    True    1  LTS                 LTE = seqlen_q               rows i < j
    True    2  LTS, LTE            -                            rows i < j
    False   2  LTS, UTE            LTE = seqlen_q, UTS = 0      -
    False   4  LTS, LTE, UTS, UTE  -                            -

``to_dense`` turns that into a boolean ``[batch, heads or 1, seqlen_q, seqlen_k]`` mask
(True = masked); ``flashmask_reference`` is attention with that dense mask, in PyTorch. Bounds
outside [0, seqlen_q] are allowed and simply clip. A row whose every key is masked outputs
zeros (and gets zero gradients), never NaN.

The kernel (``kernels/flashmask_jit.py``) computes, once per call, the min and max of each
bound over every block of BLOCK_N keys, and from those scalars alone classifies each
(query block, key block) tile as skipped (no loads, no math), partial (element mask) or
unmasked (no mask work); a tile the min/max cannot classify gets its element mask built and
is then classified exactly, so a tile is skipped exactly when its dense mask is all masked.
``flashmask_tile_counts`` runs the kernels in a debug mode that reports the counts;
``reference_tile_counts`` counts the same from the dense mask.

Layers, from the bottom: the Triton kernels and launchers; two ``torch.library`` custom ops
(``bert_kernels::flashmask_fwd`` / ``_bwd``, opaque to ``torch.compile``); an autograd
Function; the public ``flashmask_attention``; the backend ``flashmask_backend`` for the model's
``PackedLayout``. Dropout is the varlen kernels' Philox scheme (``kernels/jit_kernels.py``)
with token index b * seqlen_q + i, so ``torch.manual_seed`` makes it reproducible and the
backward regenerates the mask.

Shape legend: B batch (packed rows), S / Sq / Sk sequence lengths, H heads, D head dim,
n bounds per column.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fileio import write_text
from kernels.attention import BackendUnavailable, Layout, PackedLayout
from kernels.runtime import seeded_op_tags

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128
_SOURCE = Path(__file__).with_name("flashmask_jit.py")
_JIT: dict[bool, ModuleType] = {}


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
    """The boolean mask [B, H or 1, seqlen_q, seqlen_k], True where query i must not see key j."""
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
    rows = []
    for r, lengths in enumerate(seq_lens):
        _, end, _, _ = _segments(_row_lengths(lengths, seqlen, "seq_lens", r), seqlen)
        rows.append(end.view(-1, 1))
    return _spec(rows, causal=True)


def document_mask(seq_lens: Sequence[Sequence[int]], seqlen: int) -> FlashMaskSpec:
    """Documents packed in rows, bidirectional within each: (LTS, UTE) = (end, start) of the
    key's document. This is the packed BERT batch's mask."""
    rows = []
    for r, lengths in enumerate(seq_lens):
        start, end, _, _ = _segments(_row_lengths(lengths, seqlen, "seq_lens", r), seqlen)
        rows.append(torch.stack([end, start], 1))
    return _spec(rows, causal=False)


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


MASK_BUILDERS = (
    "causal_mask",
    "sliding_window_mask",
    "causal_document_mask",
    "document_mask",
    "shared_question_mask",
    "global_sliding_window_mask",
    "causal_blockwise_mask",
    "prefix_lm_causal_mask",
    "prefix_lm_document_mask",
    "qk_sparse_mask",
    "random_eviction_mask",
)


# ------------------------------------------------------------------------------- the kernel


def _kernels(device: torch.device) -> ModuleType:
    """The FlashMask kernels module, after checking they can run on ``device`` here."""
    from kernels.runtime import jit_kernels

    base = jit_kernels(device, "flashmask attention")  # raises BackendUnavailable when they cannot
    if base.INTERPRET not in _JIT:
        _JIT[base.INTERPRET] = load_jit(base)
    return _JIT[base.INTERPRET]


def load_jit(base: ModuleType) -> ModuleType:
    """Execute flashmask_jit.py as a fresh module in ``base``'s Triton mode (base: the varlen
    kernels module from ``kernels.runtime``, whose helpers these kernels share)."""
    name = f"kernels._flashmask_jit_{'interpreted' if base.INTERPRET else 'compiled'}"
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if base.INTERPRET else "0"
    try:
        spec = importlib.util.spec_from_file_location(name, _SOURCE)
        module = importlib.util.module_from_spec(spec)
        module.BASE = base
        sys.modules[name] = module  # Triton resolves helper functions through the module
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return module


def block_minmax(startend_row_indices: Tensor, block_n: int) -> Tensor:
    """[B, H or 1, cdiv(Sk, block_n), n, 2] int32: min and max of each bound per key block."""
    b, h, sk, n = startend_row_indices.shape
    nb = -(-sk // block_n)
    x = startend_row_indices
    if nb * block_n != sk:  # repeat the last column: leaves every block's min and max unchanged
        x = torch.cat([x, x[:, :, -1:].expand(b, h, nb * block_n - sk, n)], 2)
    x = x.view(b, h, nb, block_n, n)
    return torch.stack([x.amin(3), x.amax(3)], -1).contiguous()


def key_block_size(head_dim: int, elt_size: int) -> int:
    """BLOCK_N, the key-block size of all three kernels (the same compiled or interpreted, so
    the shape of the block min/max is known when tracing for torch.compile)."""
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    return 32 if elt_size == 4 or block_d > 64 else 64


def tile_sizes(head_dim: int, elt_size: int, interpreted: bool) -> dict[str, tuple[int, int, int, int]]:
    """{kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages)} for kernel in fwd, dkdv, dq.

    A GPU gets the varlen kernels' sm_90 tiles (not yet tuned by timing on a GPU;
    ``python -m kernels.flashmask --compile-check`` checks they compile and fit). The
    interpreter gets BLOCK_M = 64 (tests cross block edges both ways with few tiles, as each
    costs Python time)."""
    bn = key_block_size(head_dim, elt_size)
    if interpreted:
        return {"fwd": (64, bn, 1, 1), "dkdv": (64, bn, 1, 1), "dq": (64, bn, 1, 1)}
    if elt_size == 4:
        return {"fwd": (64, bn, 8, 2), "dkdv": (32, bn, 8, 2), "dq": (32, bn, 4, 2)}
    if bn == 64:
        return {"fwd": (128, bn, 8, 3), "dkdv": (64, bn, 8, 2), "dq": (64, bn, 8, 2)}
    return {"fwd": (128, bn, 8, 2), "dkdv": (64, bn, 8, 2), "dq": (64, bn, 8, 2)}


def _tiles(q: Tensor, kern: ModuleType, block_m: int | None = None, block_n: int | None = None) -> dict:
    tiles = tile_sizes(q.shape[-1], q.element_size(), kern.INTERPRET)
    if block_m is None and block_n is None:
        return tiles
    return {name: (block_m or bm, block_n or bn, w, s) for name, (bm, bn, w, s) in tiles.items()}


def _draw_rng(dropout_p: float) -> Tensor:
    from kernels.varlen_attention import _draw_rng as draw  # the varlen kernels' seeds, one source

    return draw(dropout_p)


def _fwd_impl(q, k, v, bounds, causal, softmax_scale, dropout_p, rng, tiles=None, counts=None):
    kern = _kernels(q.device)
    tiles = tiles or _tiles(q, kern)
    seed, offset = (int(x) for x in rng.tolist())
    b, sq, h, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [B, Sq, H, D]
    lse = torch.empty(b, sq, h, dtype=torch.float32, device=q.device)  # base 2
    bmm = block_minmax(bounds, tiles["fwd"][1])
    kern.fwd(q, k, v, out, lse, bounds, bmm, causal, softmax_scale, dropout_p, seed, offset, tiles, counts)
    return out, lse, bmm


def _bwd_impl(
    dout,
    q,
    k,
    v,
    out,
    lse,
    rng,
    bounds,
    bmm,
    causal,
    softmax_scale,
    dropout_p,
    tiles=None,
    counts_dkdv=None,
    counts_dq=None,
):
    kern = _kernels(q.device)
    tiles = tiles or _tiles(q, kern)
    seed, offset = (int(x) for x in rng.tolist())
    # delta_i = sum_j P~_ij dP~_ij = rowsum(dO * O), also with dropout (O holds the dropped P~).
    delta = (dout.float() * out.float()).sum(-1)  # [B, Sq, H]
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    kern.bwd(
        dout,
        q,
        k,
        v,
        lse,
        delta,
        dq,
        dk,
        dv,
        bounds,
        bmm,
        causal,
        softmax_scale,
        dropout_p,
        seed,
        offset,
        tiles,
        counts_dkdv,
        counts_dq,
    )
    return dq, dk, dv


@torch.library.custom_op("bert_kernels::flashmask_fwd", mutates_args=(), **seeded_op_tags())
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor, bounds: Tensor, causal: bool, softmax_scale: float, dropout_p: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rng = _draw_rng(dropout_p)
    out, lse, bmm = _fwd_impl(q, k, v, bounds, causal, softmax_scale, dropout_p, rng)
    return out, lse, rng, bmm


@_fwd_op.register_fake
def _(q, k, v, bounds, causal, softmax_scale, dropout_p):
    b, sq, h, d = q.shape
    key_blocks = -(-k.shape[1] // key_block_size(d, q.element_size()))
    return (
        q.new_empty(q.shape),
        q.new_empty((b, sq, h), dtype=torch.float32),
        torch.empty(2, dtype=torch.int64, device="cpu"),
        bounds.new_empty((bounds.shape[0], bounds.shape[1], key_blocks, bounds.shape[3], 2)),
    )


@torch.library.custom_op("bert_kernels::flashmask_bwd", mutates_args=())
def _bwd_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    rng: Tensor,
    bounds: Tensor,
    bmm: Tensor,
    causal: bool,
    softmax_scale: float,
    dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return _bwd_impl(dout, q, k, v, out, lse, rng, bounds, bmm, causal, softmax_scale, dropout_p)


@_bwd_op.register_fake
def _(dout, q, k, v, out, lse, rng, bounds, bmm, causal, softmax_scale, dropout_p):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _FlashMaskAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bounds, causal, softmax_scale, dropout_p):
        out, lse, rng, bmm = torch.ops.bert_kernels.flashmask_fwd(q, k, v, bounds, causal, softmax_scale, dropout_p)
        ctx.save_for_backward(q, k, v, out, lse, rng, bounds, bmm)
        ctx.args = (causal, softmax_scale, dropout_p)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rng, bounds, bmm = ctx.saved_tensors
        dq, dk, dv = torch.ops.bert_kernels.flashmask_bwd(
            _last_dim_contiguous(dout), q, k, v, out, lse, rng, bounds, bmm, *ctx.args
        )
        return dq, dk, dv, None, None, None, None


def _check(query: Tensor, key: Tensor, value: Tensor, bounds: Tensor, causal: bool, dropout_p: float) -> None:
    if (
        query.dim() != 4
        or key.dim() != 4
        or value.shape != key.shape
        or query.shape[0] != key.shape[0]
        or query.shape[2:] != key.shape[2:]
    ):
        raise ValueError(
            f"flashmask attention: query [B, Sq, H, D] and key, value [B, Sk, H, D] expected; got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.dtype not in _DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            f"flashmask attention: query, key, value must share one dtype of "
            f"{[str(d) for d in _DTYPES]}; got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if query.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"flashmask attention: head dim {query.shape[-1]} > {MAX_HEAD_DIM} is not supported")
    if causal and query.shape[1] != key.shape[1]:
        raise ValueError(
            f"flashmask attention: causal needs seqlen_q == seqlen_k, got {query.shape[1]} and {key.shape[1]}"
        )
    if min(query.shape[:3]) < 1 or key.shape[1] < 1:
        raise ValueError(f"flashmask attention: empty input {tuple(query.shape)}, {tuple(key.shape)}")
    check_startend_row_indices(bounds, causal, query.shape[0], query.shape[2], key.shape[1])
    if bounds.device != query.device:
        raise ValueError(f"startend_row_indices: on {bounds.device}, the query on {query.device}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"flashmask attention: dropout_p must lie in [0, 1), got {dropout_p}")


def flashmask_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    startend_row_indices: Tensor,
    causal: bool = False,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> Tensor:
    """softmax(q k^T * scale + M) v with FlashMask's column-wise mask M, differentiable.

    query: [B, Sq, H, D]; key, value: [B, Sk, H, D]; one dtype of float16, bfloat16, float32,
        on CUDA (or CPU with TRITON_INTERPRET=1); any batch/token/head strides, head dim
        contiguous (else copied); D <= 128.
    startend_row_indices: [B, H or 1, Sk, n] int32 on the same device (see the module
        docstring for n and causal); values outside [0, Sq] clip.
    causal: also mask rows i < j (needs Sq == Sk).
    dropout_p: attention-probability dropout; Philox seeded from torch's default generator.
    softmax_scale: default 1/sqrt(D).
    Returns [B, Sq, H, D] in the query's dtype; rows with every key masked are zeros.
    """
    _check(query, key, value, startend_row_indices, causal, dropout_p)
    scale = float(softmax_scale) if softmax_scale is not None else query.shape[-1] ** -0.5
    bounds = startend_row_indices if startend_row_indices.stride(-1) == 1 else startend_row_indices.contiguous()
    return _FlashMaskAttention.apply(
        _last_dim_contiguous(query),
        _last_dim_contiguous(key),
        _last_dim_contiguous(value),
        bounds,
        bool(causal),
        scale,
        float(dropout_p),
    )


@torch.no_grad()
def flashmask_tile_counts(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    startend_row_indices: Tensor,
    causal: bool = False,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    tiles: dict[str, tuple[int, int]] | None = None,
    backward: bool = True,
) -> dict[str, tuple[TileCounts, tuple[int, int]]]:
    """Debug: run the kernels (forward, and with ``backward`` the dK/dV and dQ passes on a
    ones gradient) and report how each classified its tiles.

    Returns {pass: (TileCounts summed over batch and heads, (BLOCK_M, BLOCK_N))} for pass in
    fwd, dkdv, dq. The tile sizes are the kernels' own unless overridden: block_m / block_n
    for every pass, or ``tiles`` {pass: (BLOCK_M, BLOCK_N)} (one BLOCK_N, a multiple of 4,
    for all passes: they share the per-block min/max).
    """
    _check(query, key, value, startend_row_indices, causal, 0.0)
    q, k, v = (_last_dim_contiguous(x) for x in (query, key, value))
    bounds = startend_row_indices.contiguous()
    kern = _kernels(q.device)
    if tiles is not None:
        if len({bn for _, bn in tiles.values()}) != 1 or set(tiles) != {"fwd", "dkdv", "dq"}:
            raise ValueError(f"tiles: need fwd, dkdv and dq with one BLOCK_N, got {tiles}")
        tiles = {name: (bm, bn, 1, 1) for name, (bm, bn) in tiles.items()}
    else:
        tiles = _tiles(q, kern, block_m, block_n)
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    programs = {"fwd": -(-sq // tiles["fwd"][0]), "dkdv": -(-sk // tiles["dkdv"][1]), "dq": -(-sq // tiles["dq"][0])}
    counts = {name: torch.zeros(b * h * n, 4, dtype=torch.int32, device=q.device) for name, n in programs.items()}
    rng = torch.zeros(2, dtype=torch.int64)
    scale = q.shape[-1] ** -0.5
    out, lse, bmm = _fwd_impl(q, k, v, bounds, causal, scale, 0.0, rng, tiles, counts["fwd"])
    result = {"fwd": counts["fwd"]}
    if backward:
        _bwd_impl(
            torch.ones_like(out),
            q,
            k,
            v,
            out,
            lse,
            rng,
            bounds,
            bmm,
            causal,
            scale,
            0.0,
            tiles,
            counts["dkdv"],
            counts["dq"],
        )
        result.update(dkdv=counts["dkdv"], dq=counts["dq"])
    return {name: (TileCounts(*(int(x) for x in c.sum(0).tolist())), tiles[name][:2]) for name, c in result.items()}


# ------------------------------------------------------------------------------ the backend


def flashmask_backend(q: Tensor, k: Tensor, v: Tensor, layout: Layout, dropout_p: float, training: bool) -> Tensor:
    """The ``flashmask`` attention backend: q, k, v [R*S, H, D] of a packed batch."""
    if not isinstance(layout, PackedLayout):
        raise BackendUnavailable(
            f"model.attention=flashmask: needs a packed batch (PackedLayout, data.layout=packed), "
            f"got {type(layout).__name__}"
        )
    bounds = layout.startend_row_indices
    r, _, s, _ = bounds.shape
    n, h, d = q.shape
    out = flashmask_attention(
        q.view(r, s, h, d),
        k.view(r, s, h, d),
        v.view(r, s, h, d),
        bounds,
        causal=layout.causal,
        dropout_p=dropout_p if training else 0.0,
    )
    return out.view(n, h, d)


def packed_reference(q: Tensor, k: Tensor, v: Tensor, layout: PackedLayout, dropout_p: float) -> Tensor:
    """The ``reference`` backend's PackedLayout path: dense-mask attention on [R*S, H, D]."""
    bounds = layout.startend_row_indices
    r, _, s, _ = bounds.shape
    n, h, d = q.shape
    out = flashmask_reference(
        q.view(r, s, h, d), k.view(r, s, h, d), v.view(r, s, h, d), bounds, causal=layout.causal, dropout_p=dropout_p
    )
    return out.reshape(n, h, d)


def load_backend():
    from kernels.runtime import check_runnable

    check_runnable("model.attention=flashmask")
    return flashmask_backend


# -------------------------------------------------------------------------- compile check


def compile_check() -> list[dict]:
    """Compile every kernel variant for sm_90 with Triton's whole pipeline (no GPU needed; run
    with Triton imported in compiled mode). Returns one record per kernel."""
    from kernels import compile_check as cc
    from kernels import runtime

    if runtime.triton_interpreted():
        raise RuntimeError("Triton was imported in interpreter mode; run with TRITON_INTERPRET=0")
    module = load_jit(runtime.load(interpret=False))
    records: list[dict] = []
    variant: dict = {}

    module._launch = cc.compiling_launcher(records, variant)

    def meta(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, device="meta")

    r, s, h = 56, 512, 16
    for dtype, dim, causal, n, p in [
        (torch.bfloat16, 64, False, 2, 0.1),
        (torch.bfloat16, 64, False, 4, 0.0),
        (torch.float16, 128, True, 2, 0.0),
        (torch.bfloat16, 64, True, 1, 0.1),
        (torch.float32, 64, False, 2, 0.1),
    ]:
        variant.clear()
        variant.update(dtype=str(dtype).removeprefix("torch."), head_dim=dim, causal=causal, n=n, dropout=p)
        q, k, v = meta(r * s, 3, h, dim, dtype=dtype).view(r, s, 3, h, dim).unbind(2)  # the model's projection
        out, dout = meta(r, s, h, dim, dtype=dtype), meta(r, s, h, dim, dtype=dtype)
        lse = meta(r, s, h, dtype=torch.float32)
        bounds = meta(r, 1, s, n, dtype=torch.int32)
        tiles = tile_sizes(dim, q.element_size(), interpreted=False)
        bmm = meta(r, 1, s // tiles["fwd"][1], n, 2, dtype=torch.int32)
        module.fwd(q, k, v, out, lse, bounds, bmm, causal, dim**-0.5, p, 2**40 + 3, 12345, tiles)
        grads = [meta(r, s, h, dim, dtype=dtype) for _ in range(3)]
        module.bwd(dout, q, k, v, lse, lse, *grads, bounds, bmm, causal, dim**-0.5, p, 2**40 + 3, 12345, tiles)
    return records


def _main(argv=None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m kernels.flashmask", description="FlashMask kernel checks")
    parser.add_argument(
        "--compile-check",
        action="store_true",
        required=True,
        help="compile every kernel variant for sm_90 (no GPU needed) and print the resources",
    )
    parser.add_argument("--json", help="write the records here as JSON")
    args = parser.parse_args(argv)
    from kernels.compile_check import MAX_SHARED

    try:
        records = compile_check()
    except Exception as e:  # a compile error: one line, non-zero exit
        lines = str(e).strip().splitlines()
        print(f"flashmask compile check: {type(e).__name__}: {lines[-1] if lines else ''}", file=sys.stderr)
        return 1
    for r in records:
        extra = "" if r.get("registers") is None else f" regs {r['registers']} spill {r['spill_bytes']}B"
        print(
            f"{r['kernel']:14s} {r['dtype']:9s} D={r['head_dim']:<4d} causal={r['causal']!s:5s} n={r['n']} "
            f"p={r['dropout']} {r['blocks']} warps {r['num_warps']} stages {r['num_stages']} "
            f"shared {r['shared_bytes']}B{extra}"
        )
    if args.json:
        write_text(args.json, json.dumps(records, indent=1))
    bad = [r for r in records if r["shared_bytes"] > MAX_SHARED]
    if bad:
        print(
            f"flashmask compile check: {len(bad)} kernel(s) need more than {MAX_SHARED} bytes of shared memory",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"  # before Triton is imported
    sys.exit(_main())
