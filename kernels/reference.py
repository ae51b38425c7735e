"""The pure-PyTorch attention backends: ``reference``, ``padded`` and ``sdpa``.

``reference`` is the definition every backend is tested against: softmax attention sequence
by sequence in the input dtype, the layout's mask written out densely. ``padded`` is the
baseline: pad -> ``scaled_dot_product_attention`` with a key mask -> unpad. ``sdpa`` is the
CPU's fast unpadded path, a window through ``banded_sdpa``. All three run everywhere and honour
every setting (``padded`` takes no ``cu_seqlens_k``).

Shape legend: T tokens, B sequences, S padded length, L one sequence's length, H heads,
D head dim.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.interface import Layout, PackedLayout, PaddedLayout
from kernels.masks import flashmask_reference, packed_rows


def band(length: int, window: int | None, device=None) -> Tensor | None:
    """[L, L] bool, True where query i may see key j: |i - j| <= window // 2; None without a
    window or when the band covers every pair."""
    if no_band(length, window):
        return None
    pos = torch.arange(length, device=device)
    return (pos[:, None] - pos[None, :]).abs() <= window // 2


def no_band(length: int, window: int | None) -> bool:
    """Whether a window leaves every pair of a sequence of ``length`` in reach (``band`` is None),
    decided without building the [L, L] band (8 bytes a pair: 512 MiB at 8,192 tokens)."""
    return window is None or window // 2 >= length - 1


def _sequences(q: Tensor, k: Tensor, v: Tensor, layout: Layout, bounds: list[int]):
    """Per sequence of the query offsets ``bounds``: (start, end, q [H, L, D], k and v [H, Lk, D]),
    the keys by ``cu_seqlens_k`` when the layout has keys of their own (cross attention, no
    window: VarlenLayout refuses both), else by ``bounds``."""
    cu_k = getattr(layout, "cu_seqlens_k", None)
    key_bounds = bounds if cu_k is None else cu_k.tolist()
    for start, end, k0, k1 in zip(bounds[:-1], bounds[1:], key_bounds[:-1], key_bounds[1:]):
        yield start, end, q[start:end].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, layout: Layout, dropout_p: float, training: bool) -> Tensor:
    """Softmax attention computed sequence by sequence in the input dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    p = dropout_p if training else 0.0
    if isinstance(layout, PackedLayout):
        return packed_rows(flashmask_reference, q, k, v, layout, p)
    if isinstance(layout, PaddedLayout):
        b, s = layout.key_mask.shape
        q_bhsd, k_bhsd, v_bhsd = (x.view(b, s, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        scores = (q_bhsd @ k_bhsd.transpose(-1, -2)) * scale  # [B, H, S, S]
        scores = scores.masked_fill(~padded_mask(layout.key_mask, layout.window), float("-inf"))
        probs = F.dropout(scores.softmax(-1), p)
        return (probs @ v_bhsd).transpose(1, 2).reshape(q.shape)
    out = torch.empty_like(q)
    for start, end, q_hld, k_hld, v_hld in _sequences(q, k, v, layout, layout.cu_seqlens.tolist()):
        scores = (q_hld @ k_hld.transpose(-1, -2)) * scale  # [H, L, Lk]
        allowed = band(end - start, layout.window, q.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        out[start:end] = (F.dropout(scores.softmax(-1), p) @ v_hld).transpose(0, 1)
    return out


def padded_attention(q: Tensor, k: Tensor, v: Tensor, layout: Layout, dropout_p: float, training: bool) -> Tensor:
    """The baseline: pad to [B, H, S, D], run SDPA with a key-padding mask, unpad."""
    p = dropout_p if training else 0.0
    h, d = q.shape[1:]
    if isinstance(layout, PaddedLayout):
        key_mask = layout.key_mask
        b, s = key_mask.shape
        q4, k4, v4 = (x.view(b, s, h, d).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=padded_mask(key_mask, layout.window), dropout_p=p)
        return out.transpose(1, 2).reshape(q.shape)
    cu = layout.cu_seqlens.long()
    b, s = cu.numel() - 1, layout.max_seqlen
    lens = cu[1:] - cu[:-1]
    key_mask = torch.arange(s, device=q.device).unsqueeze(0) < lens.unsqueeze(1)  # [B, S]
    # Destination of each of the T tokens in the [B*S] padded layout, from T (a shape) and
    # cu_seqlens alone: nothing sized by values, so the host never waits (key_mask.nonzero() would).
    token_T = torch.arange(q.shape[0], device=q.device)
    seq_T = torch.searchsorted(cu[1:], token_T, right=True)
    dest = seq_T * s + token_T - cu[seq_T]

    def to_padded(x: Tensor) -> Tensor:
        buf = x.new_zeros(b * s, h, d)
        buf[dest] = x
        return buf.view(b, s, h, d).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        to_padded(q), to_padded(k), to_padded(v), attn_mask=padded_mask(key_mask, layout.window), dropout_p=p
    )
    return out.transpose(1, 2).reshape(b * s, h, d)[dest]


def padded_mask(key_mask: Tensor, window: int | None) -> Tensor:
    """True where query i may see key j of its row: [B, 1, 1, S] (real keys), or with a window
    [B, 1, S, S] (real keys in the band). The band binds real queries only: a padding query
    keeps every real key, as without a window, so that no row is empty (softmax NaN); its
    output is never read."""
    keys = key_mask[:, None, None, :]
    allowed = band(key_mask.shape[1], window, key_mask.device)
    return keys if allowed is None else keys & (allowed | ~key_mask[:, None, :, None])


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, layout: Layout, dropout_p: float, training: bool) -> Tensor:
    """Unpadded attention from ``scaled_dot_product_attention`` per sequence (VarlenLayout),
    through ``banded_sdpa`` for a window that does not cover the sequence."""
    p = dropout_p if training else 0.0
    out = torch.empty_like(q)
    bounds = [0, *itertools.accumulate(layout.host_seqlens)] if layout.host_seqlens else layout.cu_seqlens.tolist()
    for start, end, q_hld, k_hld, v_hld in _sequences(q, k, v, layout, bounds):
        if no_band(end - start, layout.window):
            # [1, H, L, D]: the CPU's fused (flash) kernel takes 4-D inputs only; 3-D runs the math path.
            o_hld = F.scaled_dot_product_attention(q_hld[None], k_hld[None], v_hld[None], dropout_p=p)[0]
        else:
            o_hld = banded_sdpa(q_hld, k_hld, v_hld, layout.window // 2, p)
        out[start:end] = o_hld.transpose(0, 1)
    return out


def banded_sdpa(q_hld: Tensor, k_hld: Tensor, v_hld: Tensor, reach: int, dropout_p: float) -> Tensor:
    """Attention within |i - j| <= reach of one sequence, ``[H, L, D]`` in and out, touching only
    the keys in reach: the queries in C = L / reach blocks of ``reach`` rows, block c seeing
    keys blocks c - 1, c, c + 1 (3 x reach keys, the band and the sequence's ends masked)."""
    h, length, d = q_hld.shape
    r = max(reach, 1)  # reach 0 (window 1): each token sees itself; blocks of one row
    blocks = -(-length // r)
    pad = blocks * r - length
    q_hcrd = F.pad(q_hld, (0, 0, 0, pad)).view(h, blocks, r, d)
    # Keys padded by one block each side, then 3-block windows with stride one block: [H, C, 3r, D].
    k_hcwd, v_hcwd = (F.pad(x, (0, 0, r, pad + r)).unfold(1, 3 * r, r).transpose(-1, -2) for x in (k_hld, v_hld))
    dev = q_hld.device
    query = torch.arange(blocks * r, device=dev).view(blocks, r, 1)  # [C, r, 1] positions
    key = (torch.arange(blocks, device=dev) * r - r).view(blocks, 1, 1) + torch.arange(3 * r, device=dev)  # [C, 1, 3r]
    # A padding query (position >= L) keeps its real keys in reach, so that no row is empty.
    allowed = ((query - key).abs() <= reach) & (key >= 0) & (key < length)  # [C, r, 3r]
    # 4-D inputs and mask: what the CPU's fused (flash) kernel takes; a 3-D call falls to the math path.
    out = F.scaled_dot_product_attention(q_hcrd, k_hcwd, v_hcwd, attn_mask=allowed[None], dropout_p=dropout_p)
    return out.reshape(h, blocks * r, d)[:, :length]
