"""Fused multi-head attention over unpadded (varlen) batches: the ``triton`` and
``triton_grouped`` attention backends.

Layers, from the bottom:

1. ``kernels/jit_kernels.py``: the Triton kernels (forward; backward as a dK/dV pass and a dQ
   pass) and their launchers.
2. Two ``torch.library`` custom ops, ``bert_kernels::varlen_attn_fwd`` / ``_bwd``: opaque
   to ``torch.compile`` (which traces around them with their fake implementations), so a
   compiled model keeps the kernels. The forward op draws the dropout seed.
3. ``_VarlenAttention``, a ``torch.autograd.Function`` joining the two ops.
4. Public functions: ``varlen_attention``, ``varlen_attention_qkvpacked``,
   ``grouped_varlen_attention``, and ``varlen_attention_with_dropout_mask`` (debug).
5. The backends (``triton_backend``, ``grouped_backend``) with the ``kernels.interface`` call.

Dropout uses Philox keyed by (seed, offset) and the element's coordinates (see
``jit_kernels``); seed and offset are drawn from torch's default CPU generator, so
``torch.manual_seed`` makes a run reproducible, and the backward regenerates the mask
instead of storing it.

Shape legend: T tokens, B sequences, H heads, D head dim, S = max_seqlen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kernels.grouped import (
    DEFAULT_BUCKETS,
    MAX_STREAMS,
    cached_plan,
    check_buckets,
    check_max_seqlen,
    host_seqlens,
    run_groups,
    single_plan,
)
from kernels.interface import BackendUnavailable, Layout, VarlenLayout
from kernels.runtime import jit_kernels, seeded_op_tags

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128


def _draw_rng(dropout_p: float) -> Tensor:
    """[2] int64 on CPU: (seed, offset) for Philox, drawn from torch's default generator."""
    if dropout_p <= 0.0:
        return torch.zeros(2, dtype=torch.int64)
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    offset = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
    return torch.cat([seed, offset])


def _fwd_impl(q, k, v, cu_seqlens, max_seqlen, softmax_scale, dropout_p, buckets, num_streams, rng, keep=None):
    kern = jit_kernels(q.device, "triton attention")
    seed, offset = (int(x) for x in rng.tolist())
    t, h, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)  # [T, H], base-2
    if cu_seqlens.device.type == "cpu":  # lengths on the host: check max_seqlen without a sync
        check_max_seqlen(host_seqlens(cu_seqlens), max_seqlen)
    plan = (
        single_plan(cu_seqlens.numel() - 1, max_seqlen)
        if keep is not None
        else cached_plan(cu_seqlens, max_seqlen, buckets)
    )

    def launch(order, start, count, max_len):
        kern.attn_fwd(
            q, k, v, out, lse, cu_seqlens, order, start, count, max_len, softmax_scale, dropout_p, seed, offset, keep
        )

    run_groups(plan, launch, q.device, num_streams)
    return out, lse


@torch.library.custom_op("bert_kernels::varlen_attn_fwd", mutates_args=(), **seeded_op_tags())
def _fwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    softmax_scale: float,
    dropout_p: float,
    buckets: list[int],
    num_streams: int,
) -> tuple[Tensor, Tensor, Tensor]:
    rng = _draw_rng(dropout_p)
    out, lse = _fwd_impl(q, k, v, cu_seqlens, max_seqlen, softmax_scale, dropout_p, buckets, num_streams, rng)
    return out, lse, rng


@_fwd_op.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, softmax_scale, dropout_p, buckets, num_streams):
    return (
        q.new_empty(q.shape),
        q.new_empty(q.shape[:2], dtype=torch.float32),
        torch.empty(2, dtype=torch.int64, device="cpu"),
    )


