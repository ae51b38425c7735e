"""Rotary position embedding (RoPE) on q and k in the flat token layout, Triton and PyTorch.

Positions come with the tokens (``position_ids [N]``, restarting per sequence), so nothing
here needs ``cu_seqlens``. Dimensions pair as (p, p + D/2), transformers' ModernBERT "rotate
half" convention (the formula: ``apply_rotary_reference``). ``apply_rotary`` is one Triton pass
(backward: the inverse rotation), on CUDA or in the interpreter, else ``BackendUnavailable``:
[docs/modern_encoders.md](../docs/modern_encoders.md#rotary-positions-a-triton-kernel-beside-its-reference).

Shapes: x ``[N, H, D]`` (unit last stride, e.g. q/k views of the fused QKV); tables ``[P, D/2]``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from kernels.interface import BackendUnavailable
from kernels.runtime import jit_kernels


def rotary_tables(head_dim: int, theta: float, max_positions: int, device=None) -> tuple[Tensor, Tensor]:
    """cos, sin ``[max_positions, head_dim // 2]`` fp32 for base ``theta``."""
    if head_dim % 2:
        raise ValueError(f"rotary: the head dim must be even, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq[None, :]  # [P, D/2]
    return freqs.cos(), freqs.sin()


def _check(x: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor) -> None:
    n, _, d = x.shape
    if cos.shape != sin.shape or cos.dim() != 2 or 2 * cos.shape[1] != d:
        raise ValueError(f"rotary: tables {tuple(cos.shape)} and {tuple(sin.shape)} do not fit head dim {d}")
    if position_ids.shape != (n,):
        raise ValueError(f"rotary: position_ids {tuple(position_ids.shape)} for {n} tokens")


def apply_rotary_reference(x: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor) -> Tensor:
    """x ``[N, H, D]`` rotated by the angles of ``position_ids``; fp32 math, x's dtype out."""
    _check(x, cos, sin, position_ids)
    half = x.shape[-1] // 2
    c, s = cos[position_ids][:, None, :], sin[position_ids][:, None, :]  # [N, 1, D/2]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


JIT_SOURCE = Path(__file__).with_name("rotary_jit.py")  # the device code, loaded by kernels.runtime


def _launch(x: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor, inverse: bool) -> Tensor:
    kern = jit_kernels(x.device, "rotary kernel", JIT_SOURCE)  # raises BackendUnavailable when it cannot
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    kern.rotary_fwd(x, out, position_ids, cos.contiguous(), sin.contiguous(), inverse)
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, position_ids):
        ctx.save_for_backward(cos, sin, position_ids)
        return _launch(x, cos, sin, position_ids, inverse=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin, position_ids = ctx.saved_tensors
        # The rotation is orthogonal: its gradient is the inverse rotation of dy.
        return _launch(dy, cos, sin, position_ids, inverse=True), None, None, None


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor) -> Tensor:
    """The Triton kernel: same call and result as ``apply_rotary_reference``."""
    _check(x, cos, sin, position_ids)
    if x.device.type not in ("cpu", "cuda"):
        raise BackendUnavailable(f"rotary kernel: tensors on {x.device.type!r}; it needs CUDA or the interpreter")
    return _Rotary.apply(x, cos, sin, position_ids)
