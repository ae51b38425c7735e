"""Distributed training beyond one process group: per-step fault tolerance across replicas (torchft)."""
