"""Attention backends behind one call, chosen by configuration (``model.attention``).

Every backend is a function ``(q, k, v, layout, dropout_p, training) -> out`` where q, k, v
and out are ``[N, H, D]`` (N tokens, H heads, D head dim) and ``layout`` says how the N
tokens form sequences:

- ``VarlenLayout``: N = T tokens of B sequences concatenated, ``cu_seqlens [B+1]`` int32.
- ``PaddedLayout``: N = B*S tokens, rows of S with a ``[B, S]`` key mask (True = real).
- ``PackedLayout``: N = R*S tokens, rows of S each holding whole sequences, kept apart by
  FlashMask bounds ``[R, 1, S, 2]`` (``kernels.flashmask``); ``reference`` builds the dense
  mask from them, ``flashmask`` runs the tile-skipping kernel.

``get_backend(name)`` returns the function or raises ``BackendUnavailable`` saying why the
backend cannot run here; it never substitutes another backend.

Backends here: ``reference`` (pure PyTorch, loops over sequences for clarity, runs
everywhere) and ``padded`` (pad -> ``scaled_dot_product_attention`` with a key mask -> unpad,
the baseline). The Triton and library backends are loaded on demand from ``kernels.backends``
and ``kernels.flashmask``. This module sits below the model (``bert.model`` picks a backend
here by name) and imports nothing from ``bert/``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class VarlenLayout:
    cu_seqlens: Tensor  # [B+1] int32
    max_seqlen: int


@dataclass(frozen=True)
class PaddedLayout:
    key_mask: Tensor  # [B, S] bool, True on real tokens


@dataclass(frozen=True)
class PackedLayout:
    startend_row_indices: Tensor  # [R, 1, S, n] int32 FlashMask bounds (packed BERT: n = 2, (LTS, UTE))
    causal: bool = False


Layout = VarlenLayout | PaddedLayout | PackedLayout
AttentionFn = Callable[[Tensor, Tensor, Tensor, Layout, float, bool], Tensor]


class BackendUnavailable(RuntimeError):
    """The configured attention backend cannot run on this machine or layout."""


def reference_attention(q: Tensor, k: Tensor, v: Tensor, layout: Layout, dropout_p: float, training: bool) -> Tensor:
    """Softmax attention computed sequence by sequence in the input dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    p = dropout_p if training else 0.0
    if isinstance(layout, PackedLayout):
        from kernels.flashmask import packed_reference  # PyTorch only: the dense mask of the bounds

        return packed_reference(q, k, v, layout, p)
    if isinstance(layout, PaddedLayout):
        b, s = layout.key_mask.shape
        q_bhsd, k_bhsd, v_bhsd = (x.view(b, s, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        scores = (q_bhsd @ k_bhsd.transpose(-1, -2)) * scale  # [B, H, S, S]
        scores = scores.masked_fill(~layout.key_mask[:, None, None, :], float("-inf"))
        probs = F.dropout(scores.softmax(-1), p)
        return (probs @ v_bhsd).transpose(1, 2).reshape(q.shape)
    out = torch.empty_like(q)
    bounds = layout.cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        q_hld, k_hld, v_hld = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        probs = ((q_hld @ k_hld.transpose(-1, -2)) * scale).softmax(-1)  # [H, L, L]
        out[start:end] = (F.dropout(probs, p) @ v_hld).transpose(0, 1)
    return out


def padded_attention(q: Tensor, k: Tensor, v: Tensor, layout: Layout, dropout_p: float, training: bool) -> Tensor:
    """The baseline: pad to [B, H, S, D], run SDPA with a key-padding mask, unpad."""
    p = dropout_p if training else 0.0
    h, d = q.shape[1:]
    if isinstance(layout, PaddedLayout):
        mask = layout.key_mask
        b, s = mask.shape
        q4, k4, v4 = (x.view(b, s, h, d).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask[:, None, None, :], dropout_p=p)
        return out.transpose(1, 2).reshape(q.shape)
    cu = layout.cu_seqlens.long()
    b, s = cu.numel() - 1, layout.max_seqlen
    lens = cu[1:] - cu[:-1]
    mask = torch.arange(s, device=q.device).unsqueeze(0) < lens.unsqueeze(1)  # [B, S]
    # Destination of each of the T tokens in the [B*S] padded layout, from T (a shape) and
    # cu_seqlens alone: nothing sized by values, so the host never waits (mask.nonzero() would).
    token_T = torch.arange(q.shape[0], device=q.device)
    seq_T = torch.searchsorted(cu[1:], token_T, right=True)
    dest = seq_T * s + token_T - cu[seq_T]

    def to_padded(x: Tensor) -> Tensor:
        buf = x.new_zeros(b * s, h, d)
        buf[dest] = x
        return buf.view(b, s, h, d).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        to_padded(q), to_padded(k), to_padded(v), attn_mask=mask[:, None, None, :], dropout_p=p
    )
    return out.transpose(1, 2).reshape(b * s, h, d)[dest]


# name -> zero-argument loader returning the backend function (raising BackendUnavailable
# with the reason when it cannot run here). Loaders import lazily so that choosing
# `reference` never imports Triton.
_LOADERS: dict[str, Callable[[], AttentionFn]] = {
    "reference": lambda: reference_attention,
    "padded": lambda: padded_attention,
    "triton": lambda: __import__("kernels.backends", fromlist=["load"]).load("triton"),
    "triton_grouped": lambda **kw: __import__("kernels.backends", fromlist=["load"]).load("triton_grouped", **kw),
    "flash_attn": lambda: __import__("kernels.backends", fromlist=["load"]).load("flash_attn"),
    "torch_varlen": lambda: __import__("kernels.backends", fromlist=["load"]).load("torch_varlen"),
    "flashmask": lambda: __import__("kernels.flashmask", fromlist=["load_backend"]).load_backend(),
}


def register_backend(name: str, loader: Callable[[], AttentionFn]) -> None:
    _LOADERS[name] = loader


def backend_names() -> list[str]:
    return sorted(_LOADERS)


def get_backend(name: str, **options) -> AttentionFn:
    """The backend ``name``; ``options`` go to backends that take some (``triton_grouped``:
    ``buckets``, ``num_streams``)."""
    if name not in _LOADERS:
        raise BackendUnavailable(f"model.attention: unknown backend {name!r}; choose one of {backend_names()}")
    return _LOADERS[name](**options)
