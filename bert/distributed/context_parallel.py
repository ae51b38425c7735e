"""Context parallelism, the model side: which ranks form a CP group, and a group's batch cut into one batch per rank.

A CP group is N consecutive ranks inside data parallelism that share the documents longer than
``threshold`` tokens. ``split_batch`` gives this rank its whole short sequences, then its piece of every
long document (``kernels.context_parallel.ContextShard``); ``ContextPool`` does it per micro-batch in the
trainer. Attention across ranks: ``kernels.context_parallel``; docs/context_parallel.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from itertools import accumulate

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from data.batch import UnpaddedBatch
from data.samples import SampleBlock
from kernels.context_parallel import ContextShard

NO_NSP = -100  # F.cross_entropy's ignore_index: the NSP label of a piece without [CLS]


@dataclass
class ContextBatch:
    """One rank's share of its CP group's batch: ``batch`` holds shard.seqlens' sequences."""

    batch: UnpaddedBatch
    shard: ContextShard

    def _map(self, fn) -> ContextBatch:
        return ContextBatch(self.batch._map(fn), self.shard)

    def to(self, device, non_blocking: bool = False) -> ContextBatch:
        return ContextBatch(self.batch.to(device, non_blocking=non_blocking), self.shard)

    @property
    def num_sequences(self) -> int:
        return self.batch.num_sequences

    @property
    def mlm_labels(self) -> Tensor:  # the loss reads the labels as from an UnpaddedBatch
        return self.batch.mlm_labels

    @property
    def nsp_labels(self) -> Tensor:
        return self.batch.nsp_labels


@dataclass(frozen=True)
class ContextGroups:
    """This rank's CP group."""

    group: object  # a ProcessGroup, or None when the group is the whole world
    index: int  # among the world's groups
    rank: int  # this rank's place in it
    size: int


def context_groups(size: int) -> ContextGroups:
    """The CP groups of N = ``size`` consecutive ranks (every rank creates every group, as
    ``dist.new_group`` asks). ValueError unless N divides the world size."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(f"dist.context_parallel={size}: must divide the world size {world}")
    if size == world:
        return ContextGroups(None, 0, rank, size)
    return ContextGroups(_every_group(size, rank // size), rank // size, rank % size, size)


def _every_group(size: int, index: int, **options):
    """Every group of ``size`` consecutive ranks created (``dist.new_group`` is collective); returns group ``index``."""
    ranks = range(dist.get_world_size())
    return [dist.new_group(list(ranks[g : g + size]), **options) for g in range(0, len(ranks), size)][index]


def split_batch(
    batch: UnpaddedBatch, rank: int, size: int, threshold: int, owners: Sequence[int] | None = None
) -> ContextBatch:
    """The group's ``batch`` (on the host) -> rank ``rank``'s ContextBatch.

    Sequences longer than ``threshold`` tokens are split over the ``size`` ranks; each other
    sequence b stays whole on rank ``owners[b]`` (default: b % size, in batch order)."""
    lens, cu = batch.seqlens.tolist(), batch.cu_seqlens.tolist()
    if owners is None:
        owners = [b % size for b in range(len(lens))]
    if len(owners) != len(lens) or any(not 0 <= o < size for o in owners):
        raise ValueError(f"split_batch: owners must give a rank in [0, {size}) for each of {len(lens)} sequences")
    long = [b for b, n in enumerate(lens) if n > threshold]
    whole = [b for b, n in enumerate(lens) if n <= threshold and owners[b] == rank]
    shard = ContextShard(rank, size, tuple(lens[b] for b in whole), tuple(lens[b] for b in long))
    # (sequence, first token, end) of this rank's whole sequences, then of its pieces of the long ones
    spans = [(b, 0, lens[b]) for b in whole] + [(long[d], start, end) for d, start, end in shard.pieces()]
    rows = [torch.arange(cu[b] + start, cu[b] + end) for b, start, end in spans]
    nsp = [int(batch.nsp_labels[b]) if start == 0 else NO_NSP for b, start, _ in spans]
    rows_T = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    local = torch.full((batch.num_tokens,), -1, dtype=torch.long)
    local[rows_T] = torch.arange(rows_T.numel())
    m_local = local[batch.mlm_positions.long()]
    here = m_local >= 0  # masked positions keep their order, among this rank's tokens
    seqlens = shard.seqlens
    cu_local = torch.tensor([0, *accumulate(seqlens)], dtype=torch.int32)
    local_batch = UnpaddedBatch(
        input_ids=batch.input_ids[rows_T],
        segment_ids=batch.segment_ids[rows_T],
        position_ids=batch.position_ids[rows_T],  # the place in the whole document: positions restart per sequence
        cu_seqlens=cu_local,
        max_seqlen=max(seqlens, default=0),
        mlm_positions=m_local[here],
        mlm_labels=batch.mlm_labels[here],
        nsp_labels=torch.tensor(nsp, dtype=batch.nsp_labels.dtype),
        host_seqlens=tuple(seqlens),
    )
    return ContextBatch(local_batch, shard)


class ContextPool:
    """Per micro-batch: this rank's SampleBlock -> its ContextBatch; the group all-gathers its ranks' long
    samples over gloo (``host_group``) and every rank splits the same list. Build it on every rank at the
    same point (it creates process groups)."""

    def __init__(self, size: int, threshold: int, timeout_s: float):
        self.groups, self.threshold = context_groups(size), threshold
        timeout = timedelta(seconds=timeout_s)
        self.host_group = _every_group(size, self.groups.index, backend="gloo", timeout=timeout)

    def __call__(self, block: SampleBlock, collate: Callable[[SampleBlock], UnpaddedBatch]) -> ContextBatch:
        long = block.seq_lens > self.threshold
        gathered: list = [None] * self.groups.size
        dist.all_gather_object(gathered, block.select(np.flatnonzero(long)), group=self.host_group)
        short = block.select(np.flatnonzero(~long))
        pooled = SampleBlock.concat([short, *gathered])
        owners = [self.groups.rank] * len(short) + [0] * (len(pooled) - len(short))  # the long ones are split
        return split_batch(collate(pooled), self.groups.rank, self.groups.size, self.threshold, owners)
