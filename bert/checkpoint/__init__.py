"""Weights and training state on disk: the training checkpoint (``training``: one writer, one
restore path), reading files that may come from anyone (``safe_load``), TensorFlow's phase-1
checkpoint without TensorFlow (``tf_reader``, ``convert_tf``), and transformers import/export
(``pretrained``, ``export``).

Imports: ``bert.model``, ``bert.config``, ``bert.state``, ``bert.optim``, ``bert.distributed``,
``data.prepare.tokenization`` (the vocabulary an export ships) and ``common``; never the trainer.
"""
