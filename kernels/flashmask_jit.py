"""Triton device code for FlashMask attention (forward; backward as a dK/dV pass and a dQ pass).

Do not import this module directly: ``kernels.flashmask`` loads it once per Triton mode
(compiled for CUDA, or interpreted on CPU) next to ``kernels/jit_kernels.py`` loaded in the
same mode, and hands that module in as ``BASE`` before executing this file; the dropout
(``_keep``) and interpreter rounding (``_cast``) helpers are shared with the varlen kernels,
so a packed row drops exactly what an unpadded sequence with the same token index would.

Layout: q, o ``[B, Sq, H, D]``, k, v ``[B, Sk, H, D]`` (any batch/token/head strides, head dim
contiguous); ``lse`` and ``delta`` ``[B, Sq, H]`` fp32, base 2. The mask is FlashMask's
column-wise form: for key column j the masked rows are [LTS_j, LTE_j) and [UTS_j, UTE_j),
plus rows i < j when causal; ``BND`` holds the N_BOUNDS given bounds per column
(``[B, H or 1, Sk, N_BOUNDS]``, head stride 0 when broadcast) and the rest are implicit:

    N_BOUNDS  causal      given                 implicit
    1         yes         LTS                   LTE = Sq, no UT interval
    2         yes         LTS, LTE              no UT interval
    2         no          LTS, UTE              LTE = Sq, UTS = 0
    4         no          LTS, LTE, UTS, UTE    -

``BMM`` holds, per block of BLOCK_N keys, the min and max of each given bound over the block's
columns (``[B, H or 1, cdiv(Sk, BLOCK_N), N_BOUNDS, 2]``, computed once per call on the host).
From those few scalars every (query block, key block) tile is classified before anything
is loaded:

- skipped: every column's masked rows contain the whole query block through one interval
  (max start <= first row and min end >= last row + 1), or, causal, the block lies wholly
  above the diagonal. Nothing is loaded and nothing is computed.
- unmasked: no column's intervals meet the query block (min start >= last row + 1 or max
  end <= first row, for each interval), and, causal, the block lies on or below the
  diagonal. Computed densely with no mask work at all.
- otherwise the min/max cannot tell ("checked"): the block's column bounds are loaded and
  the element mask built, as a partially masked tile needs anyway, and counted. All masked
  (columns covered by different intervals, e.g. a document's end next to padding): the tile
  is skipped after all, with no K/V loads and no math; none masked: unmasked; else partial,
  the element mask applied.

So a tile is skipped exactly when its dense mask is all masked, for any bounds; the min/max
decides alone for the masks ``kernels.flashmask``'s builders make. The debug flag COUNT
stores each program's counts (skipped, partial, unmasked, checked).

Fully masked rows produce zeros (and a +inf log-sum-exp, so the backward gives them zero
gradients); the online softmax guards its running maximum so that no -inf - -inf appears.
"""

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # set by the loader
BASE = globals()["BASE"]  # noqa: F821 -- injected by kernels.flashmask before this file runs
_keep = BASE._keep
_cast = BASE._cast
LOG2E = 1.4426950408889634


@triton.jit
def _classify(BMM, mm_base, nb, stride_mmn, r0, r_end, c0, c_last, CAUSAL: tl.constexpr, N_BOUNDS: tl.constexpr):
    """(skip, unmasked) for query rows [r0, r_end) against the key block nb = [c0, c_last]."""
    p = BMM + mm_base + nb * stride_mmn  # [N_BOUNDS, 2] int32: (min, max) of each bound
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
def _load_bounds(BND, bnd_base, cols, col_ok, stride_bj, seqlen_q, CAUSAL: tl.constexpr, N_BOUNDS: tl.constexpr):
    """The four interval ends of the columns ``cols`` [BLOCK_N] (implicit ones filled in)."""
    ptr = BND + bnd_base + cols * stride_bj
    lts = tl.load(ptr, mask=col_ok, other=0)
    if (N_BOUNDS == 4) or (CAUSAL and N_BOUNDS == 2):
        lte = tl.load(ptr + 1, mask=col_ok, other=0)
    else:
        lte = lts * 0 + seqlen_q
    if N_BOUNDS == 4:
        uts = tl.load(ptr + 2, mask=col_ok, other=0)
        ute = tl.load(ptr + 3, mask=col_ok, other=0)
    elif CAUSAL:
        uts = lts * 0
        ute = lts * 0
    else:
        uts = lts * 0
        ute = tl.load(ptr + 1, mask=col_ok, other=0)
    return lts, lte, uts, ute


