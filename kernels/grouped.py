"""Grouped multi-stream dispatch: one attention launch per sequence-length bucket.

Each bucket's sequences (default 128, 256, 384, 512) are one launch, on up to 4 CUDA streams;
a group is a slice of ``order`` (sequence indices by bucket, largest first), never a copy.
Planning reads the collator's host lengths (``note_host_seqlens``), else copies ``cu_seqlens``
to the host once; ``cached_plan`` plans once per ``cu_seqlens`` tensor.
[docs/kernels.md](../docs/kernels.md#grouped-dispatch-equals-one-launch).
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

DEFAULT_BUCKETS = (128, 256, 384, 512)
MAX_STREAMS = 4


@dataclass(frozen=True)
class Group:
    start: int  # first entry of the plan's order
    count: int  # number of sequences
    max_len: int  # longest sequence in the group (<= its bucket): the grid's row bound


@dataclass(frozen=True)
class GroupPlan:
    order: Tensor | None  # [B] int32 sequence indices grouped by bucket; None = 0..B-1
    groups: tuple[Group, ...]


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    b = tuple(int(x) for x in buckets)
    if not b or any(x <= 0 for x in b) or list(b) != sorted(set(b)):
        raise ValueError(f"attention buckets: expected strictly increasing positive lengths, got {list(buckets)}")
    return b


def plan_groups(seqlens: Sequence[int], buckets: Sequence[int], device=None) -> GroupPlan:
    """Group sequence indices by the smallest bucket that holds them (longer ones: one extra group),
    largest bucket first so that the longest kernels start first; sequences keep their batch order."""
    bounds = check_buckets(buckets)
    members: dict[int, list[int]] = {}
    for i, n in enumerate(seqlens):
        members.setdefault(bisect.bisect_left(bounds, n), []).append(i)  # the first bucket >= n
    order: list[int] = []
    groups = []
    for key in sorted(members, reverse=True):
        idx = members[key]
        groups.append(Group(len(order), len(idx), max(int(seqlens[i]) for i in idx)))
        order.extend(idx)
    if order == list(range(len(order))):
        return GroupPlan(None, tuple(groups))
    return GroupPlan(torch.tensor(order, dtype=torch.int32, device=device), tuple(groups))


# id(cu_seqlens) -> (a weak reference to it, its version then, its lengths as the host knows them);
# an entry is dropped when its tensor is freed, and ignored once the tensor is modified.
_HOST_SEQLENS: dict[int, tuple[weakref.ref, int, tuple[int, ...]]] = {}


def _fresh(entry: tuple | None, tensor: Tensor) -> bool:
    """Whether a cache entry (weak reference, version, value) still describes ``tensor``."""
    return entry is not None and entry[0]() is tensor and entry[1] == tensor._version


def note_host_seqlens(cu_seqlens: Tensor, seqlens: Sequence[int]) -> None:
    """Record the lengths of ``cu_seqlens``' sequences as the host knows them (the collator's),
    so that planning never reads ``cu_seqlens`` back. Only their number is checked here
    (``UnpaddedBatch.check_values`` compares the values on the CPU)."""
    lens = tuple(seqlens)
    if len(lens) != cu_seqlens.numel() - 1:
        raise ValueError(f"host_seqlens: {len(lens)} lengths for the {cu_seqlens.numel() - 1} sequences of cu_seqlens")
    key = id(cu_seqlens)
    known = _HOST_SEQLENS.get(key)
    if _fresh(known, cu_seqlens) and known[2] == lens:
        return  # every layer passes the batch's lengths again
    ref = weakref.ref(cu_seqlens, lambda _, key=key: _HOST_SEQLENS.pop(key, None))
    _HOST_SEQLENS[key] = (ref, cu_seqlens._version, lens)


def host_seqlens(cu_seqlens: Tensor) -> list[int]:
    """The sequence lengths as Python ints: those noted for this tensor (``note_host_seqlens``),
    else read from it (a device-to-host copy when cu_seqlens is on a GPU)."""
    known = _HOST_SEQLENS.get(id(cu_seqlens))
    if _fresh(known, cu_seqlens):
        return list(known[2])
    cu = cu_seqlens.tolist()
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def check_max_seqlen(seqlens: Sequence[int], max_seqlen: int) -> None:
    """max_seqlen sizes the launch grid: rows past it would never be written."""
    longest = max(seqlens, default=0)
    if longest > max_seqlen:
        raise ValueError(
            f"varlen attention: max_seqlen={max_seqlen} is smaller than the longest sequence "
            f"({longest} tokens, sequence {list(seqlens).index(longest)} of cu_seqlens)"
        )


_PLAN_CACHE: dict[tuple, tuple[weakref.ref, int, GroupPlan]] = {}
_PLAN_CACHE_SIZE = 16


def cached_plan(cu_seqlens: Tensor, max_seqlen: int, buckets: Sequence[int]) -> GroupPlan:
    """The plan for this batch; without buckets, one launch over all sequences (no sync)."""
    if not buckets:
        return GroupPlan(None, (Group(0, cu_seqlens.numel() - 1, max_seqlen),))
    key = (id(cu_seqlens), int(max_seqlen), tuple(buckets))
    hit = _PLAN_CACHE.get(key)
    if _fresh(hit, cu_seqlens):
        return hit[2]
    seqlens = host_seqlens(cu_seqlens)  # the noted host lengths, else the one host read per batch
    check_max_seqlen(seqlens, max_seqlen)
    plan = plan_groups(seqlens, buckets, cu_seqlens.device)
    if len(_PLAN_CACHE) >= _PLAN_CACHE_SIZE:
        _PLAN_CACHE.pop(next(iter(_PLAN_CACHE)))
    _PLAN_CACHE[key] = (weakref.ref(cu_seqlens), cu_seqlens._version, plan)
    return plan


_SIDE_STREAMS: dict[int, list] = {}


def _side_streams(device: torch.device, n: int) -> list:
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = _SIDE_STREAMS.setdefault(index, [])
    while len(streams) < n:
        streams.append(torch.cuda.Stream(device=index))
    return streams[:n]


Launch = Callable[[Tensor | None, int, int, int], None]  # (order, start, count, max_len)


def run_groups(plan: GroupPlan, launch: Launch, device: torch.device, num_streams: int = MAX_STREAMS) -> None:
    """Call launch once per group; on CUDA spread the groups over up to num_streams streams. Side
    streams wait for what the caller queued before (the inputs), and the caller's stream waits for
    them, so the call behaves like one ordered launch to the code around it."""
    groups = plan.groups
    n = max(1, min(num_streams, MAX_STREAMS, len(groups)))
    if device.type != "cuda" or n == 1:
        for g in groups:
            launch(plan.order, g.start, g.count, g.max_len)
        return
    main = torch.cuda.current_stream(device)
    streams = [main] + _side_streams(device, n - 1)
    for s in streams[1:]:
        s.wait_stream(main)
    for i, g in enumerate(groups):
        with torch.cuda.stream(streams[i % n]):
            launch(plan.order, g.start, g.count, g.max_len)
    for s in streams[1:]:
        main.wait_stream(s)
