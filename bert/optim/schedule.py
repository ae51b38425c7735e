"""Learning-rate schedules: linear warm-up, then polynomial decay to ``end_lr`` (MLPerf BERT's
reference ``create_optimizer``: the formula is docs/training.md's, "Optimizer, schedule and
clipping"), or warmup-stable-decay (ModernBERT's; ``wsd_lr_at`` at the bottom). The trainer calls
``scheduler.step()`` after every applied update; it writes the next update's rate into every group.
"""

from __future__ import annotations

import math

import torch

from bert.config import OptimSection


def lr_at(
    step: int,
    *,
    base_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    start_warmup_step: int = 0,
    power: float = 1.0,
    end_lr: float = 0.0,
) -> float:
    """Learning rate of update ``step`` (0-based: the first update is step 0)."""
    if warmup_steps > 0:
        w = step - start_warmup_step
        if w < warmup_steps:
            return base_lr * max(w, 0) / warmup_steps
    progress = min(step, total_steps) / total_steps
    return (base_lr - end_lr) * (1.0 - progress) ** power + end_lr


def lr_at_tensor(
    step: torch.Tensor,
    *,
    base_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    start_warmup_step: int = 0,
    power: float = 1.0,
    end_lr: float = 0.0,
) -> torch.Tensor:
    """``lr_at`` of a 0-dim step tensor, as a float64 tensor beside it (no host read): the same
    double-precision operations in the same order, so the value equals ``lr_at``'s."""
    g = step.to(torch.float64)
    progress = torch.clamp(g, max=total_steps) / total_steps
    lr = (base_lr - end_lr) * (1.0 - progress) ** power + end_lr
    if warmup_steps > 0:
        w = g - start_warmup_step
        lr = torch.where(w < warmup_steps, base_lr * torch.clamp(w, min=0) / warmup_steps, lr)
    return lr