@triton.jit
def _element_mask(rows, cols, lts, lte, uts, ute, CAUSAL: tl.constexpr):
    """[BM, BN] True where query rows[:, None] must not see key cols[None, :]."""
    r = rows[:, None]
    masked = ((r >= lts[None, :]) & (r < lte[None, :])) | ((r >= uts[None, :]) & (r < ute[None, :]))
    if CAUSAL:
        masked = masked | (r < cols[None, :])
    return masked


@triton.jit
def _element_mask_t(rows, cols, lts, lte, uts, ute, CAUSAL: tl.constexpr):
    """``_element_mask`` transposed: [BN, BM], keys along the first axis."""
    r = rows[None, :]
    masked = ((r >= lts[:, None]) & (r < lte[:, None])) | ((r >= uts[:, None]) & (r < ute[:, None]))
    if CAUSAL:
        masked = masked | (r < cols[:, None])
    return masked


@triton.jit
def _refine(masked, valid, n_valid):
    """(all masked, none masked) of an element mask over its valid part (n_valid elements)."""
    n_masked = tl.sum(tl.where(valid, masked, False).to(tl.int32))
    return n_masked == n_valid, n_masked == 0


@triton.jit
def _fwd_step(
    q,
    K,
    V,
    k_base,
    v_base,
    cols,
    kv_mask,
    offs_d,
    stride_ks,
    stride_vs,
    invalid,
    m_i,
    l_i,
    acc,
    qk_scale,
    p_drop,
    seed,
    offset,
    row0,
    c0,
    h,
    DROPOUT: tl.constexpr,
    INTERP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One key block of the online softmax; ``invalid`` ([BM, BN] or [1, BN]) is what to mask."""
    k = tl.load(K + k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
    if INTERP:  # the interpreter has no bf16 arithmetic: multiply the same values in fp32
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BM, BN], base-2 logits
    s = tl.where(invalid, float("-inf"), s)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        keep = _keep(seed, offset, row0, c0, h, p_drop, BLOCK_M, BLOCK_N)
        p = tl.where(keep, p, 0.0)
    pv = _cast(p, V.dtype.element_ty, INTERP)
    if INTERP:
        pv = pv.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "heads", "seed", "offset"])
def _fm_fwd(
    Q,
    K,
    V,
    O,
    LSE,
    BND,
    BMM,
    CNT,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    stride_lb,
    stride_ls,
    stride_bb,
    stride_bh,
    stride_bj,
    stride_mmb,
    stride_mmh,
    stride_mmn,
    seqlen_q,
    seqlen_k,
    heads,
    head_dim,
    qk_scale,
    p_drop,
    seed,
    offset,
    CAUSAL: tl.constexpr,
    N_BOUNDS: tl.constexpr,
    DROPOUT: tl.constexpr,
    COUNT: tl.constexpr,
    INTERP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    r0 = pid_m * BLOCK_M
    r_end = tl.minimum(r0 + BLOCK_M, seqlen_q)
    offs_m = r0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    d_ok = offs_d < head_dim
    k_base = b.to(tl.int64) * stride_kb + h * stride_kh
    v_base = b.to(tl.int64) * stride_vb + h * stride_vh
    bnd_base = b.to(tl.int64) * stride_bb + h * stride_bh
    mm_base = b.to(tl.int64) * stride_mmb + h * stride_mmh
    row0 = b * seqlen_q + r0  # token index of the first row, for dropout

    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if INTERP:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_blocks = tl.cdiv(seqlen_k, BLOCK_N)
    n_end = n_blocks
    if CAUSAL:  # key blocks right of the diagonal are masked by causality alone
        n_end = tl.minimum(n_blocks, tl.cdiv(r_end, BLOCK_N))
    zero = pid_m * 0
    n_skip = zero + (n_blocks - n_end)
    n_part = zero
    n_full = zero
    n_check = zero
    for nb in range(0, n_end):
        c0 = nb * BLOCK_N
        c_last = tl.minimum(c0 + BLOCK_N, seqlen_k) - 1
        skip, unmasked = _classify(BMM, mm_base, nb, stride_mmn, r0, r_end, c0, c_last, CAUSAL, N_BOUNDS)
        cols = c0 + offs_n
        col_ok = cols < seqlen_k
        kv_mask = col_ok[:, None] & d_ok[None, :]
        # One call of the step for all classes (not one per class) keeps the kernel small and
        # its register use low; ``invalid`` collects what the step must mask.
        invalid = tl.broadcast_to((cols >= seqlen_k)[None, :], [BLOCK_M, BLOCK_N])  # out of range, so far
        if skip:
            if COUNT:
                n_skip += 1
        elif not unmasked:  # the bounds' min/max cannot tell: look at the element mask
            lts, lte, uts, ute = _load_bounds(BND, bnd_base, cols, col_ok, stride_bj, seqlen_q, CAUSAL, N_BOUNDS)
            masked = _element_mask(offs_m, cols, lts, lte, uts, ute, CAUSAL)
            all_masked, none_masked = _refine(
                masked, row_ok[:, None] & col_ok[None, :], (r_end - r0) * (c_last + 1 - c0)
            )
            invalid = invalid | masked
            skip = all_masked
            unmasked = none_masked
            if COUNT:
                n_check += 1
                if all_masked:
                    n_skip += 1
        if not skip:
            m_i, l_i, acc = _fwd_step(
                q,
                K,
                V,
                k_base,
                v_base,
                cols,
                kv_mask,
                offs_d,
                stride_ks,
                stride_vs,
                invalid,
                m_i,
                l_i,
                acc,
                qk_scale,
                p_drop,
                seed,
                offset,
                row0,
                c0,
                h,
                DROPOUT,
                INTERP,
                DOT_PRECISION,
                BLOCK_M,
                BLOCK_N,
            )
            if COUNT:
                if unmasked:
                    n_full += 1
                else:
                    n_part += 1
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    if DROPOUT:
        acc = acc / (l_safe[:, None] * (1.0 - p_drop))
    else:
        acc = acc / l_safe[:, None]  # rows that saw no key keep acc = 0
    tl.store(
        O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
        _cast(acc, O.dtype.element_ty, INTERP),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("inf"))  # of the undropped probabilities
    tl.store(LSE + b.to(tl.int64) * stride_lb + offs_m * stride_ls + h, lse, mask=row_ok)
    if COUNT:
        _store_counts(CNT, bh * tl.num_programs(0) + pid_m, n_skip, n_part, n_full, n_check)


@triton.jit
def _store_counts(CNT, program, n_skip, n_part, n_full, n_check):
    cnt = CNT + program * 4
    tl.store(cnt, n_skip)
    tl.store(cnt + 1, n_part)
    tl.store(cnt + 2, n_full)
    tl.store(cnt + 3, n_check)


@triton.jit
def _dkdv_step(
    k,
    v,
    Q,
    DO,
    LSE,
    DELTA,
    q_base,
    do_base,
    l_base,
    qi,
    row_ok,
    d_ok,
    offs_d,
    stride_qs,
    stride_dos,
    stride_ls,
    invalid_t,
    dk,
    dv,
    qk_scale,
    p_drop,
    seed,
    offset,
    row0,
    c0,
    h,
    DROPOUT: tl.constexpr,
    INTERP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One query block's contribution to dK, dV; ``invalid_t`` ([BN, BM] or [BN, 1]) is what to mask."""
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + q_base + qi[:, None] * stride_qs + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + do_base + qi[:, None] * stride_dos + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + l_base + qi * stride_ls, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + l_base + qi * stride_ls, mask=row_ok, other=0.0)
    if INTERP:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # [BN, BM]
    p_t = tl.exp2(s_t - lse[None, :])  # 0 for padding rows and rows that saw nothing (lse = inf)
    p_t = tl.where(invalid_t, 0.0, p_t)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BN, BM]
    if DROPOUT:  # unscaled, as in the varlen kernels: 1/(1-p) is applied to dK, dV after the loop
        keep_t = tl.trans(_keep(seed, offset, row0, c0, h, p_drop, BLOCK_M, BLOCK_N))
        pd_t = tl.where(keep_t, p_t, 0.0)
        dp_t = tl.where(keep_t, dp_t, 0.0)
        delta = delta * (1.0 - p_drop)
    else:
        pd_t = p_t
    pd_lo = _cast(pd_t, DO.dtype.element_ty, INTERP)
    if INTERP:
        pd_lo = pd_lo.to(tl.float32)
    dv += tl.dot(pd_lo, do, input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    ds_lo = _cast(ds_t, Q.dtype.element_ty, INTERP)
    if INTERP:
        ds_lo = ds_lo.to(tl.float32)
    dk += tl.dot(ds_lo, q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "heads", "seed", "offset"])
