"""The attention interface and the Triton kernels with their PyTorch references.

- ``attention``: the one attention call, its layouts (``VarlenLayout``, ``PaddedLayout``,
  ``PackedLayout``), ``BackendUnavailable``, the backend registry and the ``reference`` and
  ``padded`` backends; the model (``bert/``) picks a backend from it by name;
- ``varlen_attention``: fused multi-head attention over unpadded batches (forward, backward,
  Philox dropout), the ``triton`` and ``triton_grouped`` attention backends;
- ``grouped``: length-bucket grouping and multi-stream dispatch;
- ``fused_ops``: bias+GELU and bias+dropout+residual+LayerNorm;
- ``library_backends``: ``flash_attn`` and ``torch_varlen`` for comparison;
- ``runtime``: compiled (CUDA) or interpreted (CPU, TRITON_INTERPRET=1) execution;
- ``jit_kernels``: the device code; ``compile_check``: compile it all for sm_90 anywhere.

Importing the package imports neither Triton nor a kernel; ``backends.load(name)`` is what
``attention.get_backend`` calls. Nothing here imports ``bert/``: the interface lives below the
model so that the kernels never import the model.
"""
