"""FlashMask attention: a Triton kernel that skips masked tiles, and the ``flashmask``
attention backend. What the bounds mean, the mask builders and the dense reference are in
``kernels.masks`` (pure PyTorch).

The kernel (``kernels/flashmask_jit.py``) computes, once per call, the min and max of each
bound over every block of BLOCK_N keys, and from those scalars alone classifies each
(query block, key block) tile as skipped (no loads, no math), partial (element mask) or
unmasked (no mask work); a tile the min/max cannot classify gets its element mask built and
is then classified exactly, so a tile is skipped exactly when its dense mask is all masked.
``flashmask_tile_counts`` runs the kernels in a debug mode that reports the counts;
``kernels.masks.reference_tile_counts`` counts the same from the dense mask.

Layers, from the bottom: the Triton kernels and launchers; two ``torch.library`` custom ops
(``bert_kernels::flashmask_fwd`` / ``_bwd``, opaque to ``torch.compile``); an autograd
Function; the public ``flashmask_attention``; the backend ``flashmask_backend`` for the model's
``PackedLayout``. Dropout is the varlen kernels' Philox scheme (``kernels/jit_kernels.py``)
with token index b * seqlen_q + i, so ``torch.manual_seed`` makes it reproducible and the
backward regenerates the mask. ``python -m kernels.compile_check --flashmask`` compiles the
kernels for sm_90.

Shape legend: B batch (packed rows), S / Sq / Sk sequence lengths, H heads, D head dim,
n bounds per column.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from kernels.interface import Layout
from kernels.masks import (  # noqa: F401 -- the builders are re-exported while callers move to kernels.masks
    MASK_BUILDERS,
    FlashMaskSpec,
    TileCounts,
    causal_blockwise_mask,
    causal_document_mask,
    causal_mask,
    check_startend_row_indices,
    document_mask,
    document_window_mask,
    flashmask_reference,
    global_sliding_window_mask,
    intervals,
    prefix_lm_causal_mask,
    prefix_lm_document_mask,
    qk_sparse_mask,
    random_eviction_mask,
    reference_tile_counts,
    shared_question_mask,
    sliding_window_mask,
    to_dense,
    window_bounds,
)
from kernels.runtime import seeded_op_tags

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128
_SOURCE = Path(__file__).with_name("flashmask_jit.py")
_JIT: dict[bool, ModuleType] = {}


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
    ``python -m kernels.compile_check --flashmask`` checks they compile and fit). The
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
    """The ``flashmask`` attention backend: q, k, v [R*S, H, D] of a packed batch (a
    ``PackedLayout``: ``kernels.registry`` refuses the others before the call)."""
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
