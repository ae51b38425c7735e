"""The pure-PyTorch attention backends: ``reference`` and ``padded``.

``reference`` is the definition every other backend is tested against: softmax attention
computed sequence by sequence in the input dtype, with the layout's mask written out densely
(a window as the band |i - j| <= window // 2; a packed batch's FlashMask bounds through
``kernels.masks``). ``padded`` is the baseline: pad -> ``scaled_dot_product_attention`` with
a key mask (and the band, with a window) -> unpad. Both run everywhere and honour every
setting of ``kernels.interface.SETTINGS``.

Shape legend: T tokens, B sequences, S padded length, L one sequence's length, H heads,
D head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.interface import Layout, PackedLayout, PaddedLayout
from kernels.masks import packed_reference


def band(length: int, window: int | None, device=None) -> Tensor | None:
    """[L, L] bool, True where query i may see key j: |i - j| <= window // 2; None without a
    window or when the band covers every pair (so a window of at least twice the length is
    exactly no window)."""
    if window is None or window // 2 >= length - 1:
        return None
    pos = torch.arange(length, device=device)
    return (pos[:, None] - pos[None, :]).abs() <= window // 2


def reference_attention(q: Tensor, k: Tensor, v: Tensor, layout: Layout, dropout_p: float, training: bool) -> Tensor:
    """Softmax attention computed sequence by sequence in the input dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    p = dropout_p if training else 0.0
    if isinstance(layout, PackedLayout):
        return packed_reference(q, k, v, layout, p)
    if isinstance(layout, PaddedLayout):
        b, s = layout.key_mask.shape
        q_bhsd, k_bhsd, v_bhsd = (x.view(b, s, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        scores = (q_bhsd @ k_bhsd.transpose(-1, -2)) * scale  # [B, H, S, S]
        scores = scores.masked_fill(~padded_mask(layout.key_mask, layout.window), float("-inf"))
        probs = F.dropout(scores.softmax(-1), p)
        return (probs @ v_bhsd).transpose(1, 2).reshape(q.shape)
    out = torch.empty_like(q)
    bounds = layout.cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        q_hld, k_hld, v_hld = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        scores = (q_hld @ k_hld.transpose(-1, -2)) * scale  # [H, L, L]
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
    # Destination of each of the T tokens in the [B*S] padded layout.
    dest = key_mask.flatten().nonzero().squeeze(1)

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
