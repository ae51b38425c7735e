"""Triton device code of the fused elementwise ops (``kernels.ops.fused``), with their launchers.

Do not import this module directly: ``kernels.ops.fused`` loads it through
``kernels.runtime.jit_kernels`` in the mode Triton itself was imported in. Rows of N features,
contiguous; math in fp32. The dropout keep mask and the rounding cast are the attention
family's (``kernels/triton_jit.py``), so every kernel draws dropout the same way.
"""

import os

import torch
import triton
import triton.language as tl

from kernels.runtime import device_code

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # set by kernels.runtime before loading
_shared = device_code(INTERPRET)
_keep, _cast, _launch_opts = _shared._keep, _shared._cast, _shared._launch_opts


@triton.jit
def _gelu_parts(z):
    """erf GELU of z and its derivative."""
    cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
    pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
    return z * cdf, cdf + z * pdf


@triton.jit
def _bias_gelu_input(X, B, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's block of x + bias (fp32), its element offsets and mask."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    idx = r.to(tl.int64)[:, None] * n_cols + c[None, :]
    x = tl.load(X + idx, mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(B + c, mask=c < n_cols, other=0.0).to(tl.float32)
    return x + bias[None, :], idx, mask


@triton.jit
def _bias_gelu_fwd(X, B, Y, n_rows, n_cols, INTERP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    z, idx, mask = _bias_gelu_input(X, B, n_rows, n_cols, BLOCK_R, BLOCK_C)
    y, _ = _gelu_parts(z)
    tl.store(Y + idx, _cast(y, Y.dtype.element_ty, INTERP), mask=mask)


@triton.jit
def _bias_gelu_bwd(DY, X, B, DX, n_rows, n_cols, INTERP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    z, idx, mask = _bias_gelu_input(X, B, n_rows, n_cols, BLOCK_R, BLOCK_C)
    _, dgelu = _gelu_parts(z)
    dy = tl.load(DY + idx, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + idx, _cast(dy * dgelu, DX.dtype.element_ty, INTERP), mask=mask)


# fmt: off
@triton.jit
def _bdaln_fwd(
    X, B, R, W, LB, Y, H, MEAN, RSTD, KEEP, n_rows, n_cols, eps, p_drop, RNG,
    DROPOUT: tl.constexpr, STORE_KEEP: tl.constexpr, INTERP: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Row-wise: h = residual + dropout(x + bias); y = LayerNorm(h) * weight + ln_bias."""
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < n_cols
    idx = row.to(tl.int64) * n_cols + c
    z = tl.load(X + idx, mask=c_ok, other=0.0).to(tl.float32) + tl.load(B + c, mask=c_ok, other=0.0).to(tl.float32)
    if DROPOUT:
        keep = tl.reshape(_keep(RNG, row, 0, 0, p_drop, 1, BLOCK_C), [BLOCK_C])
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


@triton.jit
def _bdaln_bwd(
    DY, H, W, MEAN, RSTD, DX, DRES, DW_PART, DLB_PART, DB_PART, n_rows, n_cols, rows_per_prog, p_drop, RNG,
    DROPOUT: tl.constexpr, INTERP: tl.constexpr, BLOCK_C: tl.constexpr,
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
                keep = tl.reshape(_keep(RNG, row, 0, 0, p_drop, 1, BLOCK_C), [BLOCK_C])
                dh = tl.where(keep, dh / (1.0 - p_drop), 0.0)
            db += dh
            tl.store(DX + idx, _cast(dh, DX.dtype.element_ty, INTERP), mask=c_ok)
    tl.store(DW_PART + pid.to(tl.int64) * n_cols + c, dw, mask=c_ok)
    tl.store(DLB_PART + pid.to(tl.int64) * n_cols + c, dlb, mask=c_ok)
    tl.store(DB_PART + pid.to(tl.int64) * n_cols + c, db, mask=c_ok)
# fmt: on


def _launch(kernel, grid, *args, **kwargs):
    """Every launch goes through here (tools.compile_check swaps it to compile for a GPU without one)."""
    kernel[grid](*args, **kwargs)


def _eltwise_grid(n_rows, n_cols):
    block_c = min(triton.next_power_of_2(n_cols), 1024)
    block_r = max(1, 4096 // block_c)
    return (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c)), dict(BLOCK_R=block_r, BLOCK_C=block_c)


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


def bdaln_fwd(x, bias, residual, weight, ln_bias, y, h, mean, rstd, eps, p_drop, rng, keep=None):
    """Bias + dropout + residual + LayerNorm over rows of x [R, N] (all contiguous): writes y and
    h = residual + dropout(x + bias) [R, N], mean and rstd [R] fp32, and with keep ([R, N] int8)
    the dropout mask."""
    r, n = x.shape
    block_c = triton.next_power_of_2(n)
    tensors = (x, bias, residual, weight, ln_bias, y, h, mean, rstd, y if keep is None else keep)
    flags = dict(DROPOUT=p_drop > 0, STORE_KEEP=keep is not None, INTERP=INTERPRET, BLOCK_C=block_c)
    _launch(_bdaln_fwd, (r,), *tensors, r, n, eps, p_drop, rng, **flags, **_row_opts(block_c))


def bdaln_bwd(dy, h, weight, mean, rstd, dx, dres, p_drop, rng):
    """Backward of bdaln_fwd: writes dx, dres [R, N]; returns the partial sums of dweight,
    dln_bias and dbias, [programs, N] fp32 each (the caller sums over programs)."""
    r, n = dy.shape
    rows_per_prog = triton.cdiv(r, 8 if INTERPRET else 1024)  # up to 1024 programs: enough to fill a GPU
    programs = triton.cdiv(r, rows_per_prog)
    dw, dlb, db = torch.empty(3, programs, n, dtype=torch.float32, device=dy.device)
    block_c = triton.next_power_of_2(n)
    tensors = (dy, h, weight, mean, rstd, dx, dres, dw, dlb, db)
    flags = dict(DROPOUT=p_drop > 0, INTERP=INTERPRET, BLOCK_C=block_c)
    _launch(_bdaln_bwd, (programs,), *tensors, r, n, rows_per_prog, p_drop, rng, **flags, **_row_opts(block_c))
    return dw, dlb, db
