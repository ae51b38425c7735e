"""Tile sizes of the attention kernel family (``kernels/triton_jit.py``), per (dtype, head
dim, dropout, bounds), on a GPU and in Triton's interpreter: the one table.

``attention_tiles(kernel, block_d, elt_size, dropout, preset, bounded, interpreted)`` gives
(BLOCK_M, BLOCK_N, num_warps, num_stages) for kernel in ``fwd``, ``dkdv``, ``dq``. Every GPU
entry compiles for sm_90 with 0 register spill bytes: ``python -m tools.compile_check
--registers`` builds every combination and fails on a spill (docs/kernels.md lists registers
and occupancy). With FlashMask bounds (``bounded``) the three kernels share one BLOCK_N, the
block of the per-block min/max of the bounds; a window needs no entries of its own.

Presets: ``default``, and ``small`` (head dim <= 64, fp16/bf16 only: 4 warps and smaller
tiles, so 2 blocks fit on an SM instead of 1). Which is faster is measured, not guessed:
``bench/gpu_check.sh`` times both at BERT-large's shape and reports the winner; set
``KERNELS_ATTENTION_TILES=small`` to use the other one. Pure Python (no Triton import).
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
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); ``dropout`` is part of the key because the
    Philox mask costs registers (today's table happens to need no separate entries);
    ``bounded``: the FlashMask bounds per column (1, 2 or 4; 0 without)."""
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
    if preset == "small" and width == 64:
        return _16BIT[("small", 64)][kernel]
    return _16BIT[("default", width)][kernel]
