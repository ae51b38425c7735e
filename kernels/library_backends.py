"""Attention backends from libraries, for side-by-side comparison on the same batches.

``flash_attn``: ``flash_attn_varlen_func`` when flash-attn is installed (CUDA, fp16/bf16,
dropout, the window as its ``window_size``); ``torch_varlen``: torch's
``varlen_attn`` (CUDA, fp16/bf16), which has no dropout, so a training call with
dropout_p > 0 is refused. Each loader raises ``BackendUnavailable`` with the reason;
``kernels.registry`` checks layout and settings before each call.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from kernels.interface import AttentionFn, BackendUnavailable, VarlenLayout

_HALF = (torch.float16, torch.bfloat16)


def _check_half(q: Tensor, name: str) -> None:
    if q.dtype not in _HALF:
        raise BackendUnavailable(
            f"model.attention={name}: runs in float16/bfloat16 only, got {q.dtype}; "
            "train under autocast or in half precision"
        )


def _need_cuda(name: str) -> None:
    if not torch.cuda.is_available():
        raise BackendUnavailable(f"model.attention={name}: needs a CUDA GPU and none is available")


def load_flash_attn() -> AttentionFn:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:
        raise BackendUnavailable(f"model.attention=flash_attn: the flash_attn package is not installed ({e})") from e
    _need_cuda("flash_attn")
    has_window = "window_size" in inspect.signature(flash_attn_varlen_func).parameters

    def flash_attn(q: Tensor, k: Tensor, v: Tensor, layout: VarlenLayout, dropout_p: float, training: bool) -> Tensor:
        _check_half(q, "flash_attn")
        window = {}
        if layout.window is not None:
            if not has_window:
                raise BackendUnavailable(
                    "model.attention=flash_attn: this flash_attn has no window_size (added in flash-attn 2.3)"
                )
            # flash-attn's window is (left, right) keys either side: the band |i - j| <= window // 2.
            window = {"window_size": (layout.window // 2, layout.window // 2)}
        cu, s = layout.cu_seqlens, layout.max_seqlen  # the keys' offsets are the queries'
        return flash_attn_varlen_func(q, k, v, cu, cu, s, s, dropout_p=dropout_p if training else 0.0, **window)

    return flash_attn


def load_torch_varlen() -> AttentionFn:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        raise BackendUnavailable(
            f"model.attention=torch_varlen: this torch ({torch.__version__}) has no "
            "torch.nn.attention.varlen.varlen_attn"
        ) from None
    _need_cuda("torch_varlen")

    def torch_varlen(q: Tensor, k: Tensor, v: Tensor, layout: VarlenLayout, dropout_p: float, training: bool) -> Tensor:
        _check_half(q, "torch_varlen")
        if training and dropout_p > 0:
            raise BackendUnavailable(
                f"model.attention=torch_varlen: torch's varlen_attn has no attention dropout, asked for "
                f"{dropout_p}; set the attention dropout to 0 or choose triton / flash_attn"
            )
        return varlen_attn(q, k, v, layout.cu_seqlens, layout.cu_seqlens, layout.max_seqlen, layout.max_seqlen)

    return torch_varlen
