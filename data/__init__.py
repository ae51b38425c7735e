"""Samples and batches on the runtime path: ``samples`` (a SampleBlock of numpy arrays), the HDF5
layouts (``hdf5io``), rank-sharded loading with prefetch (``loader``), collation into the batch
types (``batch``, ``collate``, ``packing``, ``dali_loader``, ``static_shapes``), the batch-size
ramp, and synthetic data for tests and benchmarks; ``rebalance`` (across ranks) and ``prepare``
(offline: text -> shards) are sub-packages.

Imports: ``common`` only; never ``bert``, ``kernels`` or ``launch``.
"""
