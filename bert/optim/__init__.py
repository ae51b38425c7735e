"""Optimizers and what steers them: LAMB, AdamW, StableAdamW (``optimizers``), sharded LAMB
(``shard``), gradient clipping and AdaGC (``clipping``), learning-rate schedules (``schedule``).

Imports: ``bert.config`` (their sections) and ``common``; never the model or the trainer.
"""
