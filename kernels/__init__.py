"""The attention interface and the Triton kernels with their PyTorch references.

Modules from the bottom up (each imports only those before it: ``MODULE_LAYERS`` in
tests/test_layering.py): ``interface`` (the one attention call, its layouts and settings,
``BackendUnavailable``; imports nothing of the project); ``masks``, ``tiles``, ``grouped``,
``runtime``; ``reference`` and the device code ``triton_jit``, ``ops.fused_jit``,
``ops.rotary_jit`` (loaded by ``runtime`` from their files); ``varlen_attention``, ``ops.fused``,
``ops.rotary``, ``ops.gemm_epilogue``, ``library_backends``; ``flashmask``; ``registry`` (every
backend by name, where the model picks one). Importing the package imports neither Triton
nor a kernel, and nothing here imports ``bert/``.
"""
