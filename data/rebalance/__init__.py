"""Cross-rank rebalancing of sequence lengths, in three parts: the plan (``plan``: pure, no torch;
which rank holds which sample), the online fit of the cost model and rank speeds (``fit``), and the
exchange that moves the planned samples between ranks (``exchange.Rebalancer``).

Imports: ``data.samples``, ``data.batch_ramp`` and ``common``; ``plan`` imports no torch at all.
"""
