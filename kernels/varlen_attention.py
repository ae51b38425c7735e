"""Fused multi-head attention over unpadded (varlen) batches: the host side of the one Triton
kernel family, the ``triton`` and ``triton_grouped`` backends, and the op ``kernels.flashmask``
runs for packed rows.

From the bottom: the device code (``kernels/triton_jit.py``); the custom ops
``bert_kernels::attention_fwd`` / ``_bwd``, opaque to ``torch.compile``; ``_Attention``, the
autograd Function behind ``attention``; the public functions; the backends.
[docs/kernels.md](../docs/kernels.md#kernels).

Shape legend: T tokens, B sequences, H heads, D head dim, S = max_seqlen, n bounds per column.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from kernels.grouped import (
    DEFAULT_BUCKETS,
    MAX_STREAMS,
    cached_plan,
    check_buckets,
    check_max_seqlen,
    host_seqlens,
    note_host_seqlens,
    run_groups,
)
from kernels.interface import Layout, VarlenLayout, check_window
from kernels.masks import TileCounts
from kernels.runtime import draw_philox, jit_kernels, seeded_op_tags

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128


class Call(NamedTuple):
    """Everything about an attention call but q, k, v: the ops' other arguments, in their order."""

    cu_seqlens: Tensor  # [B+1] int32
    max_seqlen: int
    cu_seqlens_k: Tensor | None = None  # [B+1] int32 keys' offsets when they differ from the queries'
    max_seqlen_k: int | None = None
    bounds: Tensor | None = None  # [B, H or 1, Sk, n] int32 FlashMask bounds
    causal: bool = False
    window: int | None = None  # the band |i - j| <= window // 2
    softmax_scale: float = 1.0
    dropout_p: float = 0.0
    buckets: list[int] = []  # [] = one launch (never mutated)
    num_streams: int = 1


def block_minmax(startend_row_indices: Tensor, block_n: int) -> Tensor:
    """[B, H or 1, cdiv(Sk, block_n), n, 2] int32: min and max of each bound per key block."""
    b, h, sk, n = startend_row_indices.shape
    nb = -(-sk // block_n)
    x = startend_row_indices
    if nb * block_n != sk:  # repeat the last column: leaves every block's min and max unchanged
        x = torch.cat([x, x[:, :, -1:].expand(b, h, nb * block_n - sk, n)], 2)
    x = x.view(b, h, nb, block_n, n)
    return torch.stack([x.amin(3), x.amax(3)], -1).contiguous()


def _launcher(kern, q, call: Call, blocks: dict | None, single: bool, run):
    """Run ``run(Sequences)`` once per launch of the call's plan (one per length bucket, or one)."""
    plan = cached_plan(call.cu_seqlens, call.max_seqlen, [] if single else call.buckets)
    bmm = None
    if call.bounds is not None:  # per block of the BLOCK_N keys all three kernels share
        block_n = blocks["fwd"][1] if blocks else kern.bounded_key_block(q)
        bmm = block_minmax(call.bounds, block_n)
    masking = (call.max_seqlen_k, call.cu_seqlens_k, call.window, call.bounds, bmm, call.causal)

    def launch(order, start, count, max_len):
        run(kern.Sequences(call.cu_seqlens, order, start, count, max_len, *masking))

    run_groups(plan, launch, q.device, call.num_streams)


def _fwd_impl(q, k, v, call: Call, rng, keep=None, counts=None, blocks=None):
    kern = jit_kernels(q.device, "triton attention")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)  # [T, H], base-2
    if call.cu_seqlens.device.type == "cpu":  # lengths on the host: check max_seqlen without a sync
        check_max_seqlen(host_seqlens(call.cu_seqlens), call.max_seqlen)

    def run(seqs):
        kern.attn_fwd(q, k, v, out, lse, seqs, call.softmax_scale, call.dropout_p, rng, keep, counts, blocks)

    _launcher(kern, q, call, blocks, keep is not None or counts is not None, run)
    return out, lse


def _bwd_impl(dout, q, k, v, out, lse, rng, call: Call, counts=None, blocks=None):
    kern = jit_kernels(q.device, "triton attention")
    # delta_i = sum_j P~_ij dP~_ij = rowsum(dO * O) also with dropout (O holds the dropped P~).
    delta = (dout.float() * out.float()).sum(-1)  # [T, H]
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))

    def run(seqs):
        args = (seqs, call.softmax_scale, call.dropout_p, rng, counts, blocks)
        kern.attn_bwd(dout, q, k, v, lse, delta, dq, dk, dv, *args)

    _launcher(kern, q, call, blocks, counts is not None, run)
    return dq, dk, dv


@torch.library.custom_op("bert_kernels::attention_fwd", mutates_args=(), **seeded_op_tags())
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor,
    cu_seqlens: Tensor, max_seqlen: int, cu_seqlens_k: Tensor | None, max_seqlen_k: int | None, bounds: Tensor | None,
    causal: bool, window: int | None, softmax_scale: float, dropout_p: float, buckets: list[int], num_streams: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    call = Call(cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, bounds, causal, window)
    call = call._replace(softmax_scale=softmax_scale, dropout_p=dropout_p, buckets=buckets, num_streams=num_streams)
    rng = draw_philox(dropout_p, q.device)
    out, lse = _fwd_impl(q, k, v, call, rng)
    return out, lse, rng


