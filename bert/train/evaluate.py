"""Masked-LM evaluation: accuracy counted on the device, the eval set optionally kept there.

``masked_lm_counts`` reads nothing back (its caller reads the counts once per evaluation); labels equal to
``data.static_shapes.IGNORE`` are not counted. The cached eval set's size: [docs/step.md](../docs/step.md#the-timeline).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from data.batch import to_device
from data.static_shapes import IGNORE


@torch.no_grad()
def masked_lm_counts(model: nn.Module, batches: Iterable, device: torch.device, autocast=contextlib.nullcontext):
    """[2] int64 device tensor (correct, total) over ``batches`` (already on ``device``); no host read."""
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for batch in batches:
        with autocast():
            out = model(batch)
        labels = batch.mlm_labels
        correct = (out.mlm_logits.argmax(-1) == labels).sum()
        counts += torch.stack([correct, (labels != IGNORE).sum()])
    return counts


class EvalBatches:
    """``eval_batches(loader)``: the eval batches on the device, collated each time or (eval.cache_on_device) once."""

    def __init__(self, section, device: torch.device, collate: Callable, message: Callable[[str], None], static=None):
        self.cache_on_device, self.device, self.message = section.cache_on_device, device, message
        # static (data.static_shapes, for graphed evaluation): batches padded to its buckets.
        self.collate = collate if static is None else (lambda block: static.pad(collate(block)))
        self.cached: DeviceEvalSet | None = None

    def __call__(self, loader) -> Iterable:
        if not self.cache_on_device:
            return (to_device(self.collate(block), self.device) for block in loader)
        if self.cached is None:
            self.cached = DeviceEvalSet(loader, self.collate, self.device)
            self.message(f"eval set on the device: {len(self.cached)} batches, {self.cached.nbytes / 2**20:.1f} MiB")
        return self.cached


class DeviceEvalSet(list):
    """This rank's eval batches, collated once and kept on ``device`` (a list of them)."""

    def __init__(self, blocks: Iterable, collate: Callable, device: torch.device):
        super().__init__(to_device(collate(block), device) for block in blocks)

    @property
    def nbytes(self) -> int:
        """Bytes of device memory the cached batches hold."""
        return sum(v.nbytes for batch in self for v in vars(batch).values() if isinstance(v, Tensor))
