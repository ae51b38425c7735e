"""Work across ranks that the trainer does itself: its host-side collectives with a failure that
names the collective, the step and the missing rank (``collectives``); a step's global counts
agreed on the host (``host_counts``); per-step fault tolerance across replicas on torchft
(``fault_tolerance``).

Imports: ``data.samples``, ``data.rebalance``, ``launch.distributed`` and ``common``
(``torch.distributed`` and torchft beside them); never the model or the trainer.
"""
