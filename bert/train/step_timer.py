"""This rank's forward+backward compute time per training step, for ``data.rebalance=measured``.

Hooks on the model, no line in the step: a training-mode forward starts an interval, the last gradient accumulated in
its backward ends it, before DDP waits for the other ranks; CUDA events read with ``query()`` (never a device wait), or
``time.perf_counter`` on the CPU (docs/rebalancing.md). ``mark(step)`` files what was recorded since the last mark
under that step; ``ready()`` gives (step, seconds) of the filed steps whose events completed, oldest first.
"""

from __future__ import annotations

import time
from collections import deque

import torch


class StepTimer:
    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self._tag, self._start, self._last, self._open = None, None, None, []
        self._closed: deque = deque(maxlen=8)  # (step, [(start, end), ...]) not yet read
        model.register_forward_pre_hook(lambda m, args: self._begin() if m.training else None)
        # The span ends at the last gradient accumulated. Which parameter that is depends on the model
        # (the first in parameters() may be a head's bias, whose gradient comes first): every one marks it.
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._end)

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _begin(self) -> None:
        self._close()
        self._start = self._now()

    def _end(self, param) -> None:
        if self._start is not None:  # a backward without a timed forward is left out
            self._last = self._now()

    def _close(self) -> None:
        if self._start is not None and self._last is not None:
            self._open.append((self._start, self._last))
        self._start = self._last = None

    def mark(self, step: int) -> None:
        self._close()
        if self._tag is not None and self._open:
            self._closed.append((self._tag, self._open))
        self._tag, self._open = step, []

    def ready(self) -> list[tuple[int, float]]:
        out = []
        while self._closed and not (self.cuda and not all(e.query() for _, e in self._closed[0][1])):
            step, spans = self._closed.popleft()
            out.append((step, sum(s.elapsed_time(e) / 1e3 if self.cuda else e - s for s, e in spans)))
        return out
