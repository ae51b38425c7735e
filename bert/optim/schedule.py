"""Learning-rate schedules: linear warm-up then polynomial decay to ``end_lr`` (MLPerf BERT's reference
``create_optimizer``), or warmup-stable-decay (ModernBERT's); the formulas: docs/training.md, "Optimizer, schedule and
clipping". The trainer calls ``schedule.step()`` after every applied update.

Each formula is written once, for a python int step (the host) or a 0-dim step tensor (the device, no host read):
``_where``/``_clamp``/``_sqrt`` take either, and the two values are equal bitwise.
"""

from __future__ import annotations

import math

import torch

from bert.config import OptimSection


def _where(cond, a, b):
    """``a if cond else b``; with a tensor ``cond``, elementwise (float64 tensors beside it)."""
    if not isinstance(cond, torch.Tensor):
        return a if cond else b
    a, b = (x if isinstance(x, torch.Tensor) else torch.full_like(cond, x, dtype=torch.float64) for x in (a, b))
    return torch.where(cond, a, b)


def _clamp(x, least=None, most=None):
    if isinstance(x, torch.Tensor):
        return torch.clamp(x, least, most)
    return min(max(x, least) if least is not None else x, most) if most is not None else max(x, least)


def _sqrt(x):
    return torch.sqrt(x) if isinstance(x, torch.Tensor) else math.sqrt(x)


def _float64(step):
    """The step as a double: a python float, or a float64 tensor beside a step tensor."""
    return step.to(torch.float64) if isinstance(step, torch.Tensor) else float(step)


def poly_lr_at(step, *, base_lr: float, total_steps: int, warmup_steps=0, start_warmup_step=0, power=1.0, end_lr=0.0):
    """Learning rate of update ``step`` (0-based; an int, or a 0-dim tensor for a float64 tensor beside it): warm-up
    from ``start_warmup_step``, then polynomial decay."""
    g = _float64(step)
    progress = _clamp(g, most=total_steps) / total_steps
    lr = (base_lr - end_lr) * (1.0 - progress) ** power + end_lr
    if warmup_steps > 0:
        w = g - start_warmup_step
        lr = _where(w < warmup_steps, base_lr * _clamp(w, least=0) / warmup_steps, lr)
    return lr


def wsd_lr_at(
    step, *, base_lr: float, total_steps: int, warmup_steps=0, decay_steps=0, decay_shape="1-sqrt", end_lr=0.0
):
    """Warmup-stable-decay (ModernBERT's, docs/modern_encoders.md): a linear warm-up over ``warmup_steps`` to
    ``base_lr``, constant, then over the last ``decay_steps`` of ``total_steps`` a decay to ``end_lr``, linear or 1-sqrt
    (lr = end + (base - end) * (1 - sqrt(p)) at progress p of the decay). Step as ``poly_lr_at``'s; past ``total_steps``
    the rate stays ``end_lr``."""
    g = _float64(step)
    decay_start = total_steps - decay_steps
    p = _clamp((g - decay_start) / decay_steps, 0.0, 1.0) if decay_steps else 1.0
    shape = 1.0 - _sqrt(p) if decay_shape == "1-sqrt" else 1.0 - p
    lr = _where(g < decay_start, base_lr, end_lr + (base_lr - end_lr) * shape)
    if warmup_steps > 0:
        lr = _where(g < warmup_steps, base_lr * g / warmup_steps, lr)
    return lr


class WarmupDecaySchedule:
    """Sets each update's rate in every group of ``optimizer``: ``poly_lr_at`` over ``max_steps``, or for
    ``optim.schedule`` wsd / wsd_linear ``wsd_lr_at``, with ``optim``'s hyper-parameters. The groups start at update
    0's rate; each ``step()`` (after an applied update) sets the next. ``state_dict()`` holds only the count: the
    hyper-parameters come from the config (checked there) on resume. ``device`` given: the count and the rate (one 0-dim
    float64 tensor every group holds, updated in place for captured graphs) live there; ``step(found_inf)`` advances
    only where ``found_inf`` is zero, and ``step_count`` and ``last_lr`` read the device (not in a step).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        optim: OptimSection,
        max_steps: int,
        end_lr: float = 0.0,
        device: torch.device | str | None = None,
    ):
        # The section and train.max_steps were checked with the config; end_lr is this API's own.
        if not (math.isfinite(end_lr) and 0 <= end_lr <= optim.lr):
            raise ValueError(f"end_lr: must lie in [0, base_lr={optim.lr}], got {end_lr}")
        wsd = optim.schedule != "poly"
        self.optimizer, self._formula = optimizer, wsd_lr_at if wsd else poly_lr_at
        self._hp = dict(base_lr=float(optim.lr), total_steps=max_steps, warmup_steps=optim.warmup_steps)
        self._hp.update(end_lr=float(end_lr))  # the formula's keyword arguments
        if wsd:
            self._hp.update(decay_steps=optim.decay_steps, decay_shape=optim.decay_shape)
        else:
            self._hp.update(start_warmup_step=optim.start_warmup_step, power=float(optim.poly_power))
        self.device = None if device is None else torch.device(device)
        self._count = 0  # updates applied so far = the 0-based step of the next update
        self.lr = None  # on the device: the rate of the next update, a 0-dim float64 tensor
        if self.device is not None:
            self._count = torch.zeros((), dtype=torch.int64, device=self.device)
            self.lr = torch.zeros((), dtype=torch.float64, device=self.device)
        self._apply()

    @property
    def step_count(self) -> int:
        return int(self._count)

    def lr_at(self, step):
        """The rate of update ``step``: an int, or a 0-dim tensor for a float64 tensor beside it."""
        return self._formula(step, **self._hp)

    @property
    def last_lr(self) -> float:
        """The rate the next update will use (what the groups hold now)."""
        return self.lr_at(self.step_count)

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """After an update; ``found_inf`` (device mode only, 0-dim, nonzero: the update was skipped)."""
        if found_inf is None:
            self._count = self._count + 1
        elif self.device is None:
            raise ValueError("WarmupDecaySchedule.step(found_inf): only a scheduler built with a device skips there")
        else:
            self._count = self._count + (found_inf == 0).to(torch.int64)
        self._apply()

    def applied_lr(self) -> torch.Tensor:
        """Device mode: the last applied update's rate (update 0's before any), a 0-dim float64 device tensor."""
        return self.lr_at((self._count - 1).clamp(min=0))

    def _apply(self) -> None:
        lr = self.lr_at(self._count)
        if self.device is not None:
            lr = self.lr.copy_(lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        if "step_count" not in state:
            raise ValueError("scheduler state: missing key 'step_count'")
        count = int(state["step_count"])
        self._count = count if self.device is None else torch.full((), count, dtype=torch.int64, device=self.device)
        self._apply()
