"""Tests of the training loop (bert.train: the trainer, its steps and the per-rank timing)."""
