"""A step's global counts, agreed between ranks on the host: no device read.

The losses' normalisers, the summary's counts and a stop request are sums over samples, known on the
host and unchanged by rebalancing: ``CountAgreement`` sums the ranks' ``local_counts`` in one all-reduce
on a gloo group of its own; ``StepPlanner`` agrees on each drawn block's counts as the step begins.
Why this hides behind the device's queued work: [docs/step.md](../docs/step.md#the-timeline).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from data.samples import SampleBlock


def simreg_anchor_count(seq_lens, input_ids, masked_positions, masked_ids, masked_counts, scope: str = "masked") -> int:
    """SimReg's anchor count for samples given as flat numpy arrays (a ``SampleBlock``'s): the tokens
    (masked ones, or all with scope "all") that share their label with another token of their sequence."""
    if scope == "masked":
        seq = np.repeat(np.arange(len(masked_counts)), masked_counts)
        labels = np.asarray(masked_ids, dtype=np.int64)
    else:
        labels = np.asarray(input_ids, dtype=np.int64).copy()
        starts = np.concatenate([[0], np.cumsum(seq_lens)[:-1]]).astype(np.int64)
        flat = np.repeat(starts, masked_counts) + np.asarray(masked_positions, dtype=np.int64)
        labels[flat] = masked_ids
        seq = np.repeat(np.arange(len(seq_lens)), seq_lens)
    if labels.size == 0:
        return 0
    keys = seq.astype(np.int64) * (int(labels.max()) + 1) + labels
    _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    return int((counts[inverse] >= 2).sum())


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
    """[6] int64: this rank's share of ``StepCounts``' fields, in order; anchors only with SimReg (a scope)."""
    arrays = (block.seq_lens, block.input_ids, block.masked_positions, block.masked_ids, block.masked_counts)
    anchors = 0 if simreg_scope is None else simreg_anchor_count(*arrays, simreg_scope)
    return np.array(
        [int(block.masked_counts.sum()), len(block), block.num_tokens, int(stop), anchors, corrupt], dtype=np.int64
    )


class CountAgreement:
    """Sums per-step host counts over ranks on its own gloo group, one all-reduce per step; build it on
    every rank at the same point (``new_group`` is collective and ordered)."""

    def __init__(self, world_size: int, timeout_s: float):
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if world_size > 1 else None

    def agree(self, local: np.ndarray) -> StepCounts:
        """``local`` (from ``local_counts``) summed over ranks; the group's timeout bounds the wait."""
        words = np.array(local, dtype=np.int64)
        if self.group is not None:
            dist.all_reduce(torch.from_numpy(words), group=self.group)  # in place: the tensor is words' memory
        masked, sequences, tokens, stop, anchors, corrupt = (int(x) for x in words)
        return StepCounts(masked, sequences, tokens, stop > 0, anchors, corrupt)


class StepPlanner:
    """This rank's block of every step (after the rebalancer's exchange, which ran behind the previous
    step), and the step's counts, of the blocks as drawn, agreed over ranks as the step begins with the
    stop request sampled then (it stops every rank after that step)."""

    def __init__(self, loader, rebalancer, agreement: CountAgreement, coll, simreg_scope: str | None):
        self.batches, self.loader, self.rebalancer = iter(loader), loader, rebalancer
        self.agreement, self.coll, self.simreg_scope = agreement, coll, simreg_scope
        self._drawn: dict[int, SampleBlock] = {}  # this rank's blocks as drawn (before any exchange)

    def begin(self, step: int) -> None:
        """Before the first step: with a rebalancer, start exchanging ``step``'s block."""
        if self.rebalancer:
            self._drawn[step] = next(self.batches)
            self.rebalancer.start(self._drawn[step], step=step)

    def next_block(self, step: int):
        """(block of ``step``, the rebalancer's stats or None)."""
        if not self.rebalancer:
            self._drawn[step] = next(self.batches)
            return self._drawn[step], None
        # This step's samples were exchanged while the previous step computed; the next one's runs behind this.
        with self.coll.guard("the rebalancing exchange", step + 1):
            block, rebalance = self.rebalancer.wait()
        self._drawn[step + 1] = next(self.batches)
        self.rebalancer.start(self._drawn[step + 1], step=step + 1)
        return block, rebalance

    def agree(self, step: int, stop: bool) -> StepCounts:
        """The global counts of ``step`` (its drawn block's, summed over ranks) and stop request."""
        drawn = self._drawn.pop(step)
        local = local_counts(drawn, stop, self.loader.pop_substituted(step), self.simreg_scope)
        with self.coll.guard("the step-counts all-reduce", step + 1):
            return self.agreement.agree(local)

    def drain(self) -> None:
        """Collect the exchange started for a step that will not run (every rank started it)."""
        if self.rebalancer and self.rebalancer.pending:
            self.rebalancer.wait()
