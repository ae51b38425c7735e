"""Batch-size warm-up (ModernBERT's recipe), between the loader and the trainer's step planner:
the global batch grows in units of one micro-batch on every rank (``BatchRamp``), and
``RampedLoader`` hands out a step's units of a ``PretrainingLoader`` as one block.
[docs/modern_encoders.md](../docs/modern_encoders.md#objective-and-schedule).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from common.errors import DataError
from data.samples import SampleBlock


@dataclass(frozen=True)
class BatchRamp:
    """k(s) = start + floor(s * (full - start) / steps) units in step s < steps, then ``full``."""

    unit: int  # global sequences of one unit (train.global_batch_size / train.grad_accum_steps)
    start: int  # units at step 0, 1 <= start < full (train.batch_size_warmup[0] in units)
    full: int  # units of the full batch (train.grad_accum_steps)
    steps: int  # steps of the ramp, >= 1

    def __post_init__(self):
        if not (self.unit >= 1 and 1 <= self.start < self.full and self.steps >= 1):
            raise ValueError(f"BatchRamp: need unit >= 1, 1 <= start < full and steps >= 1, got {self}")

    def units(self, step: int) -> int:
        """Units (micro-batches on every rank) in step ``step`` (from 0)."""
        if step >= self.steps:
            return self.full
        return self.start + step * (self.full - self.start) // self.steps

    def batch_size(self, step: int) -> int:
        """Global sequences in step ``step``."""
        return self.unit * self.units(step)

    def units_before(self, step: int) -> int:
        """Units drawn by steps 0 .. step - 1: the loader's position when step ``step`` begins."""
        ramp = sum(self.units(s) for s in range(min(step, self.steps)))
        return ramp + self.full * max(0, step - self.steps)


class RampedLoader:
    """A ``PretrainingLoader`` planned at ``ramp.unit`` sequences per step, drawn ``ramp.units(s)``
    steps at a time: this rank's block of step s. It has the loader's interface in steps of the
    ramp; the ``step`` in its state is the ramp's, the inner loader's is derived from it."""

    def __init__(self, loader, ramp: BatchRamp):
        if loader.global_batch_size != ramp.unit:
            raise ValueError(f"RampedLoader: the loader's batch {loader.global_batch_size} is not the unit {ramp.unit}")
        self.loader, self.ramp = loader, ramp
        self.files = loader.files
        self._step = 0
        self._substituted: dict[int, int] = {}

    @property
    def step(self) -> int:
        """The ramp step whose block the iterator yields next."""
        return self._step

    def __iter__(self):
        inner = iter(self.loader)
        while True:
            step, first = self._step, self.loader.step
            k = self.ramp.units(step)
            block = SampleBlock.concat([next(inner) for _ in range(k)])
            self._substituted[step] = sum(self.loader.pop_substituted(u) for u in range(first, first + k))
            self._step = step + 1
            yield block

    def pop_substituted(self, step: int) -> int:
        """Corrupt samples replaced in this rank's block of ramp step ``step``."""
        return self._substituted.pop(step, 0)

    def state_dict(self) -> dict:
        return {**self.loader.state_dict(), "step": self._step, "batch_size_warmup": asdict(self.ramp)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved ramp step; the ramp must be the one the position was counted in."""
        saved = state.get("batch_size_warmup")
        if saved != asdict(self.ramp):
            raise DataError(
                f"loader state: batch-size warm-up {saved} differs from this run's {asdict(self.ramp)} "
                "(train.batch_size_warmup, train.global_batch_size, train.grad_accum_steps); "
                "the saved position was counted in another ramp"
            )
        step = state.get("step")
        if not isinstance(step, int) or step < 0:
            raise DataError(f"loader state: step {step!r} must be an int >= 0")
        self.loader.load_state_dict({**state, "step": self.ramp.units_before(step)})
        self._step = step
        self._substituted.clear()

    def close(self) -> None:
        self.loader.close()