@torch.library.custom_op("bert_kernels::varlen_attn_bwd", mutates_args=())
def _bwd_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    rng: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    softmax_scale: float,
    dropout_p: float,
    buckets: list[int],
    num_streams: int,
) -> tuple[Tensor, Tensor, Tensor]:
    kern = jit_kernels(q.device, "triton attention")
    seed, offset = (int(x) for x in rng.tolist())
    # delta_i = sum_j P~_ij dP~_ij = rowsum(dO * O) also with dropout (O holds the dropped P~).
    delta = (dout.float() * out.float()).sum(-1)  # [T, H]
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    plan = cached_plan(cu_seqlens, max_seqlen, buckets)

    def launch(order, start, count, max_len):
        kern.attn_bwd(
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
            start,
            count,
            max_len,
            softmax_scale,
            dropout_p,
            seed,
            offset,
        )

    run_groups(plan, launch, q.device, num_streams)
    return dq, dk, dv


@_bwd_op.register_fake
def _(dout, q, k, v, out, lse, rng, cu_seqlens, max_seqlen, softmax_scale, dropout_p, buckets, num_streams):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, softmax_scale, dropout_p, buckets, num_streams):
        out, lse, rng = torch.ops.bert_kernels.varlen_attn_fwd(
            q, k, v, cu_seqlens, max_seqlen, softmax_scale, dropout_p, buckets, num_streams
        )
        ctx.save_for_backward(q, k, v, out, lse, rng, cu_seqlens)
        ctx.args = (max_seqlen, softmax_scale, dropout_p, buckets, num_streams)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rng, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = torch.ops.bert_kernels.varlen_attn_bwd(
            _last_dim_contiguous(dout), q, k, v, out, lse, rng, cu_seqlens, *ctx.args
        )
        return dq, dk, dv, None, None, None, None, None, None


def _check(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, dropout_p: float) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"varlen attention: q, k, v must all be [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"varlen attention: q, k, v must share one dtype of {[str(d) for d in _DTYPES]}; "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"varlen attention: head dim {q.shape[-1]} > {MAX_HEAD_DIM} is not supported")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.device != q.device:
        raise ValueError(
            f"varlen attention: cu_seqlens must be a 1-D int32 tensor on {q.device}; got "
            f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)} on {cu_seqlens.device}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"varlen attention: dropout_p must lie in [0, 1), got {dropout_p}")


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    *,
    buckets: Sequence[int] | None = None,
    num_streams: int = MAX_STREAMS,
) -> Tensor:
    """softmax(q k^T * scale) v within each sequence, with attention dropout, differentiable.

    q, k, v: [T, H, D], one dtype of float16, bfloat16, float32, on CUDA (or CPU with
        TRITON_INTERPRET=1); any token/head strides, head dim contiguous (else copied);
        D <= 128 (32, 64 and 128 are the tested ones).
    cu_seqlens: [B+1] int32 on the same device; sequence b is tokens cu_seqlens[b]:cu_seqlens[b+1]
        (any length >= 1; empty sequences produce nothing).
    max_seqlen: Python int >= the longest sequence (sizes the grid); a smaller one is a
        ValueError wherever the lengths are on the host (cu_seqlens on the CPU, or grouped
        dispatch, which reads them anyway); with cu_seqlens on a GPU and one launch it is
        not checked (that would cost a device-to-host sync per call).
    fp32 inputs multiply in TF32 on tensor cores when ``torch.backends.cuda.matmul.allow_tf32``
        is set, else in full fp32.
    dropout_p: attention-probability dropout (0 in evaluation); the mask is Philox from a seed
        drawn from torch's default generator.
    softmax_scale: default 1/sqrt(D).
    buckets: None for one launch; a strictly increasing length list for grouped multi-stream
        dispatch (``kernels.grouped``), num_streams <= 4 CUDA streams.
    Returns out [T, H, D] in q's dtype, contiguous.
    """
    _check(q, k, v, cu_seqlens, dropout_p)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    bucket_list = list(check_buckets(buckets)) if buckets else []
    return _VarlenAttention.apply(
        _last_dim_contiguous(q),
        _last_dim_contiguous(k),
        _last_dim_contiguous(v),
        cu_seqlens,
        int(max_seqlen),
        scale,
        float(dropout_p),
        bucket_list,
        int(num_streams),
    )


