"""What a run reports: the MLPerf log (``mlperf_log``), a record per logged step, the summary and
the curves (``metrics``), TensorBoard events (``tensorboard``).

Imports: ``bert.config``, ``bert.state``, ``bert.model`` (FP8 statistics), ``bert.optim`` (clipping
statistics), ``bert.checkpoint``, ``launch`` and ``common``; never the trainer.
"""
