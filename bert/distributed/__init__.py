"""Work across ranks that the trainer does itself: its host-side collectives with a failure that
names the collective, the step and the missing rank (``collectives``).

Imports: ``common`` only (``torch.distributed`` beside it).
"""