@_fwd_op.register_fake
def _(q, k, v, *call):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32), q.new_empty(2, dtype=torch.int64)


@torch.library.custom_op("bert_kernels::attention_bwd", mutates_args=())
def _bwd_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rng: Tensor,
    cu_seqlens: Tensor, max_seqlen: int, cu_seqlens_k: Tensor | None, max_seqlen_k: int | None, bounds: Tensor | None,
    causal: bool, window: int | None, softmax_scale: float, dropout_p: float, buckets: list[int], num_streams: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    call = Call(cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, bounds, causal, window)
    call = call._replace(softmax_scale=softmax_scale, dropout_p=dropout_p, buckets=buckets, num_streams=num_streams)
    return _bwd_impl(dout, q, k, v, out, lse, rng, call)


@_bwd_op.register_fake
def _(dout, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: Call):
        out, lse, rng = torch.ops.bert_kernels.attention_fwd(q, k, v, *call)
        ctx.save_for_backward(q, k, v, out, lse, rng, call.cu_seqlens, call.cu_seqlens_k, call.bounds)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rng, cu, cu_k, bounds = ctx.saved_tensors
        call = ctx.call._replace(cu_seqlens=cu, cu_seqlens_k=cu_k, bounds=bounds)
        dq, dk, dv = torch.ops.bert_kernels.attention_bwd(last_dim_contiguous(dout), q, k, v, out, lse, rng, *call)
        return dq, dk, dv, None


def attention(q: Tensor, k: Tensor, v: Tensor, call: Call) -> Tensor:
    """The kernel family on q [T, H, D], k, v [Tk, H, D] (head dim contiguous, else copied),
    differentiable; the checked entry of every public function."""
    return _Attention.apply(last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v), call)


@torch.no_grad()
def tile_counts(
    q: Tensor, k: Tensor, v: Tensor, call: Call, blocks: dict, backward: bool = True
) -> dict[str, tuple[TileCounts, tuple[int, int]]]:
    """Debug: run the kernels (forward, and with ``backward`` the dK/dV and dQ passes on a ones
    gradient) counting tiles (the call needs bounds or a window) at ``blocks`` {pass: (BLOCK_M,
    BLOCK_N, warps, stages)}. Returns {pass: (TileCounts summed over sequences and heads,
    (BLOCK_M, BLOCK_N))}; a sequence shorter than the longest counts its own tiles only."""
    if call.bounds is None and call.window is None:
        raise ValueError("tile counts: the kernels count tiles only with bounds or a window")
    n_seqs, heads = call.cu_seqlens.numel() - 1, q.shape[1]
    sk = call.max_seqlen if call.max_seqlen_k is None else call.max_seqlen_k
    programs = {"fwd": -(-call.max_seqlen // blocks["fwd"][0])}
    if backward:
        programs.update(dkdv=-(-sk // blocks["dkdv"][1]), dq=-(-call.max_seqlen // blocks["dq"][0]))
    counts = {
        name: torch.zeros(n_seqs * heads * n, 4, dtype=torch.int32, device=q.device) for name, n in programs.items()
    }
    rng = torch.zeros(2, dtype=torch.int64, device=q.device)
    call = call._replace(dropout_p=0.0, buckets=[])
    out, lse = _fwd_impl(q, k, v, call, rng, counts=counts["fwd"], blocks=blocks)
    if backward:  # attn_bwd reads the dkdv and dq entries
        _bwd_impl(torch.ones_like(out), q, k, v, out, lse, rng, call, counts, blocks)
    return {name: (TileCounts(*(int(x) for x in c.sum(0).tolist())), blocks[name][:2]) for name, c in counts.items()}


def check_inputs(what: str, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> None:
    """What every kernel of the family needs of q, k, v and dropout_p (shapes: the caller's)."""
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"{what}: q, k, v must share one dtype of {[str(d) for d in _DTYPES]}; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"{what}: head dim {q.shape[-1]} > {MAX_HEAD_DIM} is not supported")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{what}: dropout_p must lie in [0, 1), got {dropout_p}")


def _check(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, dropout_p: float, window: int | None) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"varlen attention: q, k, v must all be [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    check_inputs("varlen attention", q, k, v, dropout_p)
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.device != q.device:
        raise ValueError(
            f"varlen attention: cu_seqlens must be a 1-D int32 tensor on {q.device}; got "
            f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)} on {cu_seqlens.device}"
        )
    check_window(window)


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    *,
    window: int | None = None,
    buckets: Sequence[int] | None = None,
    num_streams: int = MAX_STREAMS,
) -> Tensor:
    """softmax(q k^T * scale) v within each sequence, with attention dropout, differentiable.

    q, k, v: [T, H, D], one dtype of float16, bfloat16, float32, on CUDA (or CPU with
        TRITON_INTERPRET=1); any token/head strides, head dim contiguous (else copied);
        D <= 128 (32, 64 and 128 are the tested ones).
    cu_seqlens: [B+1] int32 on the same device; sequence b is tokens cu_seqlens[b]:cu_seqlens[b+1]
        (any length >= 1; empty sequences produce nothing).
    max_seqlen: Python int >= the longest sequence (sizes the grid); where a smaller one is a
        ValueError, and fp32's TF32: docs/kernels.md, "Contracts".
    dropout_p: attention-probability dropout (0 in evaluation); the mask is Philox from a seed
        drawn from torch's default generator.
    softmax_scale: default 1/sqrt(D).
    window: None, or an int >= 1: query i sees key j of its sequence only when
        |i - j| <= window // 2 (the key blocks outside that band are never computed).
    buckets: None for one launch; a strictly increasing length list for grouped multi-stream
        dispatch (``kernels.grouped``), num_streams <= 4 CUDA streams.
    Returns out [T, H, D] in q's dtype, contiguous.
    """
    _check(q, k, v, cu_seqlens, dropout_p, window)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    bucket_list = list(check_buckets(buckets)) if buckets else []
    call = Call(cu_seqlens, int(max_seqlen), window=window, softmax_scale=scale, dropout_p=float(dropout_p))
    return attention(q, k, v, call._replace(buckets=bucket_list, num_streams=int(num_streams)))


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
    *,
    window: int | None = None,
) -> Tensor:
    """``varlen_attention`` with one launch per length bucket on up to num_streams CUDA streams:
    the same arguments, and the same result bitwise (docs/kernels.md, "Grouped dispatch equals
    one launch")."""
    return varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                            window=window, buckets=buckets, num_streams=num_streams)  # fmt: skip


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


