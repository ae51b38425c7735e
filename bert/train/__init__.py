"""The training loop and its steps: ``trainer.Trainer`` (train_step, optimizer_step, evaluate),
the parts built from their config sections (``build``), losses, evaluation, the host-side step
plan (``host_counts``), CUDA graphs, per-rank step timing, the training state.

Imports: every other ``bert`` package, ``kernels``, ``data``, ``launch``, ``common``; only
``run_pretraining.py`` and ``bench/`` import it.
"""
