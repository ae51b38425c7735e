"""Triton device code: varlen attention (forward, backward) and the fused elementwise ops.

Do not import this module directly: ``kernels.runtime.jit_kernels(device)`` loads it in the
mode Triton itself was imported in (compiled for CUDA, or interpreted on CPU with
TRITON_INTERPRET=1) and returns the module. The host-side
launchers at the bottom are the only callers of the kernels; they know the argument lists
and the block sizes.

Attention layout (flash-attention's "unpadded" one): q, k, v, o are ``[T, H, D]`` with any
token and head strides (head dim contiguous), sequence b is tokens
``cu_seqlens[b]:cu_seqlens[b+1]``. A program handles one block of rows of one (sequence,
head); a launch covers the sequences ``order[order_start : order_start + grid[1]]`` (or
order_start .. order_start + grid[1] - 1 without an order), which is how grouped dispatch launches one length bucket
without copying the batch. ``lse`` is the softmax's log-sum-exp per (token, head), in base 2.

Backward with dropout, as FlashAttention-2: with keep mask Z and P~ = P o Z / (1-p), the
loops use the unscaled P o Z and dP o Z with delta_i * (1-p) (delta_i = rowsum(dO o O)), so
every tile is (1-p) times its exact value, and dQ, dK, dV are scaled by 1/(1-p) once, in
fp32, after the loop: the low-precision casts of P and dS inside the loop see no extra
rounding from the scale.

Dropout: the keep decision for (query token t, key j of its sequence, head h) is output
j % 4 of ``philox(seed; t, j // 4, h, offset)``, as a uniform float, ``>= p``. It depends on
nothing else (not the block sizes, not the grouping), so the backward regenerates the
forward's mask exactly and a grouped launch drops the same entries as a single one.
"""

import os

import triton
import triton.language as tl

from kernels import tiles

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # set by kernels.runtime before loading
LOG2E = 1.4426950408889634  # the kernels work in base 2 (exp2, log2)


