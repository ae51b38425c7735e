"""Distributed pieces of the trainer beyond data parallelism: context parallelism (documents split across ranks)."""
