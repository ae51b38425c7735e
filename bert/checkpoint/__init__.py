"""Weights and training state on disk: the training checkpoint (``training``: one writer, one
restore path), reading files that may come from anyone (``safe_load``), TensorFlow's phase-1
checkpoint without TensorFlow (``tf_reader``, ``convert_tf``), and transformers import/export
(``pretrained``, ``export``).

Imports: ``bert.model``, ``bert.optim``, ``bert.distributed``, ``bert.config``, ``common``; never the trainer.
"""
