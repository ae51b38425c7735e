"""What a run reports: the MLPerf log (``mlperf_log``), a record per logged step, the summary and
the curves (``metrics``), TensorBoard events (``tensorboard``).

Imports: ``bert.config``, ``bert.optim`` (clipping stats), ``bert.checkpoint``, ``bert.train.state``,
``launch`` and ``common``; never the trainer.
"""
