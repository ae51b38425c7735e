"""FlashMask attention: the attention kernel family with FlashMask's column bounds switched on,
and the ``flashmask`` backend (the bounds' meaning, builders and dense reference: ``kernels.masks``).

``flashmask_attention`` runs packed rows q [B, S, H, D] as varlen sequences [B*S, H, D] with the
bounds, whose per-block min and max skip exactly the all-masked tiles; ``flashmask_tile_counts``
reports the tile counts. [docs/packing.md](../docs/packing.md#the-flashmask-kernel).

Shape legend: B batch (packed rows), S / Sq / Sk sequence lengths, H heads, D head dim,
n bounds per column.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.interface import Layout
from kernels.masks import TileCounts, check_startend_row_indices, packed_rows
from kernels.runtime import jit_kernels
from kernels.tiles import attention_tiles
from kernels.varlen_attention import Call, attention, check_inputs, last_dim_contiguous, tile_counts


def tile_sizes(head_dim: int, elt_size: int, interpreted: bool, n: int = 2) -> dict[str, tuple[int, int, int, int]]:
    """{kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages)} for kernel in fwd, dkdv, dq with
    n bounds per column: ``kernels.tiles``' bounded entries (one BLOCK_N for the three)."""
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    return {
        name: attention_tiles(name, block_d, elt_size, False, bounded=n, interpreted=interpreted)
        for name in ("fwd", "dkdv", "dq")
    }


def _rows_call(query: Tensor, key: Tensor, bounds: Tensor, causal: bool, scale: float, dropout_p: float) -> Call:
    """The varlen call of packed rows: row b is sequence b (queries b*Sq.., keys b*Sk..)."""
    b, sq, sk = query.shape[0], query.shape[1], key.shape[1]
    cu = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=query.device)
    cu_k = None if sk == sq else torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=query.device)
    return Call(cu, sq, cu_k, None if cu_k is None else sk, bounds, bool(causal), None, scale, float(dropout_p))


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
    check_inputs("flashmask attention", query, key, value, dropout_p)
    if causal and query.shape[1] != key.shape[1]:
        raise ValueError(
            f"flashmask attention: causal needs seqlen_q == seqlen_k, got {query.shape[1]} and {key.shape[1]}"
        )
    if min(query.shape[:3]) < 1 or key.shape[1] < 1:
        raise ValueError(f"flashmask attention: empty input {tuple(query.shape)}, {tuple(key.shape)}")
    check_startend_row_indices(bounds, causal, query.shape[0], query.shape[2], key.shape[1])
    if bounds.device != query.device:
        raise ValueError(f"startend_row_indices: on {bounds.device}, the query on {query.device}")


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
    bounds = last_dim_contiguous(startend_row_indices)
    jit_kernels(query.device, "flashmask attention")  # cannot run here: say so as flashmask attention
    b, sq, h, d = query.shape
    q, k, v = (x.reshape(-1, h, d) for x in (query, key, value))  # [B*S, H, D]: a view where the strides allow
    return attention(q, k, v, _rows_call(query, key, bounds, causal, scale, dropout_p)).view(b, sq, h, d)


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
    """Debug: ``varlen_attention.tile_counts`` on packed rows: {pass: (TileCounts summed over
    batch and heads, (BLOCK_M, BLOCK_N))} for pass in fwd, dkdv, dq. The tile sizes are the
    kernels' own unless overridden: block_m / block_n for every pass, or ``tiles`` {pass:
    (BLOCK_M, BLOCK_N)} (one BLOCK_N, a multiple of 4, for all passes)."""
    _check(query, key, value, startend_row_indices, causal, 0.0)
    q, k, v = (last_dim_contiguous(x) for x in (query, key, value))
    kern = jit_kernels(q.device, "flashmask attention")
    if tiles is not None:
        if len({bn for _, bn in tiles.values()}) != 1 or set(tiles) != {"fwd", "dkdv", "dq"}:
            raise ValueError(f"tiles: need fwd, dkdv and dq with one BLOCK_N, got {tiles}")
        blocks = {name: (bm, bn, 1, 1) for name, (bm, bn) in tiles.items()}
    else:
        blocks = tile_sizes(q.shape[-1], q.element_size(), kern.INTERPRET, startend_row_indices.shape[-1])
        blocks = {name: (block_m or bm, block_n or bn, w, s) for name, (bm, bn, w, s) in blocks.items()}
    b, sq, h, d = q.shape
    call = _rows_call(q, k, startend_row_indices.contiguous(), causal, d**-0.5, 0.0)
    flat = (x.reshape(-1, h, d) for x in (q, k, v))
    return tile_counts(*flat, call, blocks, backward)


# ------------------------------------------------------------------------------ the backend


def flashmask_backend(q: Tensor, k: Tensor, v: Tensor, layout: Layout, dropout_p: float, training: bool) -> Tensor:
    """The ``flashmask`` attention backend: q, k, v [R*S, H, D] of a packed batch (a
    ``PackedLayout``: ``kernels.registry`` refuses the others before the call)."""
    return packed_rows(flashmask_attention, q, k, v, layout, dropout_p if training else 0.0)
