"""What the steps leave on the device for the logs, read back once per log interval.

Sits between ``optimizer_step`` and the metrics record. A step decides on the device
whether its update is applied (``bert.optim``'s ``found_inf``), so the skipped-step count,
the run of consecutive non-finite steps and the last gradient norm live on the device too,
beside AdaGC's statistics. ``read()`` packs them, with whatever else the record needs (the
all-reduced loss parts, the learning rate), into one float64 vector: one device read per
log interval, and one at a checkpoint and at the end of the run. Counts stay exact in
float64 (below 2**53).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bert.clipping import ClipStats


class DeviceCounters:
    """``skipped`` and ``in_row`` (consecutive skipped steps) as int64 device tensors."""

    def __init__(self, device: torch.device, skipped: int = 0, in_row: int = 0):
        self.skipped = torch.tensor(skipped, dtype=torch.int64, device=device)
        self.in_row = torch.tensor(in_row, dtype=torch.int64, device=device)
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=device)
        self.clip_stats: ClipStats | None = None

    def update(self, found_inf: Tensor, grad_norm: Tensor, clip_stats: ClipStats | None) -> None:
        """After a step: ``found_inf`` (0-dim bool) counts it as skipped; no host read."""
        skipped = found_inf.to(torch.int64)
        self.skipped = self.skipped + skipped
        self.in_row = (self.in_row + 1) * skipped
        self.grad_norm, self.clip_stats = grad_norm.detach(), clip_stats

    def read(self, **extra: Tensor) -> dict:
        """One read of ``skipped``, ``in_row``, ``grad_norm``, AdaGC's ``clip_stats`` (as host
        numbers in a ``ClipStats``) and every tensor in ``extra`` (as floats or lists)."""
        names = {"skipped": self.skipped, "in_row": self.in_row, "grad_norm": self.grad_norm, **extra}
        c = self.clip_stats
        if c is not None and c.num_tensors:
            names.update(num_clipped=c.num_clipped, clip_ratio=c.clip_ratio)
        flat = [t.detach().reshape(-1).to(torch.float64) for t in names.values()]
        values = torch.cat(flat).tolist()  # the one read
        out, at = {}, 0
        for name, t in zip(names, flat):
            n = t.numel()
            out[name] = values[at : at + n] if names[name].dim() else values[at]
            at += n
        out["skipped"], out["in_row"] = int(out["skipped"]), int(out["in_row"])
        if "num_clipped" in out:
            out["clip_stats"] = ClipStats(None, int(out.pop("num_clipped")), c.num_tensors, out.pop("clip_ratio"))
        else:
            out["clip_stats"] = None
        return out
