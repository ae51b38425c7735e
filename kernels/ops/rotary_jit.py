"""Triton device code of the rotary embedding (``kernels.ops.rotary``), with its launcher; loaded
by ``kernels.runtime`` in Triton's mode, never imported directly.

A program rotates BLOCK_N tokens of one head in fp32 from the fp32 cos/sin tables
``[P, D/2]``, stored in the input dtype; ``INVERSE`` negates sin (the backward).
"""

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # set by the loader in kernels.ops.rotary


@triton.jit
def _rotary_kernel(
    X, OUT, POS, COS, SIN, n_tokens, stride_xn, stride_xh, stride_on, stride_oh,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    head = tl.program_id(1)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_HALF)
    row_ok = rows < n_tokens
    mask = row_ok[:, None] & (cols[None, :] < HALF)
    pos = tl.load(POS + rows, mask=row_ok, other=0).to(tl.int64)
    table = pos[:, None] * HALF + cols[None, :]
    c = tl.load(COS + table, mask=mask, other=0.0)
    s = tl.load(SIN + table, mask=mask, other=0.0)
    if INVERSE:
        s = -s
    x_ptr = X + rows[:, None].to(tl.int64) * stride_xn + head * stride_xh + cols[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    o_ptr = OUT + rows[:, None].to(tl.int64) * stride_on + head * stride_oh + cols[None, :]
    tl.store(o_ptr, (x1 * c - x2 * s).to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(o_ptr + HALF, (x2 * c + x1 * s).to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def rotary_fwd(x, out, position_ids, cos, sin, inverse: bool) -> None:
    """out = x rotated (x, out ``[N, H, D]`` with unit last stride; tables ``[P, D/2]`` fp32)."""
    n, h, d = x.shape
    half = d // 2
    block_half = triton.next_power_of_2(half)
    block_n = max(1, min(64, 2048 // block_half))  # 2,048 pairs per program: no spills at D = 128 in fp32
    grid = (triton.cdiv(n, block_n), h)
    opts = {} if INTERPRET else {"num_warps": 4}
    strides = (*x.stride()[:2], *out.stride()[:2])  # token and head strides of x, then of out
    blocks = dict(HALF=half, BLOCK_N=block_n, BLOCK_HALF=block_half)
    _launch(_rotary_kernel, grid, x, out, position_ids, cos, sin, n, *strides, **blocks, INVERSE=inverse, **opts)


def _launch(kernel, grid, *args, **kwargs) -> None:
    """The one launch (tools.compile_check swaps it for a compile for sm_90)."""
    kernel[grid](*args, **kwargs)
