"""This rank's forward+backward compute time per training step, for ``data.rebalance=measured``.

Hooks on the model, no line in the step: each training-mode forward starts an interval and
the gradient of the first parameter (the embeddings, whose gradient is accumulated last)
ends it; the gradient all-reduce's final wait, which waits for the slowest rank, comes after
and is not counted. CUDA events on a GPU, read with ``query()`` (never a device wait), so a
step's time is known a step or two late; ``time.perf_counter`` on the CPU.

``mark(step)`` (the rebalancer, as it hands out a step's block) closes what was recorded
since the last mark under the previous step; ``ready()`` returns (step, seconds) of every
closed step whose events have completed, oldest first. See docs/rebalancing.md.
"""

from __future__ import annotations

import time
from collections import deque

import torch


class StepTimer:
    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self._tag, self._start, self._open = None, None, []
        self._closed: deque = deque(maxlen=8)  # (step, [(start, end), ...]) not yet read
        last = next(p for p in model.parameters() if p.requires_grad)
        model.register_forward_pre_hook(lambda m, args: self._begin() if m.training else None)
        last.register_post_accumulate_grad_hook(lambda p: self._end())

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _begin(self) -> None:
        self._start = self._now()

    def _end(self) -> None:
        if self._start is not None:  # a backward without a timed forward (none in training) is left out
            self._open.append((self._start, self._now()))
            self._start = None

    def mark(self, step: int) -> None:
        """What was recorded since the last mark belongs to that mark's step; now ``step`` runs."""
        if self._tag is not None and self._open:
            self._closed.append((self._tag, self._open))
        self._tag, self._open = step, []

    def ready(self) -> list[tuple[int, float]]:
        """(step, seconds) of the closed steps whose times are known, oldest first."""
        out = []
        while self._closed:
            step, spans = self._closed[0]
            if self.cuda and not all(end.query() for _, end in spans):
                break
            self._closed.popleft()
            dt = (s.elapsed_time(e) / 1e3 for s, e in spans) if self.cuda else (e - s for s, e in spans)
            out.append((step, sum(dt)))
        return out
