"""Offline dataset tools, apart from the runtime path: text -> MLPerf-format HDF5 shards
(``shards``, run as ``python -m data.prepare``), the text reader and tokenizers, MLPerf's reference
pipeline (``mlperf_reference``, ``mlperf_dataset``), checksums (``verify``), layout conversion,
statistics and the demo corpus.

Imports: ``data.samples``, ``data.hdf5io`` and ``common``; of this package the trainer imports
only the vocabulary reader that an export ships.
"""