@triton.jit
def _keep(seed, offset, row0, col0, head, p_drop, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Dropout keep mask [BLOCK_R, BLOCK_C] for query tokens row0 + i and keys col0 + j.

    One Philox call gives four numbers, used for four adjacent keys: key 4q + c of token t
    and head h takes output c of philox(seed; t, q, h, offset). col0 must be a multiple of 4.
    """
    rows = row0 + tl.arange(0, BLOCK_R)[:, None]
    quads = col0 // 4 + tl.arange(0, BLOCK_C // 4)[None, :]
    zero = rows * 0 + quads * 0
    r0, r1, r2, r3 = tl.philox(seed, rows + zero, quads + zero, zero + head, zero + offset)
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK_R, BLOCK_C])  # key 4q + c <- r_c
    return tl.uint_to_uniform_float(r) >= p_drop


@triton.jit
def _cast(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """x (fp32) -> dtype, rounding to nearest even.

    The interpreter truncates fp32 -> bf16; round the fp32 bits first so that it matches a GPU.
    """
    if INTERP:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _seq_bounds(CU, ORDER, order_start, pid_b, HAS_ORDER: tl.constexpr):
    # A launch covers entries order_start .. order_start + grid[1] - 1 of the order (the
    # identity order when HAS_ORDER is false: a grouped plan whose batch is already in bucket
    # order still launches each group from its own start).
    if HAS_ORDER:
        seq = tl.load(ORDER + order_start + pid_b)
    else:
        seq = order_start + pid_b
    start = tl.load(CU + seq)
    end = tl.load(CU + seq + 1)
    return seq, start, end - start


@triton.jit(do_not_specialize=["order_start", "seed", "offset"])
def _attn_fwd(
    Q,
    K,
    V,
    O,
    LSE,
    KEEP,
    CU,
    ORDER,
    order_start,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    head_dim,
    keep_max,
    qk_scale,
    p_drop,
    seed,
    offset,
    HAS_ORDER: tl.constexpr,
    DROPOUT: tl.constexpr,
    STORE_KEEP: tl.constexpr,
    INTERP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    head = tl.program_id(2)
    seq, start, seqlen = _seq_bounds(CU, ORDER, order_start, pid_b, HAS_ORDER)
    if pid_m * BLOCK_M >= seqlen:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen
    d_ok = offs_d < head_dim
    rows = (start + offs_m).to(tl.int64)

    q = tl.load(
        Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if INTERP:  # the interpreter has no bf16 arithmetic: multiply the same values in fp32
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, seqlen, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < seqlen
        kv_rows = (start + cols).to(tl.int64)
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv_rows[:, None] * stride_kt + head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_rows[:, None] * stride_vt + head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if INTERP:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BM, BN], base-2 logits
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = _keep(seed, offset, start + pid_m * BLOCK_M, n0, head, p_drop, BLOCK_M, BLOCK_N)
            if STORE_KEEP:  # debug: report the mask, [B, H, S, S] with S = keep_max
                base = (seq * tl.num_programs(2) + head).to(tl.int64) * keep_max * keep_max
                tl.store(
                    KEEP + base + offs_m[:, None] * keep_max + cols[None, :],
                    keep.to(tl.int8),
                    mask=row_ok[:, None] & col_ok[None, :],
                )
            p = tl.where(keep, p, 0.0)
        pv = _cast(p, V.dtype.element_ty, INTERP)
        if INTERP:
            pv = pv.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PRECISION)
        m_i = m_new
    if DROPOUT:
        acc = acc / (l_i[:, None] * (1.0 - p_drop))
    else:
        acc = acc / l_i[:, None]
    tl.store(
        O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        _cast(acc, O.dtype.element_ty, INTERP),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(LSE + rows * stride_lt + head, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit(do_not_specialize=["order_start", "seed", "offset"])
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    CU,
    ORDER,
    order_start,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    stride_lt,
    head_dim,
    qk_scale,
    sm_scale,
    p_drop,
    seed,
    offset,
    HAS_ORDER: tl.constexpr,
    DROPOUT: tl.constexpr,
    INTERP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One block of BLOCK_N keys: loop over the sequence's queries, accumulate dK and dV.

    Works in the transposed orientation ([keys, queries]) so no [BM, BN] tile is transposed.
    """
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    head = tl.program_id(2)
    seq, start, seqlen = _seq_bounds(CU, ORDER, order_start, pid_b, HAS_ORDER)
    if pid_n * BLOCK_N >= seqlen:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < seqlen
    d_ok = offs_d < head_dim
    kv_rows = (start + offs_n).to(tl.int64)
    kv_mask = col_ok[:, None] & d_ok[None, :]
    k = tl.load(K + kv_rows[:, None] * stride_kt + head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + kv_rows[:, None] * stride_vt + head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    if INTERP:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for m0 in range(0, seqlen, BLOCK_M):
        qi = m0 + offs_m
        row_ok = qi < seqlen
        rows = (start + qi).to(tl.int64)
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
        do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=q_mask, other=0.0)
        lse = tl.load(LSE + rows * stride_lt + head, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + rows * stride_lt + head, mask=row_ok, other=0.0)
        if INTERP:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # [BN, BM]
        p_t = tl.exp2(s_t - lse[None, :])
        p_t = tl.where(col_ok[:, None] & row_ok[None, :], p_t, 0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BN, BM]
        if DROPOUT:  # unscaled: 1/(1-p) is applied to dK, dV after the loop
            keep_t = tl.trans(_keep(seed, offset, start + m0, pid_n * BLOCK_N, head, p_drop, BLOCK_M, BLOCK_N))
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
    if DROPOUT:
        dv = dv * (1.0 / (1.0 - p_drop))
        dk = dk * (sm_scale / (1.0 - p_drop))
    else:
        dk = dk * sm_scale
    if seqlen == 1:  # see _attn_bwd_dq
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    tl.store(
        DK + kv_rows[:, None] * stride_dkt + head * stride_dkh + offs_d[None, :],
        _cast(dk, DK.dtype.element_ty, INTERP),
        mask=kv_mask,
    )
    tl.store(
        DV + kv_rows[:, None] * stride_dvt + head * stride_dvh + offs_d[None, :],
        _cast(dv, DV.dtype.element_ty, INTERP),
        mask=kv_mask,
    )


@triton.jit(do_not_specialize=["order_start", "seed", "offset"])
def _attn_bwd_dq(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    CU,
    ORDER,
    order_start,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_lt,
    head_dim,
    qk_scale,
    sm_scale,
    p_drop,
    seed,
    offset,
    HAS_ORDER: tl.constexpr,
    DROPOUT: tl.constexpr,
    INTERP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One block of BLOCK_M queries: loop over the sequence's keys, accumulate dQ.

    A separate pass from dK/dV (recomputing the scores) so that no atomics are needed and the
    gradients are deterministic.
    """
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    head = tl.program_id(2)
    seq, start, seqlen = _seq_bounds(CU, ORDER, order_start, pid_b, HAS_ORDER)
    if pid_m * BLOCK_M >= seqlen:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen
    d_ok = offs_d < head_dim
    rows = (start + offs_m).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + rows * stride_lt + head, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + rows * stride_lt + head, mask=row_ok, other=0.0)
    if INTERP:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    if DROPOUT:
        delta = delta * (1.0 - p_drop)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, seqlen, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < seqlen
        kv_rows = (start + cols).to(tl.int64)
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv_rows[:, None] * stride_kt + head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_rows[:, None] * stride_vt + head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if INTERP:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.exp2(s - lse[:, None])
        p = tl.where(row_ok[:, None] & col_ok[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:  # unscaled: 1/(1-p) is applied to dQ after the loop
            keep = _keep(seed, offset, start + pid_m * BLOCK_M, n0, head, p_drop, BLOCK_M, BLOCK_N)
            dp = tl.where(keep, dp, 0.0)
        ds = p * (dp - delta[:, None])
        ds_lo = _cast(ds, K.dtype.element_ty, INTERP)
        if INTERP:
            ds_lo = ds_lo.to(tl.float32)
        dq += tl.dot(ds_lo, k, input_precision=DOT_PRECISION)
    if DROPOUT:
        dq = dq * (sm_scale / (1.0 - p_drop))
    else:
        dq = dq * sm_scale
    if seqlen == 1:
        # One key: the softmax is constant, so the score gets exactly zero gradient. The
        # formula's delta comes from the rounded output and would leave a rounding residue
        # (with dropout, O = V / (1-p) is not exact in fp16/bf16).
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    tl.store(
        DQ + rows[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :],
        _cast(dq, DQ.dtype.element_ty, INTERP),
        mask=q_mask,
    )


# ---------------------------------------------------------------------------------------
# Fused elementwise ops. Rows of N features, contiguous; math in fp32.


@triton.jit
def _gelu_parts(z):
    """erf GELU of z and its derivative."""
    cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
    pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
    return z * cdf, cdf + z * pdf


@triton.jit
def _bias_gelu_fwd(X, B, Y, n_rows, n_cols, INTERP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    idx = r.to(tl.int64)[:, None] * n_cols + c[None, :]
    z = (
        tl.load(X + idx, mask=mask, other=0.0).to(tl.float32)
        + tl.load(B + c, mask=c < n_cols, other=0.0).to(tl.float32)[None, :]
    )
    y, _ = _gelu_parts(z)
    tl.store(Y + idx, _cast(y, Y.dtype.element_ty, INTERP), mask=mask)


@triton.jit
def _bias_gelu_bwd(DY, X, B, DX, n_rows, n_cols, INTERP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    idx = r.to(tl.int64)[:, None] * n_cols + c[None, :]
    z = (
        tl.load(X + idx, mask=mask, other=0.0).to(tl.float32)
        + tl.load(B + c, mask=c < n_cols, other=0.0).to(tl.float32)[None, :]
    )
    _, dgelu = _gelu_parts(z)
    dy = tl.load(DY + idx, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + idx, _cast(dy * dgelu, DX.dtype.element_ty, INTERP), mask=mask)


@triton.jit(do_not_specialize=["seed", "offset"])
def _bdaln_fwd(
    X,
    B,
    R,
    W,
    LB,
    Y,
    H,
    MEAN,
    RSTD,
    KEEP,
    n_rows,
    n_cols,
    eps,
    p_drop,
    seed,
    offset,
    DROPOUT: tl.constexpr,
    STORE_KEEP: tl.constexpr,
    INTERP: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Row-wise: h = residual + dropout(x + bias); y = LayerNorm(h) * weight + ln_bias."""
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < n_cols
    idx = row.to(tl.int64) * n_cols + c
    z = tl.load(X + idx, mask=c_ok, other=0.0).to(tl.float32) + tl.load(B + c, mask=c_ok, other=0.0).to(tl.float32)
    if DROPOUT:
        keep = tl.reshape(_keep(seed, offset, row, 0, 0, p_drop, 1, BLOCK_C), [BLOCK_C])
        if STORE_KEEP:
            tl.store(KEEP + idx, keep.to(tl.int8), mask=c_ok)
        z = tl.where(keep, z / (1.0 - p_drop), 0.0)
    h = z + tl.load(R + idx, mask=c_ok, other=0.0).to(tl.float32)
    h_lo = _cast(h, H.dtype.element_ty, INTERP)
    tl.store(H + idx, h_lo, mask=c_ok)
    h = h_lo.to(tl.float32)  # normalise exactly what the backward will read back
    mean = tl.sum(tl.where(c_ok, h, 0.0), 0) / n_cols
    diff = tl.where(c_ok, h - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, 0) / n_cols + eps)
    w = tl.load(W + c, mask=c_ok, other=0.0).to(tl.float32)
    lb = tl.load(LB + c, mask=c_ok, other=0.0).to(tl.float32)
    tl.store(Y + idx, _cast(diff * rstd * w + lb, Y.dtype.element_ty, INTERP), mask=c_ok)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit(do_not_specialize=["seed", "offset"])
def _bdaln_bwd(
    DY,
    H,
    W,
    MEAN,
    RSTD,
    DX,
    DRES,
    DW_PART,
    DLB_PART,
    DB_PART,
    n_rows,
    n_cols,
    rows_per_prog,
    p_drop,
    seed,
    offset,
    DROPOUT: tl.constexpr,
    INTERP: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Gradients of the fused op for rows_per_prog rows; per-program partial sums (fp32) of the
    gradients of weight, ln_bias and bias."""
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < n_cols
    w = tl.load(W + c, mask=c_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_C], tl.float32)
    dlb = tl.zeros([BLOCK_C], tl.float32)
    db = tl.zeros([BLOCK_C], tl.float32)
    row0 = pid * rows_per_prog
    for i in range(0, rows_per_prog):
        row = row0 + i
        if row < n_rows:
            idx = row.to(tl.int64) * n_cols + c
            h = tl.load(H + idx, mask=c_ok, other=0.0).to(tl.float32)
            dy = tl.load(DY + idx, mask=c_ok, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + row)
            rstd = tl.load(RSTD + row)
            xhat = tl.where(c_ok, (h - mean) * rstd, 0.0)
            wdy = w * dy
            dw += dy * xhat
            dlb += dy
            c1 = tl.sum(xhat * wdy, 0) / n_cols
            c2 = tl.sum(wdy, 0) / n_cols
            dh = (wdy - (xhat * c1 + c2)) * rstd
            tl.store(DRES + idx, _cast(dh, DRES.dtype.element_ty, INTERP), mask=c_ok)
            if DROPOUT:
                keep = tl.reshape(_keep(seed, offset, row, 0, 0, p_drop, 1, BLOCK_C), [BLOCK_C])
                dh = tl.where(keep, dh / (1.0 - p_drop), 0.0)
            db += dh
            tl.store(DX + idx, _cast(dh, DX.dtype.element_ty, INTERP), mask=c_ok)
    tl.store(DW_PART + pid.to(tl.int64) * n_cols + c, dw, mask=c_ok)
    tl.store(DLB_PART + pid.to(tl.int64) * n_cols + c, dlb, mask=c_ok)
    tl.store(DB_PART + pid.to(tl.int64) * n_cols + c, db, mask=c_ok)


# ---------------------------------------------------------------------------------------
# Host-side launchers. Block sizes: the interpreter gets small, unequal blocks (so that tests
# cross block edges both ways); a GPU gets ``kernels.tiles``' table, per (dtype, head dim,
# dropout), every entry free of register spills on sm_90 (kernels/compile_check.py builds
# them all), in the preset KERNELS_ATTENTION_TILES names (read when this module loads; the
# compile check sets TILE_PRESET directly).

TILE_PRESET = tiles.preset_from_env()


def _cdiv(a, b):
    return (a + b - 1) // b


def _launch(kernel, grid, *args, **kwargs):
    """Every launch goes through here (tests swap it to compile for a GPU without one)."""
    kernel[grid](*args, **kwargs)


def _launch_opts(num_warps, num_stages):
    return {} if INTERPRET else {"num_warps": num_warps, "num_stages": num_stages}


def attention_blocks(kernel, block_d, elt_size, dropout=False):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for kernel in {'fwd', 'dkdv', 'dq'}."""
    if INTERPRET:
        return {"fwd": (32, 64, 1, 1), "dkdv": (32, 64, 1, 1), "dq": (64, 32, 1, 1)}[kernel]
    return tiles.attention_tiles(kernel, block_d, elt_size, dropout, TILE_PRESET)


def dot_precision(q):
    """``tl.dot``'s input precision for q's dtype: fp16/bf16 multiply natively; fp32 uses TF32
    tensor cores exactly when ``torch.backends.cuda.matmul.allow_tf32`` is set (as torch's own
    fp32 matmuls do), else full-precision fp32 ("ieee"). Read at each launch."""
    import torch

    if q.element_size() != 4:
        return "tf32"  # unused for 16-bit inputs
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _attn_common(q):
    block_d = max(16, triton.next_power_of_2(q.shape[-1]))
    return block_d, dot_precision(q)


def _check_grid(n_seqs, heads):
    if n_seqs > 65535 or heads > 65535:
        raise ValueError(f"attention launch: {n_seqs} sequences x {heads} heads exceeds CUDA's grid limit 65535")


def attn_fwd(
    q, k, v, out, lse, cu_seqlens, order, order_start, n_seqs, max_len, softmax_scale, p_drop, seed, offset, keep=None
):
    """One forward launch over n_seqs sequences (order[order_start:] or 0..n_seqs-1).

    q, k, v, out: [T, H, D]; lse: [T, H] fp32 (written); keep: optional [B, H, S, S] int8
    debug output of the dropout mask (S = keep.shape[-1]).
    """
    heads = q.shape[1]
    _check_grid(n_seqs, heads)
    block_d, precision = _attn_common(q)
    bm, bn, warps, stages = attention_blocks("fwd", block_d, q.element_size(), p_drop > 0)
    _launch(
        _attn_fwd,
        (_cdiv(max_len, bm), n_seqs, heads),
        q,
        k,
        v,
        out,
        lse,
        out if keep is None else keep,
        cu_seqlens,
        cu_seqlens if order is None else order,
        order_start,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        q.shape[2],
        0 if keep is None else keep.shape[-1],
        softmax_scale * LOG2E,
        p_drop,
        seed,
        offset,
        HAS_ORDER=order is not None,
        DROPOUT=p_drop > 0,
        STORE_KEEP=keep is not None,
        INTERP=INTERPRET,
        DOT_PRECISION=precision,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=block_d,
        **_launch_opts(warps, stages),
    )


def attn_bwd(
    dout,
    q,
    k,
    v,
    lse,
    delta,
    dq,
    dk,
    dv,
    cu_seqlens,
    order,
    order_start,
    n_seqs,
    max_len,
    softmax_scale,
    p_drop,
    seed,
    offset,
):
    """The backward launches (dK/dV, then dQ) over the same sequences as attn_fwd.

    dout: [T, H, D]; lse, delta: [T, H] fp32; dq, dk, dv: [T, H, D] (written).
    """
    heads = q.shape[1]
    _check_grid(n_seqs, heads)
    block_d, precision = _attn_common(q)
    common = dict(
        HAS_ORDER=order is not None, DROPOUT=p_drop > 0, INTERP=INTERPRET, DOT_PRECISION=precision, BLOCK_D=block_d
    )
    order_arg = cu_seqlens if order is None else order
    strides = (
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        dout.stride(0),
        dout.stride(1),
    )
    tail = (lse.stride(0), q.shape[2], softmax_scale * LOG2E, softmax_scale, p_drop, seed, offset)
    bm, bn, warps, stages = attention_blocks("dkdv", block_d, q.element_size(), p_drop > 0)
    _launch(
        _attn_bwd_dkdv,
        (_cdiv(max_len, bn), n_seqs, heads),
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dk,
        dv,
        cu_seqlens,
        order_arg,
        order_start,
        *strides,
        dk.stride(0),
        dk.stride(1),
        dv.stride(0),
        dv.stride(1),
        *tail,
        BLOCK_M=bm,
        BLOCK_N=bn,
        **common,
        **_launch_opts(warps, stages),
    )
    bm, bn, warps, stages = attention_blocks("dq", block_d, q.element_size(), p_drop > 0)
    _launch(
        _attn_bwd_dq,
        (_cdiv(max_len, bm), n_seqs, heads),
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dq,
        cu_seqlens,
        order_arg,
        order_start,
        *strides,
        dq.stride(0),
        dq.stride(1),
        *tail,
        BLOCK_M=bm,
        BLOCK_N=bn,
        **common,
        **_launch_opts(warps, stages),
    )


def _eltwise_grid(n_rows, n_cols):
    block_c = min(triton.next_power_of_2(n_cols), 1024)
    block_r = max(1, 4096 // block_c)
    return (_cdiv(n_rows, block_r), _cdiv(n_cols, block_c)), dict(BLOCK_R=block_r, BLOCK_C=block_c)


def bias_gelu_fwd(x, bias, y):
    """y = gelu(x + bias) for x, y [R, N] contiguous, bias [N]."""
    grid, blocks = _eltwise_grid(*x.shape)
    _launch(_bias_gelu_fwd, grid, x, bias, y, *x.shape, INTERP=INTERPRET, **blocks, **_launch_opts(4, 1))


def bias_gelu_bwd(dy, x, bias, dx):
    """dx = dy * gelu'(x + bias), all [R, N] contiguous."""
    grid, blocks = _eltwise_grid(*x.shape)
    _launch(_bias_gelu_bwd, grid, dy, x, bias, dx, *x.shape, INTERP=INTERPRET, **blocks, **_launch_opts(4, 1))


def _row_opts(block_c):
    return _launch_opts(max(1, min(16, block_c // 256)), 1)


def bdaln_fwd(x, bias, residual, weight, ln_bias, y, h, mean, rstd, eps, p_drop, seed, offset, keep=None):
    """Bias + dropout + residual + LayerNorm over rows of x [R, N] (all contiguous).

    Writes y and h = residual + dropout(x + bias) [R, N], mean and rstd [R] fp32, and with
    keep ([R, N] int8) the dropout mask.
    """
    r, n = x.shape
    block_c = triton.next_power_of_2(n)
    _launch(
        _bdaln_fwd,
        (r,),
        x,
        bias,
        residual,
        weight,
        ln_bias,
        y,
        h,
        mean,
        rstd,
        y if keep is None else keep,
        r,
        n,
        eps,
        p_drop,
        seed,
        offset,
        DROPOUT=p_drop > 0,
        STORE_KEEP=keep is not None,
        INTERP=INTERPRET,
        BLOCK_C=block_c,
        **_row_opts(block_c),
    )


def bdaln_bwd(dy, h, weight, mean, rstd, dx, dres, p_drop, seed, offset):
    """Backward of bdaln_fwd: writes dx, dres [R, N]; returns the partial sums of dweight,
    dln_bias and dbias, [programs, N] fp32 each (the caller sums over programs)."""
    import torch

    r, n = dy.shape
    rows_per_prog = _cdiv(r, 8 if INTERPRET else 1024)  # up to 1024 programs: enough to fill a GPU
    programs = _cdiv(r, rows_per_prog)
    dw = torch.empty(programs, n, dtype=torch.float32, device=dy.device)
    dlb = torch.empty(programs, n, dtype=torch.float32, device=dy.device)
    db = torch.empty(programs, n, dtype=torch.float32, device=dy.device)
    block_c = triton.next_power_of_2(n)
    _launch(
        _bdaln_bwd,
        (programs,),
        dy,
        h,
        weight,
        mean,
        rstd,
        dx,
        dres,
        dw,
        dlb,
        db,
        r,
        n,
        rows_per_prog,
        p_drop,
        seed,
        offset,
        DROPOUT=p_drop > 0,
        INTERP=INTERPRET,
        BLOCK_C=block_c,
        **_row_opts(block_c),
    )
    return dw, dlb, db