def _fm_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    BND,
    BMM,
    CNT,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    stride_lb,
    stride_ls,
    stride_bb,
    stride_bh,
    stride_bj,
    stride_mmb,
    stride_mmh,
    stride_mmn,
    seqlen_q,
    seqlen_k,
    heads,
    head_dim,
    qk_scale,
    sm_scale,
    p_drop,
    seed,
    offset,
    CAUSAL: tl.constexpr,
    N_BOUNDS: tl.constexpr,
    DROPOUT: tl.constexpr,
    COUNT: tl.constexpr,
    INTERP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One block of BLOCK_N keys: loop over the query blocks, accumulate dK and dV.

    Works in the transposed orientation ([keys, queries]) so no [BM, BN] tile is transposed.
    """
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    c0 = pid_n * BLOCK_N
    c_last = tl.minimum(c0 + BLOCK_N, seqlen_k) - 1
    offs_n = c0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < seqlen_k
    d_ok = offs_d < head_dim
    kv_mask = col_ok[:, None] & d_ok[None, :]
    q_base = b.to(tl.int64) * stride_qb + h * stride_qh
    do_base = b.to(tl.int64) * stride_dob + h * stride_doh
    l_base = b.to(tl.int64) * stride_lb + h
    bnd_base = b.to(tl.int64) * stride_bb + h * stride_bh
    mm_base = b.to(tl.int64) * stride_mmb + h * stride_mmh
    k = tl.load(
        K + b.to(tl.int64) * stride_kb + h * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V + b.to(tl.int64) * stride_vb + h * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if INTERP:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    col_out = (offs_n >= seqlen_k)[:, None]  # [BN, 1]
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    zero = pid_n * 0
    m_start = zero
    if CAUSAL:  # query blocks above the diagonal are masked by causality alone
        m_start = zero + c0 // BLOCK_M
    n_skip = m_start
    n_part = zero
    n_full = zero
    n_check = zero
    for mb in range(m_start, tl.cdiv(seqlen_q, BLOCK_M)):
        r0 = mb * BLOCK_M
        r_end = tl.minimum(r0 + BLOCK_M, seqlen_q)
        skip, unmasked = _classify(BMM, mm_base, pid_n, stride_mmn, r0, r_end, c0, c_last, CAUSAL, N_BOUNDS)
        qi = r0 + offs_m
        row_ok = qi < seqlen_q
        row0 = b * seqlen_q + r0
        invalid_t = tl.broadcast_to(col_out, [BLOCK_N, BLOCK_M])  # out of range, so far
        if skip:
            if COUNT:
                n_skip += 1
        elif not unmasked:  # the bounds' min/max cannot tell: look at the element mask
            lts, lte, uts, ute = _load_bounds(BND, bnd_base, offs_n, col_ok, stride_bj, seqlen_q, CAUSAL, N_BOUNDS)
            masked_t = _element_mask_t(qi, offs_n, lts, lte, uts, ute, CAUSAL)  # [BN, BM]
            all_masked, none_masked = _refine(
                masked_t, col_ok[:, None] & row_ok[None, :], (r_end - r0) * (c_last + 1 - c0)
            )
            invalid_t = invalid_t | masked_t
            skip = all_masked
            unmasked = none_masked
            if COUNT:
                n_check += 1
                if all_masked:
                    n_skip += 1
        if not skip:
            dk, dv = _dkdv_step(
                k,
                v,
                Q,
                DO,
                LSE,
                DELTA,
                q_base,
                do_base,
                l_base,
                qi,
                row_ok,
                d_ok,
                offs_d,
                stride_qs,
                stride_dos,
                stride_ls,
                invalid_t,
                dk,
                dv,
                qk_scale,
                p_drop,
                seed,
                offset,
                row0,
                c0,
                h,
                DROPOUT,
                INTERP,
                DOT_PRECISION,
                BLOCK_M,
                BLOCK_N,
            )
            if COUNT:
                if unmasked:
                    n_full += 1
                else:
                    n_part += 1
    if DROPOUT:
        dv = dv * (1.0 / (1.0 - p_drop))
        dk = dk * (sm_scale / (1.0 - p_drop))
    else:
        dk = dk * sm_scale
    if seqlen_k == 1:  # one key: zero score gradient, exactly (see the varlen _attn_bwd_dq)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    tl.store(
        DK + b.to(tl.int64) * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
        _cast(dk, DK.dtype.element_ty, INTERP),
        mask=kv_mask,
    )
    tl.store(
        DV + b.to(tl.int64) * stride_dvb + h * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :],
        _cast(dv, DV.dtype.element_ty, INTERP),
        mask=kv_mask,
    )
    if COUNT:
        _store_counts(CNT, bh * tl.num_programs(0) + pid_n, n_skip, n_part, n_full, n_check)


@triton.jit
def _dq_step(
    q,
    do,
    lse,
    delta,
    K,
    V,
    k_base,
    v_base,
    cols,
    kv_mask,
    offs_d,
    stride_ks,
    stride_vs,
    invalid,
    dq,
    qk_scale,
    p_drop,
    seed,
    offset,
    row0,
    c0,
    h,
    DROPOUT: tl.constexpr,
    INTERP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One key block's contribution to dQ; ``invalid`` ([BM, BN] or [1, BN]) is what to mask."""
    k = tl.load(K + k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
    if INTERP:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    p = tl.where(invalid, 0.0, tl.exp2(s - lse[:, None]))
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if DROPOUT:
        keep = _keep(seed, offset, row0, c0, h, p_drop, BLOCK_M, BLOCK_N)
        dp = tl.where(keep, dp, 0.0)  # unscaled; delta arrives times (1-p), dQ is scaled after
    ds = p * (dp - delta[:, None])
    ds_lo = _cast(ds, K.dtype.element_ty, INTERP)
    if INTERP:
        ds_lo = ds_lo.to(tl.float32)
    return dq + tl.dot(ds_lo, k, input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "heads", "seed", "offset"])
