"""Tile sizes of the attention kernel family, per (dtype, head dim, dropout, bounds), on a GPU
and in Triton's interpreter: the one table (pure Python, no Triton import).

``attention_tiles(kernel, block_d, elt_size, dropout, preset, bounded, interpreted)`` gives
(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``fwd``, ``dkdv``, ``dq``; every GPU entry
compiles for sm_90 without spills (``python -m tools.compile_check --registers``). With
FlashMask bounds the three kernels share one BLOCK_N. Presets ``default`` and ``small``
(head dim <= 64, fp16/bf16: 2 blocks per SM), chosen by ``KERNELS_ATTENTION_TILES``.
[docs/kernels.md](../docs/kernels.md#registers-and-occupancy-on-sm_90).
"""

from __future__ import annotations

import os

TILE_PRESETS = ("default", "small")

_16BIT = {  # block_d <= 64 | 128
    ("default", 64): {"fwd": (128, 64, 8, 3), "dkdv": (64, 64, 8, 2), "dq": (64, 64, 8, 2)},
    ("small", 64): {"fwd": (64, 32, 4, 2), "dkdv": (32, 32, 4, 2), "dq": (32, 32, 4, 2)},
    ("default", 128): {"fwd": (64, 32, 8, 2), "dkdv": (32, 32, 8, 2), "dq": (32, 32, 8, 2)},
}
_FP32 = {  # block_d <= 32 | 64 | 128; fp32 tiles need twice the shared memory and registers
    32: {"fwd": (64, 32, 8, 2), "dkdv": (32, 16, 8, 2), "dq": (32, 32, 4, 2)},
    64: {"fwd": (32, 32, 8, 2), "dkdv": (32, 32, 8, 2), "dq": (32, 32, 4, 2)},
    128: {"fwd": (64, 32, 8, 2), "dkdv": (32, 32, 8, 2), "dq": (32, 32, 8, 2)},
}


_BOUNDED_16BIT = {  # block_d <= 64 | 128: BLOCK_N 64 | 32 for all three kernels
    64: {"fwd": (128, 64, 8, 2), "dkdv": (32, 64, 8, 2), "dq": (64, 64, 8, 2)},
    128: {"fwd": (32, 32, 8, 2), "dkdv": (32, 32, 8, 2), "dq": (32, 32, 8, 2)},
}
_BOUNDED_FP32 = {  # block_d <= 64 | 128
    64: {"fwd": (32, 32, 8, 2), "dkdv": (32, 32, 8, 2), "dq": (32, 32, 4, 2)},
    128: {"fwd": (32, 32, 8, 2), "dkdv": (32, 32, 8, 2), "dq": (32, 32, 8, 2)},
}
# The interpreter runs every program in Python: few, unequal blocks (tests cross block edges
# both ways); with bounds BLOCK_M = 64 and the GPU's BLOCK_N.
_INTERPRETED = {"fwd": (32, 64, 1, 1), "dkdv": (32, 64, 1, 1), "dq": (64, 32, 1, 1)}


def bounded_key_block(block_d: int, elt_size: int) -> int:
    """BLOCK_N of all three kernels with FlashMask bounds (the same compiled or interpreted)."""
    return 32 if elt_size == 4 or block_d > 64 else 64


def preset_from_env() -> str:
    preset = os.environ.get("KERNELS_ATTENTION_TILES", "default")
    if preset not in TILE_PRESETS:
        raise ValueError(f"KERNELS_ATTENTION_TILES={preset!r}: expected one of {list(TILE_PRESETS)}")
    return preset


def attention_tiles(
    kernel: str,
    block_d: int,
    elt_size: int,
    dropout: bool,
    preset: str = "default",
    bounded: int = 0,
    interpreted: bool = False,
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); ``dropout`` is in the key because the Philox
    mask costs registers; ``bounded``: the FlashMask bounds per column (1, 2 or 4; 0 without)."""
    if preset not in TILE_PRESETS:
        raise ValueError(f"attention tiles: unknown preset {preset!r}, expected one of {list(TILE_PRESETS)}")
    width = 64 if block_d <= 64 else 128
    if bounded:
        if interpreted:
            return (64, bounded_key_block(block_d, elt_size), 1, 1)
        if bounded == 4 and kernel == "fwd" and elt_size != 4 and width == 64:
            return (64, 64, 8, 2)  # 4 bounds cost the 128-row forward 8 bytes of spill
        return (_BOUNDED_FP32 if elt_size == 4 else _BOUNDED_16BIT)[width][kernel]
    if interpreted:
        return _INTERPRETED[kernel]
    if elt_size == 4:
        return _FP32[32 if block_d <= 32 else width][kernel]
    return _16BIT[(preset if width == 64 else "default", width)][kernel]  # "small" has 64 only
