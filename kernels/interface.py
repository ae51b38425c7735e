"""The attention interface: the one backend call, the layouts it takes, and its error.

Every backend is ``(q, k, v, layout, dropout_p, training) -> out`` with q, k, v, out
``[N, H, D]``; the layout says how the N tokens form sequences: ``VarlenLayout`` (T tokens
of B sequences, ``cu_seqlens [B+1]`` int32, and ``host_seqlens`` where the host knows them),
``PaddedLayout`` (B*S tokens, a ``[B, S]`` key mask, True = real) or ``PackedLayout`` (R*S
tokens, whole sequences kept apart by FlashMask bounds ``[R, 1, S, n]``, a window written
into them). Per-layer settings are layout fields listed in ``SETTINGS`` with their "off"
value: ``window``, the band |i - j| <= window // 2 inside each sequence; ``cu_seqlens_k``,
keys of their own (cross attention: sequence b's queries see keys ``cu_seqlens_k[b]:[b+1]`` of k,
v ``[Tk, H, D]``; context parallelism's pieces against their whole documents);
``kernels.registry`` refuses a setting to a backend without it. Imports nothing of the
project, nor torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.errors import UserError

if TYPE_CHECKING:  # importing the interface (and the registry) does not import torch
    from torch import Tensor


class BackendUnavailable(UserError):
    """The configured attention backend cannot run on this machine, layout or setting."""


def check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window: must be an int >= 1 (the band |i - j| <= window // 2) or None, got {window!r}")


@dataclass(frozen=True)
class VarlenLayout:
    cu_seqlens: Tensor  # [B+1] int32
    max_seqlen: int
    window: int | None = None  # None: every key of the sequence; else |i - j| <= window // 2
    # cu_seqlens' B lengths as the host knows them (not a setting): triton_grouped plans from them, no device read.
    host_seqlens: tuple[int, ...] | None = None
    # Keys of their own: [B+1] int32 offsets into k, v (None: the queries' own), and the longest.
    cu_seqlens_k: Tensor | None = None
    max_seqlen_k: int | None = None

    def __post_init__(self):
        check_window(self.window)
        if (self.cu_seqlens_k is None) != (self.max_seqlen_k is None):
            raise ValueError("cu_seqlens_k and max_seqlen_k: give both or neither")
        if self.cu_seqlens_k is not None and self.window is not None:
            raise ValueError(
                "window with cu_seqlens_k: the band needs the queries' place among the keys; not supported"
            )
        if self.host_seqlens is not None and not isinstance(self.host_seqlens, tuple):
            raise ValueError(f"host_seqlens: must be a tuple of ints or None, got {type(self.host_seqlens).__name__}")


@dataclass(frozen=True)
class PaddedLayout:
    key_mask: Tensor  # [B, S] bool, True on real tokens
    window: int | None = None  # as VarlenLayout's, over positions within the row

    def __post_init__(self):
        check_window(self.window)


@dataclass(frozen=True)
class PackedLayout:
    startend_row_indices: Tensor  # [R, 1, S, n] int32 FlashMask bounds (packed BERT: n = 2, (LTS, UTE))
    causal: bool = False


Layout = VarlenLayout | PaddedLayout | PackedLayout
AttentionFn = Callable[["Tensor", "Tensor", "Tensor", Layout, float, bool], "Tensor"]

# Per-layer attention settings a layout may carry: field name -> the value that means "off".
SETTINGS: dict[str, object] = {"window": None, "cu_seqlens_k": None}


def requested_settings(layout: Layout) -> dict[str, object]:
    """The settings ``layout`` turns on: {field: value} for each field of SETTINGS it has set."""
    return {name: getattr(layout, name) for name, off in SETTINGS.items() if getattr(layout, name, off) is not off}