def _fm_bwd_dq(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    BND,
    BMM,
    CNT,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_lb,
    stride_ls,
    stride_bb,
    stride_bh,
    stride_bj,
    stride_mmb,
    stride_mmh,
    stride_mmn,
    seqlen_q,
    seqlen_k,
    heads,
    head_dim,
    qk_scale,
    sm_scale,
    p_drop,
    seed,
    offset,
    CAUSAL: tl.constexpr,
    N_BOUNDS: tl.constexpr,
    DROPOUT: tl.constexpr,
    COUNT: tl.constexpr,
    INTERP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One block of BLOCK_M queries: loop over the key blocks, accumulate dQ (a separate pass
    from dK/dV, recomputing the scores, so no atomics are needed and gradients are deterministic)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    r0 = pid_m * BLOCK_M
    r_end = tl.minimum(r0 + BLOCK_M, seqlen_q)
    offs_m = r0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    d_ok = offs_d < head_dim
    q_mask = row_ok[:, None] & d_ok[None, :]
    k_base = b.to(tl.int64) * stride_kb + h * stride_kh
    v_base = b.to(tl.int64) * stride_vb + h * stride_vh
    l_base = b.to(tl.int64) * stride_lb + h
    bnd_base = b.to(tl.int64) * stride_bb + h * stride_bh
    mm_base = b.to(tl.int64) * stride_mmb + h * stride_mmh
    row0 = b * seqlen_q + r0
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )
    do = tl.load(
        DO + b.to(tl.int64) * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )
    lse = tl.load(LSE + l_base + offs_m * stride_ls, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + l_base + offs_m * stride_ls, mask=row_ok, other=0.0)
    if INTERP:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    if DROPOUT:
        delta = delta * (1.0 - p_drop)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_blocks = tl.cdiv(seqlen_k, BLOCK_N)
    n_end = n_blocks
    if CAUSAL:
        n_end = tl.minimum(n_blocks, tl.cdiv(r_end, BLOCK_N))
    zero = pid_m * 0
    n_skip = zero + (n_blocks - n_end)
    n_part = zero
    n_full = zero
    n_check = zero
    for nb in range(0, n_end):
        c0 = nb * BLOCK_N
        c_last = tl.minimum(c0 + BLOCK_N, seqlen_k) - 1
        skip, unmasked = _classify(BMM, mm_base, nb, stride_mmn, r0, r_end, c0, c_last, CAUSAL, N_BOUNDS)
        cols = c0 + offs_n
        col_ok = cols < seqlen_k
        kv_mask = col_ok[:, None] & d_ok[None, :]
        invalid = tl.broadcast_to((cols >= seqlen_k)[None, :], [BLOCK_M, BLOCK_N])  # out of range, so far
        if skip:
            if COUNT:
                n_skip += 1
        elif not unmasked:  # the bounds' min/max cannot tell: look at the element mask
            lts, lte, uts, ute = _load_bounds(BND, bnd_base, cols, col_ok, stride_bj, seqlen_q, CAUSAL, N_BOUNDS)
            masked = _element_mask(offs_m, cols, lts, lte, uts, ute, CAUSAL)
            all_masked, none_masked = _refine(
                masked, row_ok[:, None] & col_ok[None, :], (r_end - r0) * (c_last + 1 - c0)
            )
            invalid = invalid | masked
            skip = all_masked
            unmasked = none_masked
            if COUNT:
                n_check += 1
                if all_masked:
                    n_skip += 1
        if not skip:
            dq = _dq_step(
                q,
                do,
                lse,
                delta,
                K,
                V,
                k_base,
                v_base,
                cols,
                kv_mask,
                offs_d,
                stride_ks,
                stride_vs,
                invalid,
                dq,
                qk_scale,
                p_drop,
                seed,
                offset,
                row0,
                c0,
                h,
                DROPOUT,
                INTERP,
                DOT_PRECISION,
                BLOCK_M,
                BLOCK_N,
            )
            if COUNT:
                if unmasked:
                    n_full += 1
                else:
                    n_part += 1
    if DROPOUT:
        dq = dq * (sm_scale / (1.0 - p_drop))
    else:
        dq = dq * sm_scale
    if seqlen_k == 1:  # one key: zero score gradient, exactly (see the varlen _attn_bwd_dq)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    tl.store(
        DQ + b.to(tl.int64) * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
        _cast(dq, DQ.dtype.element_ty, INTERP),
        mask=q_mask,
    )
    if COUNT:
        _store_counts(CNT, bh * tl.num_programs(0) + pid_m, n_skip, n_part, n_full, n_check)