def triton_backend(
    q: Tensor, k: Tensor, v: Tensor, layout: VarlenLayout, dropout_p: float, training: bool, **grouping
) -> Tensor:
    """The ``triton`` backend: one varlen launch per call (the registry checks the layout); with
    ``grouping`` (``buckets``, ``num_streams``), ``triton_grouped``'s."""
    if layout.host_seqlens is not None:  # max_seqlen checked (and groups planned) from these, not a read
        note_host_seqlens(layout.cu_seqlens, layout.host_seqlens)
    p = dropout_p if training else 0.0
    if layout.cu_seqlens_k is not None:
        return cross_attention(
            q, k, v, layout.cu_seqlens, layout.max_seqlen, layout.cu_seqlens_k, layout.max_seqlen_k, p
        )
    return varlen_attention(q, k, v, layout.cu_seqlens, layout.max_seqlen, p, window=layout.window, **grouping)


def cross_call(
    cu_seqlens: Tensor,
    max_seqlen: int,
    cu_seqlens_k: Tensor,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    head_dim: int = 64,
) -> Call:
    """The ``Call`` of sequence b's queries ``cu_seqlens[b]:[b+1]`` against its keys
    ``cu_seqlens_k[b]:[b+1]`` (the kernels' SEPARATE_K mode, FlashMask's cross rows)."""
    scale = float(softmax_scale) if softmax_scale is not None else head_dim**-0.5
    return Call(cu_seqlens, int(max_seqlen), cu_seqlens_k, int(max_seqlen_k), softmax_scale=scale, dropout_p=dropout_p)


def cross_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    cu_seqlens_k: Tensor,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> Tensor:
    """``varlen_attention`` with keys of their own: q ``[T, H, D]``, k, v ``[Tk, H, D]``
    (any token stride); sequence b's queries see keys ``cu_seqlens_k[b]:[b+1]``. No window."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[1:] != q.shape[1:]:
        raise ValueError(
            f"cross attention: q [T, H, D], k and v [Tk, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    check_inputs("cross attention", q, k, v, dropout_p)
    for name, cu in (("cu_seqlens", cu_seqlens), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device or cu.numel() != cu_seqlens.numel():
            raise ValueError(f"cross attention: {name} must be a [B+1] int32 tensor on {q.device}")
    call = cross_call(cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, float(dropout_p), softmax_scale, q.shape[-1])
    return attention(q, k, v, call)


def grouped_backend(buckets: Sequence[int] = DEFAULT_BUCKETS, num_streams: int = MAX_STREAMS):
    """A ``triton_grouped`` backend with the given length buckets and stream count."""
    bucket_list = check_buckets(buckets)
    if not 1 <= int(num_streams) <= MAX_STREAMS:
        raise ValueError(f"triton_grouped: num_streams must lie in [1, {MAX_STREAMS}], got {num_streams}")

    def triton_grouped(q: Tensor, k: Tensor, v: Tensor, layout: Layout, dropout_p: float, training: bool) -> Tensor:
        return triton_backend(q, k, v, layout, dropout_p, training, buckets=bucket_list, num_streams=num_streams)

    return triton_grouped
