"""Work across ranks that the trainer does itself: its host-side collectives, whose failures name the
collective, the step and the missing rank (``collectives``); a step's global counts agreed on the host
(``host_counts``); per-step fault tolerance across replicas on torchft (``fault_tolerance``); context
parallelism, documents split across a group of ranks (``context_parallel``).

Imports: ``data.samples``, ``data.batch``, ``data.rebalance``, ``kernels.context_parallel``, ``launch.distributed`` and
``common`` (``torch.distributed`` and torchft beside them); never the model or the trainer.
"""