# ---------------------------------------------------------------------------------------
# Host-side launchers. The tile sizes come from ``kernels.flashmask.tile_sizes``: one key-block
# size BLOCK_N serves all three kernels, so the per-block min/max of the bounds is computed
# once per call and read by the forward and the backward.


def _cdiv(a, b):
    return (a + b - 1) // b


def _launch(kernel, grid, *args, **kwargs):
    """Every launch goes through here (the compile check swaps it to compile without a GPU)."""
    kernel[grid](*args, **kwargs)


def _launch_opts(num_warps, num_stages):
    return {} if INTERPRET else {"num_warps": num_warps, "num_stages": num_stages}


def _common(q):
    block_d = max(16, triton.next_power_of_2(q.shape[-1]))
    return block_d, BASE.dot_precision(q)


def _bound_strides(bounds, block_minmax):
    hb = bounds.shape[1] > 1  # per-head bounds, else broadcast over heads (stride 0)
    return (
        bounds.stride(0),
        bounds.stride(1) if hb else 0,
        bounds.stride(2),
        block_minmax.stride(0),
        block_minmax.stride(1) if hb else 0,
        block_minmax.stride(2),
    )


def _grid_check(batch, heads):
    if batch * heads > 65535:
        raise ValueError(f"flashmask launch: batch {batch} x heads {heads} exceeds CUDA's grid limit 65535")


