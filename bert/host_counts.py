"""A step's global counts, agreed between ranks on the host a step ahead: no device read.

Sits between the loader (or the rebalancer) and ``train_step``. The losses are normalised by
global counts (masked positions, sequences, SimReg anchors), the summary adds up tokens and
corrupt samples, and a stop request (SIGTERM) must reach every rank at the same step. All of
it is known on the host from the data: every count is a sum over samples, so it does not
change when the rebalancer moves samples between ranks, and it can be summed over ranks
from the blocks the loader hands out, before any exchange.

``CountAgreement.start(step, local)`` sums the ranks' ``local`` counts (``local_counts``)
with one all-reduce of 6 int64 words on a CPU gloo group of its own, in a background thread;
the trainer starts step s+1's while step s computes and collects it with ``wait()`` at step
s+1, so the device never waits for it and the host rarely does. With one rank nothing is
exchanged. A failure surfaces in ``wait()``, where the trainer's ``Collectives.guard`` names
the collective, the step and the missing ranks.

A stop request is sampled when step s+1's agreement starts, i.e. while step s runs, so it
takes effect one step later than the step that saw it; every rank stops at the same step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from bert.losses import simreg_anchor_count
from data.samples import SampleBlock

FIELDS = ("masked", "sequences", "tokens", "stop", "anchors", "corrupt")


@dataclass(frozen=True)
class StepCounts:
    """Global counts of one step (sums over ranks), host ints."""

    masked: int
    sequences: int
    tokens: int
    stop: bool
    anchors: int
    corrupt: int


def local_counts(block: SampleBlock, stop: bool, corrupt: int, simreg_scope: str | None) -> np.ndarray:
    """[6] int64: this rank's share of ``FIELDS``; anchors only when SimReg is on (scope given)."""
    anchors = (
        simreg_anchor_count(
            block.seq_lens, block.input_ids, block.masked_positions, block.masked_ids, block.masked_counts, simreg_scope
        )
        if simreg_scope is not None
        else 0
    )
    return np.array(
        [int(block.masked_counts.sum()), len(block), block.num_tokens, int(stop), anchors, corrupt], dtype=np.int64
    )


class CountAgreement:
    """Sums per-step host counts over ranks, one step ahead, on its own gloo group.

    Build it on every rank at the same point (``new_group`` is collective and ordered).
    """

    def __init__(self, world_size: int, timeout_s: float):
        self.world_size = world_size
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if world_size > 1 else None
        self._thread: threading.Thread | None = None
        self._result: np.ndarray | BaseException | None = None
        self._step: int | None = None

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def start(self, step: int, local: np.ndarray) -> None:
        """Begin summing ``local`` (from ``local_counts``) for ``step``."""
        if self._thread is not None:
            raise RuntimeError("CountAgreement.start: the previous agreement was not collected with wait()")
        self._step = step
        if self.group is None:
            self._result = np.asarray(local, dtype=np.int64)
            return

        def run():
            try:
                words = torch.from_numpy(np.array(local, dtype=np.int64))
                dist.all_reduce(words, group=self.group)
                self._result = words.numpy()
            except BaseException as e:  # re-raised by wait(), on the caller's thread
                self._result = e

        self._result = None
        self._thread = threading.Thread(target=run, name=f"step-counts-{step}", daemon=True)
        self._thread.start()

    def wait(self, step: int) -> StepCounts:
        """The agreed counts of ``step`` (the one started last); re-raises a failed collective."""
        if self._step != step:
            raise RuntimeError(f"CountAgreement.wait: step {step} asked for, step {self._step} was started")
        if self._thread is not None:
            self._thread.join()  # the gloo group's timeout bounds the collective
            self._thread = None
        result, self._result, self._step = self._result, None, None
        if isinstance(result, BaseException):
            raise result
        masked, sequences, tokens, stop, anchors, corrupt = (int(x) for x in result)
        return StepCounts(masked, sequences, tokens, stop > 0, anchors, corrupt)


class StepPlanner:
    """This rank's block of every step and the step's agreed counts, a step ahead.

    ``next_block(step)`` returns the block of ``step`` (after the rebalancer's exchange when
    there is one) and draws the block of ``step + 1`` from the loader. ``start_ahead(step,
    stop)`` begins agreeing on ``step + 1``'s counts from that drawn block (before any
    exchange: the sums are the same), with ``stop`` sampled now, and ``finish_ahead(step)``
    collects them into ``current``. The trainer starts step s+1's agreement as step s begins
    and collects it once step s's work is queued, so a stop request seen at the start of
    step s stops the run after step s on every rank, as the counts all-reduce it replaces did.
    """

    def __init__(self, batches, loader, rebalancer, agreement: CountAgreement, coll, simreg_scope: str | None):
        self.batches, self.loader, self.rebalancer = batches, loader, rebalancer
        self.agreement, self.coll, self.simreg_scope = agreement, coll, simreg_scope
        self._upcoming: SampleBlock | None = None  # the drawn block of the next step (this rank's, pre-exchange)
        self.current: StepCounts | None = None  # the agreed counts of the step about to run

    def begin(self, step: int, stop: bool) -> None:
        """Draw ``step``'s block and agree on its counts (blocking: before the first step)."""
        self._upcoming = next(self.batches)
        if self.rebalancer:
            self.rebalancer.start(self._upcoming, step=step)
        self.start_ahead(step - 1, stop)
        self.finish_ahead(step - 1)

    def next_block(self, step: int):
        """(block of ``step``, the rebalancer's stats or None); draws the block of ``step + 1``."""
        if self.rebalancer:
            # This step's samples, exchanged while the previous step computed; the next
            # step's exchange now runs behind this one.
            with self.coll.guard("the rebalancing exchange", step + 1):
                block, rebalance = self.rebalancer.wait()
            self._upcoming = next(self.batches)
            self.rebalancer.start(self._upcoming, step=step + 1)
            return block, rebalance
        block, self._upcoming = self._upcoming, next(self.batches)
        return block, None

    def start_ahead(self, step: int, stop: bool) -> None:
        """Begin agreeing on the counts of ``step + 1`` (its block is the one drawn last)."""
        corrupt = self.loader.pop_substituted(step + 1)
        self.agreement.start(step + 1, local_counts(self._upcoming, stop, corrupt, self.simreg_scope))

    def finish_ahead(self, step: int) -> StepCounts:
        """Collect the counts of ``step + 1`` into ``current``."""
        with self.coll.guard("the step-counts all-reduce", step + 2):
            self.current = self.agreement.wait(step + 1)
        return self.current

    def drain(self) -> None:
        """Collect the exchange started for a step that will not run (every rank started it)."""
        if self.rebalancer and self.rebalancer.pending:
            self.rebalancer.wait()
