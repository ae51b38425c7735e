"""The training loop and its steps: ``trainer.Trainer`` (train_step, optimizer_step, evaluate), the parts built from
their config sections (``build``), losses, evaluation, CUDA graphs, per-rank step timing.

Imports: ``bert`` (every other sub-package), ``kernels``, ``data``, ``launch`` and ``common``; only
``run_pretraining.py``, ``tools`` and ``bench`` import it.
"""