def fwd(q, k, v, out, lse, bounds, block_minmax, causal, softmax_scale, p_drop, seed, offset, tiles, counts=None):
    """Forward launch. q, out [B, Sq, H, D]; k, v [B, Sk, H, D]; lse [B, Sq, H] fp32 (written);
    tiles = {kernel: (BLOCK_M, BLOCK_N, warps, stages)}; counts: optional int32 tensor of
    [B*H*cdiv(Sq, BLOCK_M), 4] (debug: skipped, partial, unmasked, checked per program)."""
    batch, sq, heads, dim = q.shape
    _grid_check(batch, heads)
    block_d, precision = _common(q)
    bm, bn, warps, stages = tiles["fwd"]
    _launch(
        _fm_fwd,
        (_cdiv(sq, bm), batch * heads),
        q,
        k,
        v,
        out,
        lse,
        bounds,
        block_minmax,
        lse if counts is None else counts,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        lse.stride(0),
        lse.stride(1),
        *_bound_strides(bounds, block_minmax),
        sq,
        k.shape[1],
        heads,
        dim,
        softmax_scale * LOG2E,
        p_drop,
        seed,
        offset,
        CAUSAL=causal,
        N_BOUNDS=bounds.shape[-1],
        DROPOUT=p_drop > 0,
        COUNT=counts is not None,
        INTERP=INTERPRET,
        DOT_PRECISION=precision,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=block_d,
        **_launch_opts(warps, stages),
    )


