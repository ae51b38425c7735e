"""Triton device code of the attention kernel family (forward, dK/dV, dQ), with its launchers.

Do not import this module directly: ``kernels.runtime.jit_kernels(device)`` loads it in the
mode Triton itself was imported in and returns the module. The host-side launchers at the
bottom are the kernels' only callers.

q, k, v, o are ``[T, H, D]`` (head dim contiguous), sequences by ``cu_seqlens``; ``lse`` is
the base-2 log-sum-exp per (token, head). The switches (WINDOW, N_BOUNDS/CAUSAL, SEPARATE_K,
COUNT), the bounds layout and the dropout contract: docs/kernels.md, "The kernel module's
contract".
"""

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import tiles

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # set by kernels.runtime before loading
LOG2E = 1.4426950408889634  # the kernels work in base 2 (exp2, log2)


@triton.jit
def _keep(RNG, row0, col0, head, p_drop, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Dropout keep mask [BLOCK_R, BLOCK_C] for query tokens row0 + i and keys col0 + j.

    One Philox call gives four numbers, used for four adjacent keys: key 4q + c of token t
    and head h takes output c of philox(seed; t, q, h, offset). col0 must be a multiple of 4.

    (seed, offset) is the launch's [2] int64 device pair RNG (``kernels.runtime.draw_philox``),
    loaded here (volatile) for register pressure: docs/kernels.md, "Registers and occupancy on sm_90".
    """
    seed = tl.load(RNG, volatile=True)
    offset = tl.load(RNG + 1, volatile=True).to(tl.int32)  # the last 32-bit counter word
    rows = row0 + tl.arange(0, BLOCK_R)[:, None]
    quads = col0 // 4 + tl.arange(0, BLOCK_C // 4)[None, :]
    zero = rows * 0 + quads * 0
    r0, r1, r2, r3 = tl.philox(seed, rows + zero, quads + zero, zero + head, zero + offset)
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK_R, BLOCK_C])  # key 4q + c <- r_c
    return tl.uint_to_uniform_float(r) >= p_drop


@triton.jit
def _cast(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """x (fp32) -> dtype, rounding to nearest even (the interpreter truncates fp32 -> bf16: round
    the fp32 bits first so that it matches a GPU)."""
    if INTERP and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _dot_in(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """x (fp32) rounded to dtype as a ``tl.dot`` input (held in fp32 again in the interpreter,
    which has no bf16 arithmetic)."""
    y = _cast(x, dtype, INTERP)
    if INTERP:
        y = y.to(tl.float32)
    return y


# ---------------------------------------------------------------------------------------
# The attention family's building blocks. Each kernel below is a loop over tiles made of them.


@triton.jit
def _program(
    CU, CU_K, ORDER, order_start, head_dim,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ORDER: tl.constexpr, SEPARATE_K: tl.constexpr,
):  # fmt: skip
    """This program's sequence and block: (seq, first query token, query count, first key
    token, key count, the block's first row or column, head, head-dim offsets, their check)."""
    # A launch covers entries order_start .. order_start + grid[1] - 1 of the order (the
    # identity order when HAS_ORDER is false: a grouped plan whose batch is already in bucket
    # order still launches each group from its own start).
    seq = order_start + tl.program_id(1)
    if HAS_ORDER:
        seq = tl.load(ORDER + seq)
    start = tl.load(CU + seq)
    end = tl.load(CU + seq + 1)
    start_k, end_k = start, end
    if SEPARATE_K:
        start_k = tl.load(CU_K + seq)
        end_k = tl.load(CU_K + seq + 1)
    offs_d = tl.arange(0, BLOCK_D)
    first = tl.program_id(0) * BLOCK
    return seq, start, end - start, start_k, end_k - start_k, first, tl.program_id(2), offs_d, offs_d < head_dim


@triton.jit
def _block(first, start, length, BLOCK: tl.constexpr):
    """Indices of a block inside its sequence, whether each exists, and their token rows (int64)."""
    offs = first + tl.arange(0, BLOCK)
    return offs, offs < length, (start + offs).to(tl.int64)


@triton.jit
def _load_tile(PTR, tok, ok, stride_t, head, stride_h, offs_d, d_ok, INTERP: tl.constexpr):
    """[len(tok), BLOCK_D] of tokens tok, head ``head``; zeros where not ok."""
    x = tl.load(
        PTR + tok[:, None] * stride_t + head * stride_h + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0
    )
    if INTERP:  # the interpreter has no bf16 arithmetic: multiply the same values in fp32
        x = x.to(tl.float32)
    return x


@triton.jit
def _store_tile(PTR, x, tok, ok, stride_t, head, stride_h, offs_d, d_ok, INTERP: tl.constexpr):
    ptr = PTR + tok[:, None] * stride_t + head * stride_h + offs_d[None, :]
    tl.store(ptr, _cast(x, PTR.dtype.element_ty, INTERP), mask=ok[:, None] & d_ok[None, :])


@triton.jit
def _row_stats(LSE, DELTA, tok, ok, stride_lt, head, MASKED: tl.constexpr):
    """log-sum-exp and delta of the rows tok; where not ok, delta 0 and the log-sum-exp 0, or
    +inf when MASKED (a window or bounds: their tiles check the keys' range only)."""
    lse = tl.load(LSE + tok * stride_lt + head, mask=ok, other=float("inf") if MASKED else 0.0)
    return lse, tl.load(DELTA + tok * stride_lt + head, mask=ok, other=0.0)


@triton.jit
def _dropout_scaled(x, scale, p_drop, DROPOUT: tl.constexpr):
    """x * scale, and / (1-p) with dropout: the loops accumulate unscaled dropped tiles."""
    return x * (scale / (1.0 - p_drop)) if DROPOUT else x * scale


@triton.jit
def _key_range(
    r0, seqlen, seqlen_k, window_half,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """[lo, hi): the keys the query block [r0, r0 + BLOCK_M) can see at all (lo a multiple of
    BLOCK_N), and the tile counts of the blocks outside (skipped without a look)."""
    lo = 0
    hi = seqlen_k
    if CAUSAL:  # key blocks right of the diagonal are masked by causality alone
        hi = tl.minimum(hi, tl.minimum(r0 + BLOCK_M, seqlen))
    if WINDOW:
        lo = tl.maximum(r0 - window_half, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(hi, tl.minimum(r0 + BLOCK_M, seqlen) + window_half)
    return lo, hi, _first_counts(tl.cdiv(seqlen_k, BLOCK_N), lo, hi, BLOCK_N)


@triton.jit
def _query_range(
    c0, seqlen, seqlen_k, window_half,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """[lo, hi): the queries that can see the key block [c0, c0 + BLOCK_N) at all (lo a multiple
    of BLOCK_M), and the tile counts of the blocks outside."""
    lo = 0
    hi = seqlen
    if CAUSAL:  # query blocks above the diagonal are masked by causality alone
        lo = c0 // BLOCK_M * BLOCK_M
    if WINDOW:
        lo = tl.maximum(lo, tl.maximum(c0 - window_half, 0) // BLOCK_M * BLOCK_M)
        hi = tl.minimum(hi, tl.minimum(c0 + BLOCK_N, seqlen_k) + window_half)
    return lo, hi, _first_counts(tl.cdiv(seqlen, BLOCK_M), lo, hi, BLOCK_M)


@triton.jit
def _first_counts(n_blocks, lo, hi, BLOCK: tl.constexpr):
    """Tile counts (skipped, partial, unmasked, checked) before the loop over [lo, hi)."""
    looked = tl.maximum(hi - lo + BLOCK - 1, 0) // BLOCK
    return tl.where(tl.arange(0, 4) == 0, n_blocks - looked, 0)


@triton.jit
def _bounds_of(BND, BMM, seq, head, stride_bb, stride_bh, stride_mmb, stride_mmh):
    """The sequence's (and head's) FlashMask bounds and their per-block min/max."""
    seq = seq.to(tl.int64)
    return BND + seq * stride_bb + head * stride_bh, BMM + seq * stride_mmb + head * stride_mmh


@triton.jit
def _classify(BMMs, nb, stride_mmn, r0, r_end, c0, c_last, CAUSAL: tl.constexpr, N_BOUNDS: tl.constexpr):
    """(skip, unmasked) for query rows [r0, r_end) against the key block nb = [c0, c_last],
    from the bounds' per-block min/max alone."""
    p = BMMs + nb * stride_mmn  # [N_BOUNDS, 2] int32: (min, max) of each bound
    lts_min = tl.load(p)
    lts_max = tl.load(p + 1)
    if (N_BOUNDS == 4) or (CAUSAL and N_BOUNDS == 2):
        lte_min = tl.load(p + 2)
        lte_max = tl.load(p + 3)
        skip = (lts_max <= r0) & (lte_min >= r_end)
        unmasked = (lts_min >= r_end) | (lte_max <= r0)
    else:  # LTE = Sq: the interval runs to the last row
        skip = lts_max <= r0
        unmasked = lts_min >= r_end
    if CAUSAL:
        skip = skip | (r_end <= c0)
        unmasked = unmasked & (r0 >= c_last)
    else:
        if N_BOUNDS == 4:
            uts_min = tl.load(p + 4)
            uts_max = tl.load(p + 5)
            ute_min = tl.load(p + 6)
            ute_max = tl.load(p + 7)
            skip = skip | ((uts_max <= r0) & (ute_min >= r_end))
            unmasked = unmasked & ((uts_min >= r_end) | (ute_max <= r0))
        else:  # UTS = 0
            ute_min = tl.load(p + 2)
            ute_max = tl.load(p + 3)
            skip = skip | (ute_min >= r_end)
            unmasked = unmasked & (ute_max <= r0)
    return skip, unmasked


@triton.jit
def _load_bounds(BNDs, cols, col_ok, stride_bj, seqlen_q, CAUSAL: tl.constexpr, N_BOUNDS: tl.constexpr):
    """The four interval ends of the columns ``cols`` [BLOCK_N] (implicit ones filled in)."""
    ptr = BNDs + cols * stride_bj
    lts = tl.load(ptr, mask=col_ok, other=0)
    if (N_BOUNDS == 4) or (CAUSAL and N_BOUNDS == 2):
        lte = tl.load(ptr + 1, mask=col_ok, other=0)
    else:
        lte = lts * 0 + seqlen_q
    uts = lts * 0
    ute = lts * 0
    if N_BOUNDS == 4:
        uts = tl.load(ptr + 2, mask=col_ok, other=0)
        ute = tl.load(ptr + 3, mask=col_ok, other=0)
    elif not CAUSAL:
        ute = tl.load(ptr + 1, mask=col_ok, other=0)
    return lts, lte, uts, ute


@triton.jit
def _as_rows(x, KEYS_FIRST: tl.constexpr):
    """A per-query vector broadcast along the tile: [BM, 1], or [1, BM] with KEYS_FIRST (dK/dV)."""
    return x[None, :] if KEYS_FIRST else x[:, None]


@triton.jit
def _as_cols(x, KEYS_FIRST: tl.constexpr):
    """A per-key vector broadcast along the tile: [1, BN], or [BN, 1] with KEYS_FIRST."""
    return x[:, None] if KEYS_FIRST else x[None, :]


@triton.jit
def _mask_tile(
    BNDs, BMMs, stride_bj, stride_mmn, r0, c0, seqlen, seqlen_k, window_half,
    CAUSAL: tl.constexpr, N_BOUNDS: tl.constexpr, WINDOW: tl.constexpr, KEYS_FIRST: tl.constexpr,
    SKIP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The tile of query rows [r0, r0 + BLOCK_M) x key columns [c0, c0 + BLOCK_N) of a sequence
    under a window and/or bounds: (compute, ok, unmasked, checked).

    compute: something in the tile is to be computed (the constant True without bounds, or
    without SKIP: then a fully masked tile is computed with its mask, to the same result); ok:
    [BM, BN] ([BN, BM] with KEYS_FIRST) True where a score counts; unmasked: nothing in range
    is masked; checked: the bounds' min/max could not classify the tile, so its element mask
    was built (module docstring)."""
    rows = r0 + tl.arange(0, BLOCK_M)
    cols = c0 + tl.arange(0, BLOCK_N)
    col_ok = cols < seqlen_k
    r = _as_rows(rows, KEYS_FIRST)
    c = _as_cols(cols, KEYS_FIRST)
    # The keys' range only: a query row past the end is harmless (the forward does not store
    # it; in the backward its log-sum-exp reads as +inf, so its probabilities are 0).
    if KEYS_FIRST:
        ok = tl.broadcast_to(col_ok[:, None], [BLOCK_N, BLOCK_M])
    else:
        ok = tl.broadcast_to(col_ok[None, :], [BLOCK_M, BLOCK_N])
    r_end = tl.minimum(r0 + BLOCK_M, seqlen)
    c_last = tl.minimum(c0 + BLOCK_N, seqlen_k) - 1
    compute = True  # a window alone: the loop bounds already leave out the tiles outside it
    unmasked = r0 >= 0
    checked = r0 < 0
    if WINDOW:
        ok = ok & (r - c <= window_half) & (c - r <= window_half)
        unmasked = (r_end - 1 - c0 <= window_half) & (c_last - r0 <= window_half)
    if N_BOUNDS > 0:
        skip, none_masked = _classify(BMMs, c0 // BLOCK_N, stride_mmn, r0, r_end, c0, c_last, CAUSAL, N_BOUNDS)
        checked = (skip == 0) & (none_masked == 0)
        look = checked
        if not SKIP:  # a skipped tile is computed, fully masked: it needs its element mask too
            look = none_masked == 0
        if look:  # the element mask (checked and all masked: skipped after all, with no K/V loads)
            lts, lte, uts, ute = _load_bounds(BNDs, cols, col_ok, stride_bj, seqlen, CAUSAL, N_BOUNDS)
            lower = (r >= _as_cols(lts, KEYS_FIRST)) & (r < _as_cols(lte, KEYS_FIRST))
            masked = lower | ((r >= _as_cols(uts, KEYS_FIRST)) & (r < _as_cols(ute, KEYS_FIRST)))
            if CAUSAL:
                masked = masked | (r < c)
            valid = _as_rows(rows < seqlen, KEYS_FIRST) & _as_cols(col_ok, KEYS_FIRST)
            n_masked = tl.sum(tl.where(valid, masked, False).to(tl.int32))
            skip = n_masked == (r_end - r0) * (c_last + 1 - c0)
            none_masked = n_masked == 0
            ok = ok & (masked == 0)
        if SKIP:
            compute = skip == 0
        unmasked = unmasked & none_masked
    return compute, ok, unmasked, checked


@triton.jit
def _count(counts, compute, unmasked, checked):
    """counts [4] int32 (skipped, partial, unmasked, checked) plus one tile."""
    idx = tl.arange(0, 4)
    cls = tl.where(compute, tl.where(unmasked, 2, 1), 0)
    return counts + (idx == cls).to(tl.int32) + ((idx == 3) & checked).to(tl.int32)


@triton.jit
def _store_counts(CNT, counts, head):
    program = (tl.program_id(1) * tl.num_programs(2) + head) * tl.num_programs(0) + tl.program_id(0)
    tl.store(CNT + program * 4 + tl.arange(0, 4), counts)


# ---------------------------------------------------------------------------------------
# One tile of each kernel. ``ok`` is where the tile's scores count, [BM, BN] ([BN, BM] for
# dK/dV): in range, inside the window and the bounds; unused without either (``_tile``).


@triton.jit
def _fwd_tile(
    q, K, V, KEEP, m_i, l_i, acc, ok, r0, n0, start, start_k, seqlen, seqlen_k, head, offs_d, d_ok,
    stride_kt, stride_kh, stride_vt, stride_vh, keep_base, keep_max, qk_scale, p_drop, RNG,
    MASKED: tl.constexpr, DROPOUT: tl.constexpr, STORE_KEEP: tl.constexpr, INTERP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key block [n0, n0 + BLOCK_N) of the online softmax. MASKED (a window or bounds): a row
    may have seen no key yet."""
    cols, col_ok, kv_rows = _block(n0, start_k, seqlen_k, BLOCK_N)
    k = _load_tile(K, kv_rows, col_ok, stride_kt, head, stride_kh, offs_d, d_ok, INTERP)
    v = _load_tile(V, kv_rows, col_ok, stride_vt, head, stride_vh, offs_d, d_ok, INTERP)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BM, BN], base-2 logits
    if not MASKED:
        ok = col_ok[None, :]
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = m_new
    if MASKED:  # no -inf - -inf for a row that has seen no key yet
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        keep = _keep(RNG, start + r0, n0, head, p_drop, BLOCK_M, BLOCK_N)
        if STORE_KEEP:  # debug: report the mask, [B, H, S, S] with S = keep_max
            offs_m, row_ok, _ = _block(r0, start, seqlen, BLOCK_M)
            ptr = KEEP + keep_base + offs_m[:, None] * keep_max + cols[None, :]
            tl.store(ptr, keep.to(tl.int8), mask=row_ok[:, None] & col_ok[None, :])
        p = tl.where(keep, p, 0.0)
    acc = acc * alpha[:, None] + tl.dot(_dot_in(p, V.dtype.element_ty, INTERP), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _dq_tile(
    q, do, lse, delta, K, V, dq, ok, row_ok, r0, n0, start, start_k, seqlen_k, head, offs_d, d_ok,
    stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, p_drop, RNG,
    MASKED: tl.constexpr, DROPOUT: tl.constexpr, INTERP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key block [n0, n0 + BLOCK_N)'s contribution to the query block's dQ."""
    cols, col_ok, kv_rows = _block(n0, start_k, seqlen_k, BLOCK_N)
    k = _load_tile(K, kv_rows, col_ok, stride_kt, head, stride_kh, offs_d, d_ok, INTERP)
    v = _load_tile(V, kv_rows, col_ok, stride_vt, head, stride_vh, offs_d, d_ok, INTERP)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    p = tl.exp2(s - lse[:, None])
    if not MASKED:
        ok = row_ok[:, None] & col_ok[None, :]
    p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if DROPOUT:  # unscaled: 1/(1-p) is applied to dQ after the loop
        keep = _keep(RNG, start + r0, n0, head, p_drop, BLOCK_M, BLOCK_N)
        dp = tl.where(keep, dp, 0.0)
    delta = tl.where(seqlen_k <= BLOCK_N, tl.sum(p * dp, 1), delta)  # the row's every key is here (_dkdv_tile)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(_dot_in(ds, K.dtype.element_ty, INTERP), k, input_precision=DOT_PRECISION)


@triton.jit
def _dkdv_tile(
    k, v, Q, DO, LSE, DELTA, dk, dv, ok_t, col_ok, m0, c0, start, seqlen, seqlen_k, head, offs_d, d_ok,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_lt, qk_scale, p_drop, RNG,
    MASKED: tl.constexpr, DROPOUT: tl.constexpr, INTERP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Query block [m0, m0 + BLOCK_M)'s contribution to the key block's dK and dV, in the
    transposed orientation ([keys, queries]) so that no [BM, BN] tile is transposed."""
    _, row_ok, rows = _block(m0, start, seqlen, BLOCK_M)
    q = _load_tile(Q, rows, row_ok, stride_qt, head, stride_qh, offs_d, d_ok, INTERP)
    do = _load_tile(DO, rows, row_ok, stride_dot, head, stride_doh, offs_d, d_ok, INTERP)
    lse, delta = _row_stats(LSE, DELTA, rows, row_ok, stride_lt, head, MASKED)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # [BN, BM]
    p_t = tl.exp2(s_t - lse[None, :])
    if not MASKED:
        ok_t = col_ok[:, None] & row_ok[None, :]
    p_t = tl.where(ok_t, p_t, 0.0)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BN, BM]
    if DROPOUT:  # unscaled: 1/(1-p) is applied to dK, dV after the loop
        keep_t = tl.trans(_keep(RNG, start + m0, c0, head, p_drop, BLOCK_M, BLOCK_N))
        pd_t = tl.where(keep_t, p_t, 0.0)
        dp_t = tl.where(keep_t, dp_t, 0.0)
        delta = delta * (1.0 - p_drop)
    else:
        pd_t = p_t
    # The rows' every key in this tile: delta as the softmax's own backward has it, from this
    # rounded dP, not rowsum(dO * O), a D-term sum whose rounding dS does not cancel
    # (docs/kernels.md, "dK in fp32 on short rows"). No branch: one around a tile's step spills.
    delta = tl.where(seqlen_k <= BLOCK_N, tl.sum(p_t * dp_t, 0), delta)
    dv += tl.dot(_dot_in(pd_t, DO.dtype.element_ty, INTERP), do, input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(_dot_in(ds_t, Q.dtype.element_ty, INTERP), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _tile(
    BNDs, BMMs, stride_bj, stride_mmn, r0, c0, seqlen, seqlen_k, window_half, counts,
    CAUSAL: tl.constexpr, N_BOUNDS: tl.constexpr, WINDOW: tl.constexpr, COUNT: tl.constexpr,
    KEYS_FIRST: tl.constexpr, SKIP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """(compute, ok, counts) of the tile [r0, r0 + BLOCK_M) x [c0, c0 + BLOCK_N). With no
    window and no bounds, compute is the constant True and ok unused: the tile step checks the
    range alone, as the plain varlen kernels do, and nothing more is computed."""
    if (N_BOUNDS > 0) or WINDOW:
        compute, ok, unmasked, checked = _mask_tile(
            BNDs, BMMs, stride_bj, stride_mmn, r0, c0, seqlen, seqlen_k, window_half,
            CAUSAL, N_BOUNDS, WINDOW, KEYS_FIRST, SKIP, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        if COUNT:
            counts = _count(counts, compute, unmasked, checked)
    else:
        compute = True
        ok = True  # unused: see the docstring
    return compute, ok, counts


# ---------------------------------------------------------------------------------------
# The kernels. Grid: (row or column blocks, sequences of the launch, heads).
# fmt: off


@triton.jit(do_not_specialize=["order_start", "window_half"])
def _attn_fwd(
    Q, K, V, O, LSE, KEEP, CU, CU_K, ORDER, BND, BMM, CNT, order_start,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt,
    stride_bb, stride_bh, stride_bj, stride_mmb, stride_mmh, stride_mmn,
    head_dim, keep_max, window_half, qk_scale, p_drop, RNG,
    HAS_ORDER: tl.constexpr, SEPARATE_K: tl.constexpr, N_BOUNDS: tl.constexpr, CAUSAL: tl.constexpr, SKIP: tl.constexpr,
    WINDOW: tl.constexpr, DROPOUT: tl.constexpr, STORE_KEEP: tl.constexpr, COUNT: tl.constexpr,
    INTERP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One block of BLOCK_M queries: the online softmax over the key blocks it can see."""
    seq, start, seqlen, start_k, seqlen_k, r0, head, offs_d, d_ok = _program(
        CU, CU_K, ORDER, order_start, head_dim, BLOCK_M, BLOCK_D, HAS_ORDER, SEPARATE_K)
    if r0 >= seqlen:
        return
    BNDs, BMMs = _bounds_of(BND, BMM, seq, head, stride_bb, stride_bh, stride_mmb, stride_mmh)
    offs_m, row_ok, rows = _block(r0, start, seqlen, BLOCK_M)
    q = _load_tile(Q, rows, row_ok, stride_qt, head, stride_qh, offs_d, d_ok, INTERP)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    keep_base = (seq * tl.num_programs(2) + head).to(tl.int64) * keep_max * keep_max
    lo, hi, counts = _key_range(r0, seqlen, seqlen_k, window_half, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        compute, ok, counts = _tile(BNDs, BMMs, stride_bj, stride_mmn, r0, n0, seqlen, seqlen_k, window_half,
                                    counts, CAUSAL, N_BOUNDS, WINDOW, COUNT, False, SKIP, BLOCK_M, BLOCK_N)
        if compute:
            m_i, l_i, acc = _fwd_tile(
                q, K, V, KEEP, m_i, l_i, acc, ok, r0, n0, start, start_k, seqlen, seqlen_k, head, offs_d, d_ok,
                stride_kt, stride_kh, stride_vt, stride_vh, keep_base, keep_max, qk_scale, p_drop, RNG,
                (N_BOUNDS > 0) or WINDOW, DROPOUT, STORE_KEEP, INTERP, DOT_PRECISION, BLOCK_M, BLOCK_N)
    if (N_BOUNDS > 0) or WINDOW:  # rows that saw no key (bounds; past the end with a window): zeros
        seen = l_i > 0.0
        l_i = tl.where(seen, l_i, 1.0)
    acc = acc / (l_i[:, None] * (1.0 - p_drop)) if DROPOUT else acc / l_i[:, None]
    _store_tile(O, acc, rows, row_ok, stride_ot, head, stride_oh, offs_d, d_ok, INTERP)
    lse = m_i + tl.log2(l_i)
    if N_BOUNDS > 0:  # and a +inf log-sum-exp, so that the backward gives them no gradient
        lse = tl.where(seen, lse, float("inf"))
    tl.store(LSE + rows * stride_lt + head, lse, mask=row_ok)
    if COUNT:
        _store_counts(CNT, counts, head)


@triton.jit(do_not_specialize=["order_start", "window_half"])
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU, CU_K, ORDER, BND, BMM, CNT, order_start,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lt,
    stride_bb, stride_bh, stride_bj, stride_mmb, stride_mmh, stride_mmn,
    head_dim, window_half, qk_scale, sm_scale, p_drop, RNG,
    HAS_ORDER: tl.constexpr, SEPARATE_K: tl.constexpr, N_BOUNDS: tl.constexpr, CAUSAL: tl.constexpr, SKIP: tl.constexpr,
    WINDOW: tl.constexpr, DROPOUT: tl.constexpr, COUNT: tl.constexpr, INTERP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One block of BLOCK_N keys: loop over the query blocks that can see it, accumulate dK and dV."""
    seq, start, seqlen, start_k, seqlen_k, c0, head, offs_d, d_ok = _program(
        CU, CU_K, ORDER, order_start, head_dim, BLOCK_N, BLOCK_D, HAS_ORDER, SEPARATE_K)
    if c0 >= seqlen_k:
        return
    offs_n, col_ok, kv_rows = _block(c0, start_k, seqlen_k, BLOCK_N)
    BNDs, BMMs = _bounds_of(BND, BMM, seq, head, stride_bb, stride_bh, stride_mmb, stride_mmh)
    k = _load_tile(K, kv_rows, col_ok, stride_kt, head, stride_kh, offs_d, d_ok, INTERP)
    v = _load_tile(V, kv_rows, col_ok, stride_vt, head, stride_vh, offs_d, d_ok, INTERP)
    lo, hi, counts = _query_range(c0, seqlen, seqlen_k, window_half, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        compute, ok_t, counts = _tile(BNDs, BMMs, stride_bj, stride_mmn, m0, c0, seqlen, seqlen_k, window_half,
                                      counts, CAUSAL, N_BOUNDS, WINDOW, COUNT, True, SKIP, BLOCK_M, BLOCK_N)
        if compute:
            dk, dv = _dkdv_tile(
                k, v, Q, DO, LSE, DELTA, dk, dv, ok_t, col_ok, m0, c0, start, seqlen, seqlen_k, head, offs_d, d_ok,
                stride_qt, stride_qh, stride_dot, stride_doh, stride_lt, qk_scale, p_drop, RNG,
                (N_BOUNDS > 0) or WINDOW, DROPOUT, INTERP, DOT_PRECISION, BLOCK_M, BLOCK_N)
    dv = _dropout_scaled(dv, 1.0, p_drop, DROPOUT)
    dk = _dropout_scaled(dk, sm_scale, p_drop, DROPOUT)
    if seqlen_k == 1:  # see _attn_bwd_dq
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    _store_tile(DK, dk, kv_rows, col_ok, stride_dkt, head, stride_dkh, offs_d, d_ok, INTERP)
    _store_tile(DV, dv, kv_rows, col_ok, stride_dvt, head, stride_dvh, offs_d, d_ok, INTERP)
    if COUNT:
        _store_counts(CNT, counts, head)


@triton.jit(do_not_specialize=["order_start", "window_half"])
def _attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, CU, CU_K, ORDER, BND, BMM, CNT, order_start,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lt, stride_bb, stride_bh, stride_bj, stride_mmb, stride_mmh, stride_mmn,
    head_dim, window_half, qk_scale, sm_scale, p_drop, RNG,
    HAS_ORDER: tl.constexpr, SEPARATE_K: tl.constexpr, N_BOUNDS: tl.constexpr, CAUSAL: tl.constexpr, SKIP: tl.constexpr,
    WINDOW: tl.constexpr, DROPOUT: tl.constexpr, COUNT: tl.constexpr, INTERP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One block of BLOCK_M queries: loop over the key blocks it can see, accumulate dQ."""
    seq, start, seqlen, start_k, seqlen_k, r0, head, offs_d, d_ok = _program(
        CU, CU_K, ORDER, order_start, head_dim, BLOCK_M, BLOCK_D, HAS_ORDER, SEPARATE_K)
    if r0 >= seqlen:
        return
    offs_m, row_ok, rows = _block(r0, start, seqlen, BLOCK_M)
    q = _load_tile(Q, rows, row_ok, stride_qt, head, stride_qh, offs_d, d_ok, INTERP)
    do = _load_tile(DO, rows, row_ok, stride_dot, head, stride_doh, offs_d, d_ok, INTERP)
    lse, delta = _row_stats(LSE, DELTA, rows, row_ok, stride_lt, head, (N_BOUNDS > 0) or WINDOW)
    if DROPOUT:
        delta = delta * (1.0 - p_drop)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    BNDs, BMMs = _bounds_of(BND, BMM, seq, head, stride_bb, stride_bh, stride_mmb, stride_mmh)
    lo, hi, counts = _key_range(r0, seqlen, seqlen_k, window_half, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        compute, ok, counts = _tile(BNDs, BMMs, stride_bj, stride_mmn, r0, n0, seqlen, seqlen_k, window_half,
                                    counts, CAUSAL, N_BOUNDS, WINDOW, COUNT, False, SKIP, BLOCK_M, BLOCK_N)
        if compute:
            dq = _dq_tile(
                q, do, lse, delta, K, V, dq, ok, row_ok, r0, n0, start, start_k, seqlen_k, head, offs_d, d_ok,
                stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, p_drop, RNG,
                (N_BOUNDS > 0) or WINDOW, DROPOUT, INTERP, DOT_PRECISION, BLOCK_M, BLOCK_N)
    dq = _dropout_scaled(dq, sm_scale, p_drop, DROPOUT)
    if seqlen_k == 1:
        # One key: the softmax is constant, so the score gets exactly zero gradient. The
        # formula's delta comes from the rounded output and would leave a rounding residue
        # (with dropout, O = V / (1-p) is not exact in fp16/bf16).
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    _store_tile(DQ, dq, rows, row_ok, stride_dqt, head, stride_dqh, offs_d, d_ok, INTERP)
    if COUNT:
        _store_counts(CNT, counts, head)


# fmt: on


# ---------------------------------------------------------------------------------------
# Host-side launchers. Block sizes come from ``kernels.tiles``' one table, in the preset
# KERNELS_ATTENTION_TILES names (read when this module loads; the compile check sets TILE_PRESET).

TILE_PRESET = tiles.preset_from_env()


class Sequences(NamedTuple):
    """What one attention launch covers, and how it masks (docs/kernels.md, "The kernel module's contract")."""

    cu_seqlens: torch.Tensor  # [B+1] int32: the queries' (and keys') offsets
    order: torch.Tensor | None  # [B] int32 sequence indices; None: 0 .. B-1
    order_start: int  # first entry of the order this launch covers
    n_seqs: int  # sequences this launch covers
    max_len: int  # longest query count among them (sizes the grid)
    max_len_k: int | None = None  # longest key count, when the keys have their own offsets
    cu_seqlens_k: torch.Tensor | None = None  # [B+1] int32 keys' offsets (cross attention)
    window: int | None = None  # the band |i - j| <= window // 2
    bounds: torch.Tensor | None = None  # [B, H or 1, Sk, n] int32 FlashMask bounds
    block_minmax: torch.Tensor | None = None  # [B, H or 1, cdiv(Sk, BLOCK_N), n, 2] int32
    causal: bool = False  # with bounds: rows i < j masked too


def _launch(kernel, grid, *args, **kwargs):
    """Every launch goes through here (tests swap it to compile for a GPU without one)."""
    kernel[grid](*args, **kwargs)


def _launch_opts(num_warps, num_stages):
    return {} if INTERPRET else {"num_warps": num_warps, "num_stages": num_stages}


def _block_d(q):
    return max(16, triton.next_power_of_2(q.shape[-1]))


def bounded_key_block(q):
    """BLOCK_N of all three kernels with FlashMask bounds on q's dtype and head dim."""
    return tiles.bounded_key_block(_block_d(q), q.element_size())


def dot_precision(q):
    """``tl.dot``'s input precision, read at each launch: fp32 in TF32 exactly when torch's
    ``allow_tf32`` is set, else "ieee" (docs/kernels.md, "Contracts"); unused for 16-bit inputs."""
    return "tf32" if q.element_size() != 4 or torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _prepare(q, seqs, p_drop, blocks):
    """(blocks per kernel, pointer arguments, mask strides, window_half, compile-time switches)."""
    if seqs.n_seqs > 65535 or q.shape[1] > 65535:
        raise ValueError(
            f"attention launch: {seqs.n_seqs} sequences x {q.shape[1]} heads exceeds CUDA's grid limit 65535"
        )
    block_d = _block_d(q)
    bounds, bmm, cu = seqs.bounds, seqs.block_minmax, seqs.cu_seqlens
    n_bounds = 0 if bounds is None else bounds.shape[-1]
    if blocks is None:  # (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel; one BLOCK_N with bounds
        blocks = {
            name: tiles.attention_tiles(name, block_d, q.element_size(), p_drop > 0, TILE_PRESET, n_bounds, INTERPRET)
            for name in ("fwd", "dkdv", "dq")
        }
    order = cu if seqs.order is None else seqs.order
    cu_k = cu if seqs.cu_seqlens_k is None else seqs.cu_seqlens_k
    if bounds is None:
        pointers, mask_strides = (cu, cu_k, order, cu, cu), (0,) * 6
    else:
        hb = bounds.shape[1] > 1  # per-head bounds, else broadcast over heads (stride 0)
        pointers = (cu, cu_k, order, bounds, bmm)
        mask_strides = (bounds.stride(0), bounds.stride(1) if hb else 0, bounds.stride(2))
        mask_strides += (bmm.stride(0), bmm.stride(1) if hb else 0, bmm.stride(2))
    switches = dict(
        HAS_ORDER=seqs.order is not None,
        SEPARATE_K=seqs.cu_seqlens_k is not None,
        N_BOUNDS=n_bounds,
        CAUSAL=seqs.causal,
        # On a GPU in fp32 (FMA dots, no tensor cores) the branch around a tile's step makes
        # ptxas spill hundreds of bytes: there a skipped tile is computed, fully masked.
        SKIP=INTERPRET or q.element_size() != 4,
        WINDOW=seqs.window is not None,
        DROPOUT=p_drop > 0,
        INTERP=INTERPRET,
        DOT_PRECISION=dot_precision(q),
        BLOCK_D=block_d,
    )
    return blocks, pointers, mask_strides, (seqs.window or 0) // 2, switches


def _launch_pass(kernel, block, programs, seqs, q, lse, tensors, strided, mask_strides, scalars, switches, **flags):
    """One launch of a kernel of the family: the argument order all three share."""
    bm, bn, warps, stages = block
    _launch(
        kernel,
        (programs, seqs.n_seqs, q.shape[1]),
        *tensors,
        seqs.order_start,
        *(s for x in strided for s in (x.stride(0), x.stride(1))),  # token and head strides
        lse.stride(0),
        *mask_strides,
        *scalars,
        BLOCK_M=bm,
        BLOCK_N=bn,
        **flags,
        **switches,
        **_launch_opts(warps, stages),
    )


def attn_fwd(q, k, v, out, lse, seqs, softmax_scale, p_drop, rng, keep=None, counts=None, blocks=None):
    """One forward launch over ``seqs`` (a ``Sequences``).

    q, out: [T, H, D]; k, v: [Tk, H, D]; lse: [T, H] fp32 (written); rng: [2] int64 on q's
    device, the dropout (seed, offset), read by the kernel (never by the host); keep: optional
    [B, H, S, S] int8 debug output of the dropout mask (S = keep.shape[-1]); counts: optional
    int32 [B*H*cdiv(S, BLOCK_M), 4] debug tile counts (bounds or a window); blocks: tiles
    {kernel: (BLOCK_M, BLOCK_N, warps, stages)} instead of the table's.
    """
    blocks, pointers, mask_strides, window_half, switches = _prepare(q, seqs, p_drop, blocks)
    tensors = (q, k, v, out, lse, out if keep is None else keep, *pointers, lse if counts is None else counts)
    keep_max = 0 if keep is None else keep.shape[-1]
    scalars = (q.shape[2], keep_max, window_half, softmax_scale * LOG2E, p_drop, rng)
    programs = triton.cdiv(seqs.max_len, blocks["fwd"][0])
    common = (seqs, q, lse, tensors, (q, k, v, out), mask_strides, scalars, switches)
    _launch_pass(_attn_fwd, blocks["fwd"], programs, *common, STORE_KEEP=keep is not None, COUNT=counts is not None)


def attn_bwd(dout, q, k, v, lse, delta, dq, dk, dv, seqs, softmax_scale, p_drop, rng, counts=None, blocks=None):
    """The backward launches (dK/dV, then dQ) over the same sequences as attn_fwd. dout: [T, H, D];
    lse, delta: [T, H] fp32; dq, dk, dv: like q, k, v (written); counts: optional debug tile
    counts {"dkdv": ..., "dq": ...} as for attn_fwd."""
    blocks, pointers, mask_strides, window_half, switches = _prepare(q, seqs, p_drop, blocks)
    counts = counts or {}
    scalars = (q.shape[2], window_half, softmax_scale * LOG2E, softmax_scale, p_drop, rng)
    common = (mask_strides, scalars, switches)
    keys = triton.cdiv(seqs.max_len if seqs.max_len_k is None else seqs.max_len_k, blocks["dkdv"][1])
    tensors = (q, k, v, dout, lse, delta, dk, dv, *pointers, counts.get("dkdv", lse))
    strided = (q, k, v, dout, dk, dv)
    _launch_pass(_attn_bwd_dkdv, blocks["dkdv"], keys, seqs, q, lse, tensors, strided, *common, COUNT="dkdv" in counts)
    tensors = (q, k, v, dout, lse, delta, dq, *pointers, counts.get("dq", lse))
    queries = triton.cdiv(seqs.max_len, blocks["dq"][0])
    _launch_pass(
        _attn_bwd_dq, blocks["dq"], queries, seqs, q, lse, tensors, (q, k, v, dout, dq), *common, COUNT="dq" in counts
    )
