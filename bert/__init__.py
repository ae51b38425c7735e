"""The model and everything that trains it, by concern: ``distributed`` (work across ranks), ``model`` (the encoder
families and their transformers adapters), ``config`` (the run configuration) and ``state`` (the run's counters and
seeds), ``optim`` (optimizers, clipping, schedules), ``checkpoint`` (weights and training state on disk), ``report``
(MLPerf log, metrics, summary), ``train`` (the loop). Sub-packages import downhill in that order.

Imports: ``kernels``, ``data``, ``launch`` and ``common``; only ``run_pretraining.py``, ``tools`` and ``bench`` import
this package.
"""