def bwd(
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
    block_minmax,
    causal,
    softmax_scale,
    p_drop,
    seed,
    offset,
    tiles,
    counts_dkdv=None,
    counts_dq=None,
):
    """The backward launches (dK/dV, then dQ). dout, dq like q; dk, dv like k; lse, delta
    [B, Sq, H] fp32; counts_*: optional debug outputs as for ``fwd``."""
    batch, sq, heads, dim = q.shape
    sk = k.shape[1]
    _grid_check(batch, heads)
    block_d, precision = _common(q)
    common = dict(
        CAUSAL=causal,
        N_BOUNDS=bounds.shape[-1],
        DROPOUT=p_drop > 0,
        INTERP=INTERPRET,
        DOT_PRECISION=precision,
        BLOCK_D=block_d,
    )
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    tail = (
        lse.stride(0),
        lse.stride(1),
        *_bound_strides(bounds, block_minmax),
        sq,
        sk,
        heads,
        dim,
        softmax_scale * LOG2E,
        softmax_scale,
        p_drop,
        seed,
        offset,
    )
    bm, bn, warps, stages = tiles["dkdv"]
    _launch(
        _fm_bwd_dkdv,
        (_cdiv(sk, bn), batch * heads),
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dk,
        dv,
        bounds,
        block_minmax,
        lse if counts_dkdv is None else counts_dkdv,
        *strides,
        *dk.stride()[:3],
        *dv.stride()[:3],
        *tail,
        COUNT=counts_dkdv is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        **common,
        **_launch_opts(warps, stages),
    )
    bm, bn, warps, stages = tiles["dq"]
    _launch(
        _fm_bwd_dq,
        (_cdiv(sq, bm), batch * heads),
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dq,
        bounds,
        block_minmax,
        lse if counts_dq is None else counts_dq,
        *strides,
        *dq.stride()[:3],
        *tail,
        COUNT=counts_dq is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        **common,
        **_launch_opts(warps, stages),
    )
