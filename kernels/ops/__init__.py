"""Fused elementwise ops of a layer, each a Triton kernel beside its PyTorch reference: bias+GELU
and bias+dropout+residual+LayerNorm (``fused``), rotary embedding (``rotary``), the FFN-in GEMM
with a bias+GELU epilogue (``gemm_epilogue``); ``*_jit`` files hold the device code that
``kernels.runtime`` loads.

Imports: ``kernels.interface`` and ``kernels.runtime`` only.
"""
