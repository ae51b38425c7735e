"""Loaders for the attention backends that live in ``kernels/`` (called by ``kernels.attention``).

Each returns the backend function or raises ``BackendUnavailable`` with the reason it
cannot run here; importing this module imports neither Triton nor any library.
"""

from __future__ import annotations

from kernels.attention import AttentionFn, BackendUnavailable


def load(name: str, **options) -> AttentionFn:
    """``options``: ``buckets`` and ``num_streams`` for ``triton_grouped``."""
    if name in ("triton", "triton_grouped"):
        from kernels.runtime import check_runnable

        check_runnable(f"model.attention={name}")
        from kernels import varlen_attention

        return varlen_attention.triton_backend if name == "triton" else varlen_attention.grouped_backend(**options)
    if name == "flash_attn":
        from kernels.library_backends import load_flash_attn

        return load_flash_attn()
    if name == "torch_varlen":
        from kernels.library_backends import load_torch_varlen

        return load_torch_varlen()
    raise BackendUnavailable(f"kernels.backends: no backend named {name!r}")
