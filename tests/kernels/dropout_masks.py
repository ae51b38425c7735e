"""Test tools: the attention kernels' and the fused LayerNorm kernel's forward, with the
dropout keep mask each applied (the kernels' ``keep`` debug output). Moved from
``kernels.varlen_attention`` and ``kernels.ops.fused``: only tests read the masks."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.ops.fused import _BiasDropoutAddLayerNorm, _check_ln
from kernels.runtime import draw_philox
from kernels.varlen_attention import Call, _check, _fwd_impl, last_dim_contiguous


@torch.no_grad()
def varlen_attention_with_dropout_mask(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float,
    softmax_scale: float | None = None,
    *,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The forward of ``varlen_attention`` (no autograd) plus the dropout mask the kernel applied.

    Draws the seed exactly as ``varlen_attention`` does, so after the same
    ``torch.manual_seed`` both produce the same output. Returns (out [T, H, D],
    keep [B, H, S, S] bool with S = max_seqlen; entry (b, h, i, j) is True when the
    probability of query i attending to key j of sequence b was kept; False outside the
    sequence, and with a window False outside the band's key blocks, which are never computed).
    """
    _check(q, k, v, cu_seqlens, dropout_p, window)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    b, h, s = cu_seqlens.numel() - 1, q.shape[1], int(max_seqlen)
    keep = torch.zeros(b, h, s, s, dtype=torch.int8, device=q.device)
    rng = draw_philox(dropout_p, q.device)
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    call = Call(cu_seqlens, s, window=window, softmax_scale=scale, dropout_p=float(dropout_p))
    out, _ = _fwd_impl(q, k, v, call, rng, keep=keep)
    if dropout_p <= 0.0:  # nothing dropped: every in-sequence entry is kept
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        inside = torch.arange(s, device=q.device) < lens[:, None]  # [B, S]
        keep = (inside[:, :, None] & inside[:, None, :])[:, None].expand(b, h, s, s).to(torch.int8)
    return out, keep.bool()


@torch.no_grad()
def bias_dropout_add_layer_norm_with_mask(
    x: Tensor, bias: Tensor, residual: Tensor, weight: Tensor, ln_bias: Tensor, dropout_p: float, eps: float
) -> tuple[Tensor, Tensor]:
    """The training forward of ``bias_dropout_add_layer_norm`` and the keep mask [..., N] bool
    it applied to x + bias.

    Draws its seed as ``bias_dropout_add_layer_norm`` does, so after the same
    ``torch.manual_seed`` both give the same output.
    """
    _check_ln(x, bias, residual, weight, ln_bias, dropout_p)
    keep = torch.ones(x.shape, dtype=torch.int8, device=x.device)
    y = _BiasDropoutAddLayerNorm.apply(
        x, bias, residual, weight, ln_bias, float(dropout_p), float(eps), keep.view(-1, x.shape[-1])
    )
    return y, keep.bool()
