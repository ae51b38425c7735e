"""Work across ranks that the trainer does itself: host-side collectives whose failures name what
failed (``collectives``), a step's global counts agreed on the host (``host_counts``), per-step fault
tolerance on torchft (``fault_tolerance``), context parallelism (``context_parallel``).

Imports: ``data.samples``, ``data.batch``, ``data.rebalance``, ``kernels.context_parallel``, ``launch.distributed`` and
``common`` (``torch.distributed`` and torchft beside them); never the model or the trainer.
"""