def grouped_varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    num_streams: int = MAX_STREAMS,
) -> Tensor:
    """``varlen_attention`` with one launch per length bucket on up to num_streams CUDA streams.

    Same arguments and result as ``varlen_attention`` (bitwise: each sequence is computed by
    the same programs, and the dropout mask does not depend on the grouping).
    """
    return varlen_attention(
        q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, buckets=buckets, num_streams=num_streams
    )


def varlen_attention_qkvpacked(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    **kwargs,
) -> Tensor:
    """``varlen_attention`` on a packed projection qkv [T, 3, H, D] (no copy of q, k, v)."""
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"varlen attention: qkv must be [T, 3, H, D], got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(1)
    return varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, **kwargs)


@torch.no_grad()
def varlen_attention_with_dropout_mask(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float,
    softmax_scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Debug: the forward (no autograd) plus the dropout mask the kernel applied.

    Draws the seed exactly as ``varlen_attention`` does, so after the same
    ``torch.manual_seed`` both produce the same output. Returns (out [T, H, D],
    keep [B, H, S, S] bool with S = max_seqlen; entry (b, h, i, j) is True when the
    probability of query i attending to key j of sequence b was kept; False outside the
    sequence).
    """
    _check(q, k, v, cu_seqlens, dropout_p)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    b, h, s = cu_seqlens.numel() - 1, q.shape[1], int(max_seqlen)
    keep = torch.zeros(b, h, s, s, dtype=torch.int8, device=q.device)
    rng = _draw_rng(dropout_p)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    out, _ = _fwd_impl(q, k, v, cu_seqlens, s, scale, float(dropout_p), [], 1, rng, keep=keep)
    if dropout_p <= 0.0:  # nothing dropped: every in-sequence entry is kept
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        inside = torch.arange(s, device=q.device) < lens[:, None]  # [B, S]
        keep = (inside[:, :, None] & inside[:, None, :])[:, None].expand(b, h, s, s).to(torch.int8)
    return out, keep.bool()


def _varlen_layout(layout: Layout, name: str) -> VarlenLayout:
    if not isinstance(layout, VarlenLayout):
        raise BackendUnavailable(
            f"model.attention={name}: needs an unpadded batch (VarlenLayout), got "
            f"{type(layout).__name__}; padded batches run with 'padded' or 'reference'"
        )
    return layout


def triton_backend(q: Tensor, k: Tensor, v: Tensor, layout: Layout, dropout_p: float, training: bool) -> Tensor:
    """The ``triton`` backend: one varlen launch per call."""
    lay = _varlen_layout(layout, "triton")
    return varlen_attention(q, k, v, lay.cu_seqlens, lay.max_seqlen, dropout_p if training else 0.0)


def grouped_backend(buckets: Sequence[int] = DEFAULT_BUCKETS, num_streams: int = MAX_STREAMS):
    """A ``triton_grouped`` backend with the given length buckets and stream count."""
    bucket_list = check_buckets(buckets)
    if not 1 <= int(num_streams) <= MAX_STREAMS:
        raise ValueError(f"triton_grouped: num_streams must lie in [1, {MAX_STREAMS}], got {num_streams}")

    def triton_grouped(q: Tensor, k: Tensor, v: Tensor, layout: Layout, dropout_p: float, training: bool) -> Tensor:
        lay = _varlen_layout(layout, "triton_grouped")
        return varlen_attention(
            q,
            k,
            v,
            lay.cu_seqlens,
            lay.max_seqlen,
            dropout_p if training else 0.0,
            buckets=bucket_list,
            num_streams=num_streams,
        )

    return triton_grouped