class PolyWarmupScheduler:
    """Sets ``lr_at(step)`` in every parameter group of ``optimizer``: ``optim``'s peak ``lr``,
    ``warmup_steps`` from ``start_warmup_step`` and decay of ``poly_power`` over ``max_steps``, or with
    ``optim.schedule`` wsd / wsd_linear ``wsd_lr_at`` (the final decay over ``optim.decay_steps``).
    The groups start at update 0's rate; each ``step()`` (after an applied update) sets the next.
    ``state_dict()`` holds only the count: the hyper-parameters come from the config on resume.

    ``device`` given: the count and the rate live on that device, the rate as one 0-dim float64
    tensor every group holds (updated in place, so a captured graph sees each new value), and
    ``step(found_inf)`` advances the count only where ``found_inf`` is zero, without a host read.
    ``step_count`` and ``last_lr`` then read the device (for logs and checkpoints, not in a step).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        optim: OptimSection,
        max_steps: int,
        end_lr: float = 0.0,
        device: torch.device | str | None = None,
    ):
        base_lr, warmup, start, power = optim.lr, optim.warmup_steps, optim.start_warmup_step, optim.poly_power
        total, wsd = max_steps, optim.schedule != "poly"
        # In order, each condition evaluated only once the ones before it hold (as a chain of ifs).
        for ok, name, what in (
            (lambda: math.isfinite(base_lr) and base_lr >= 0, "base_lr", f"must be finite and >= 0, got {base_lr}"),
            (lambda: isinstance(total, int) and total >= 1, "total_steps", f"must be an integer >= 1, got {total!r}"),
            (
                lambda: isinstance(warmup, int) and warmup >= 0,
                "warmup_steps",
                f"must be an integer >= 0, got {warmup!r}",
            ),
            (lambda: isinstance(start, int), "start_warmup_step", f"must be an integer, got {start!r}"),
            (lambda: math.isfinite(power) and power >= 0, "power", f"must be finite and >= 0, got {power}"),
            (
                lambda: math.isfinite(end_lr) and 0 <= end_lr <= base_lr,
                "end_lr",
                f"must lie in [0, base_lr={base_lr}], got {end_lr}",
            ),
            (
                lambda: not wsd or warmup + optim.decay_steps <= total,
                "optim.decay_steps",
                f"warm-up ({warmup}) and decay ({optim.decay_steps}) exceed the {total} steps",
            ),
        ):
            if not ok():
                raise ValueError(f"{name}: {what}")
        self.optimizer = optimizer
        self.schedule = "wsd" if wsd else "poly"
        # The keyword arguments of (wsd_)lr_at(_tensor).
        self._hp = dict(base_lr=float(base_lr), total_steps=total, warmup_steps=warmup, end_lr=float(end_lr))
        if wsd:
            self._hp.update(decay_steps=optim.decay_steps, decay_shape=optim.decay_shape)
        else:
            self._hp.update(start_warmup_step=start, power=float(power))
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

    def lr_at(self, step: int) -> float:
        return (wsd_lr_at if self.schedule == "wsd" else lr_at)(step, **self._hp)

    @property
    def last_lr(self) -> float:
        """The rate the next update will use (what the groups hold now)."""
        return self.lr_at(self.step_count)

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """After an update; ``found_inf`` (device mode only, 0-dim, nonzero: the update was skipped)."""
        if found_inf is None:
            self._count = self._count + 1
        elif self.device is None:
            raise ValueError("PolyWarmupScheduler.step(found_inf): only a scheduler built with a device skips there")
        else:
            self._count = self._count + (found_inf == 0).to(torch.int64)
        self._apply()

    def _lr_tensor(self, step: torch.Tensor) -> torch.Tensor:
        """``lr_at`` of a 0-dim step tensor, on its device (no host read)."""
        return (wsd_lr_at_tensor if self.schedule == "wsd" else lr_at_tensor)(step, **self._hp)

    def applied_lr(self) -> torch.Tensor:
        """Device mode: the last applied update's rate (update 0's before any), a 0-dim float64 device tensor."""
        return self._lr_tensor((self._count - 1).clamp(min=0))

    def _apply(self) -> None:
        if self.device is None:
            lr = self.lr_at(self._count)
        else:
            lr = self.lr
            lr.copy_(self._lr_tensor(self._count))
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


# ---- warmup-stable-decay ------------------------------------------------------------------------


def wsd_lr_at(
    step: int,
    *,
    base_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    decay_steps: int = 0,
    decay_shape: str = "1-sqrt",
    end_lr: float = 0.0,
) -> float:
    """Warmup-stable-decay (ModernBERT's "trapezoidal" schedule, arXiv:2412.13663 section 2.2): a linear warm-up over
    ``warmup_steps`` to ``base_lr``, constant, then over the last ``decay_steps`` of ``total_steps`` a decay to
    ``end_lr``, linear or one-minus-sqrt (lr = end + (base - end) * (1 - sqrt(p)) at progress p of the decay; Hägele et
    al. 2024, arXiv:2405.18392, which ModernBERT uses). Step 0-based as ``lr_at``; past ``total_steps`` the rate stays
    ``end_lr``."""
    if step < warmup_steps:
        return base_lr * step / warmup_steps
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return base_lr
    p = min(1.0, (step - decay_start) / decay_steps) if decay_steps else 1.0
    shape = 1.0 - math.sqrt(p) if decay_shape == "1-sqrt" else 1.0 - p
    return end_lr + (base_lr - end_lr) * shape


def wsd_lr_at_tensor(
    step: torch.Tensor,
    *,
    base_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    decay_steps: int = 0,
    decay_shape: str = "1-sqrt",
    end_lr: float = 0.0,
) -> torch.Tensor:
    """``wsd_lr_at`` of a 0-dim step tensor, as a float64 tensor beside it (no host read): the
    same double-precision operations, so the value equals ``wsd_lr_at``'s bitwise."""
    g = step.to(torch.float64)
    decay_start = total_steps - decay_steps
    p = torch.clamp((g - decay_start) / decay_steps, 0.0, 1.0) if decay_steps else torch.ones_like(g)
    shape = 1.0 - torch.sqrt(p) if decay_shape == "1-sqrt" else 1.0 - p
    lr = torch.where(g < decay_start, torch.full_like(g, base_lr), end_lr + (base_lr - end_lr) * shape)
    if warmup_steps > 0:
        lr = torch.where(g < warmup_steps, base_lr * g / warmup_steps, lr)
    return lr
