"""The training state: the run's counters in one object (``TrainState``, a checkpoint's ``"counters"`` entry, field
names as keys), and the run's seeds (``resolve_seed``, ``seed_step``).
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

import numpy as np
import torch

from bert.distributed.collectives import Collectives
from common.errors import CheckpointError
from kernels.runtime import seed_philox_


@dataclass
class TrainState:
    step: int = 0  # optimizer steps run (applied or skipped)
    samples: int = 0  # training samples, over all ranks
    tokens: int = 0  # training tokens, over all ranks
    skipped: int = 0  # steps whose update was skipped (non-finite gradients)
    nonfinite_in_row: int = 0  # consecutive skipped steps, up to the last one
    train_seconds: float = 0.0  # time in the steps, summed over resumed runs
    last_eval_samples: int = 0  # samples trained at the last evaluation
    eval_accuracy: float | None = None  # the last evaluation's masked-LM accuracy
    corrupt_samples: int = 0  # corrupt training samples replaced (data.on_corrupt=skip)
    checkpoint_failures: int = 0  # checkpoints that could not be written
    seed: int | None = None  # the run's seed (train.seed, or drawn by rank 0)

    def counters(self) -> dict:
        """The checkpoint's ``"counters"`` entry."""
        return dataclasses.asdict(self)

    @classmethod
    def from_counters(cls, counters: dict) -> TrainState:
        """The state a checkpoint's ``"counters"`` entry holds; CheckpointError names a value
        of the wrong kind. Counters that earlier code did not save start at their defaults."""
        for f in dataclasses.fields(cls):
            value = counters.get(f.name)
            if f.name in _ADDED_LATER and value is None:
                continue
            if f.type in ("int", "int | None"):
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise CheckpointError(f"counter {f.name!r} is {value!r}, not an integer >= 0")
            elif not isinstance(value, (int, float)) or isinstance(value, bool):
                raise CheckpointError(f"counter {f.name!r} is {value!r}, not a number")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in counters.items() if k in known and v is not None})


_ADDED_LATER = ("eval_accuracy", "corrupt_samples", "checkpoint_failures", "seed")


def resolve_seed(train_seed: int | None, found: dict | None, coll: Collectives, device: torch.device) -> int:
    """The run's seed: a resumed run's own (``found``, its checkpoint), else train.seed, else one rank 0 draws."""
    if found is not None and found["counters"].get("seed") is not None:
        return int(found["counters"]["seed"])
    if train_seed is not None:
        return train_seed
    drawn = secrets.randbits(31) if coll.rank == 0 else 0
    return int(coll.all_reduce(torch.tensor([drawn], dtype=torch.int64, device=device), "the seed broadcast", 0))


def step_seed(seed: int, step: int, rank: int, stream: int = 0) -> int:
    """A 63-bit seed for (run seed, step, rank); stream 0: torch's generators, stream 1: the kernels' Philox state."""
    words = [seed, step, rank] + ([stream] if stream else [])
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] >> 1)


def seed_step(seed: int, step: int, rank: int, philox: torch.Tensor) -> None:
    """Dropout's seeds for one step, from (run seed, step, rank) alone: torch's generators and the kernels' device
    Philox state ``philox`` (set from the host, no read of the device). So a resumed run draws exactly the masks an
    uninterrupted one would, with no RNG state saved."""
    torch.manual_seed(step_seed(seed, step, rank))
    seed_philox_(philox, step_seed(seed, step, rank, stream=1))
