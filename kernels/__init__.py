"""The attention interface and the Triton kernels with their PyTorch references.

Modules, from the bottom up (a module imports only modules listed before it; the order is
``MODULE_LAYERS`` in tests/test_layering.py):

- ``interface``: the one attention call, its layouts (``VarlenLayout``, ``PaddedLayout``,
  ``PackedLayout``), the per-layer settings they carry (``window``), ``BackendUnavailable``;
  imports nothing of the project;
- ``masks``: FlashMask's bounds, what they mean (the dense mask), the mask builders (documents,
  documents with a window, ...) and the dense reference, pure PyTorch; ``tiles``: tile presets;
  ``grouped``: length-bucket grouping and multi-stream dispatch; ``runtime``: compiled (CUDA)
  or interpreted (CPU, TRITON_INTERPRET=1) execution;
- ``reference``: the ``reference`` and ``padded`` backends; ``triton_jit``, ``fused_ops_jit``,
  ``rotary_jit``: device code (the attention kernel family, the fused ops, the rotary kernel),
  loaded by ``runtime`` from their files;
- ``varlen_attention``: fused multi-head attention over unpadded batches, the ``triton`` and
  ``triton_grouped`` backends; ``fused_ops``: bias+GELU and bias+dropout+residual+LayerNorm;
  ``library_backends``: ``flash_attn`` and ``torch_varlen`` for comparison;
- ``flashmask``: the FlashMask kernel and the ``flashmask`` backend;
- ``registry``: every backend by name, what it takes, loaded on demand; the model (``bert/``)
  picks its backend here.

Importing the package imports neither Triton nor a kernel. Nothing here imports ``bert/``: the
interface lives below the model so that the kernels never import the model.
"""
