"""Gradient clipping: global-norm (MLPerf) and AdaGC (per-tensor adaptive).

Between the gradient all-reduce (and fp16 unscaling) and the optimizer step, on every gradient at once
(``torch._foreach_*``), with no host read. ``clip_global_`` is apex FusedLAMB's; ``AdaGC`` is
[docs/extensions.md](../docs/extensions.md#what-they-do)'s. ``unstep_(found_inf)`` takes back a step the optimizer
skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bert.config import AdaGCSection

ADAGC_EPS = 1e-6  # added to norms before dividing


def tensor_norms(grads: list[Tensor]) -> Tensor:
    """[N] float32 L2 norms, one per tensor (fp16/bf16 gradients are reduced in fp32)."""
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))


def _identity(t: Tensor) -> Tensor:
    return t


def clip_global_(
    params: Iterable[Tensor],
    max_norm: float,
    local: Callable[[Tensor], Tensor] = _identity,
    norms: Callable[[list[Tensor]], Tensor] = tensor_norms,
) -> Tensor:
    """Scale all gradients in place so their global L2 norm is at most ``max_norm``; returns the norm before clipping
    (float32 0-d, on the device). A non-finite norm makes the gradients non-finite, for the trainer's skip check.
    Sharded gradients (``bert.optim.shard``): ``local`` gives this rank's shard of a gradient and ``norms`` the whole
    tensors' norms from the shards."""
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"optim.max_grad_norm: must be finite and > 0, got {max_norm}")
    grads = [local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    total = torch.linalg.vector_norm(norms(grads))
    coef = max_norm / torch.clamp(total, min=max_norm)  # exactly 1 when total <= max_norm
    torch._foreach_mul_(grads, coef)
    return total


@dataclass
class ClipStats:
    """What one ``AdaGC.clip_()`` did; device tensors (reading them syncs)."""

    global_norm: Tensor | None  # float32 0-d, before clipping; None after warm-up unless asked for
    num_clipped: Tensor  # int64 0-d: tensors whose gradient was scaled down
    num_tensors: int = 0  # tensors that had a gradient
    clip_ratio: Tensor | None = None  # float32 0-d: mean over those tensors of the factor applied (1: none)


class AdaGC:
    """Adaptive per-tensor gradient clipping (the module docstring). ``named_parameters``: the model's (trainable ones
    kept; names key the state); ``adagc``: the ``optim.adagc`` section (None: its defaults). Call ``clip_()`` once per
    optimizer step, after the gradients are final."""

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        adagc: AdaGCSection | None = None,
        lambda_abs: float = 1.0,
        local: Callable[[Tensor], Tensor] = _identity,
        norms: Callable[[list[Tensor]], Tensor] = tensor_norms,
    ):
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError("AdaGC: no trainable parameters")
        adagc = adagc or AdaGCSection()  # validated when built
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.lambda_rel, self.beta, self.lambda_abs = adagc.lambda_rel, adagc.beta, lambda_abs
        self.eps, self.warmup_steps = ADAGC_EPS, adagc.warmup_steps
        # Sharded gradients: clip this rank's shards by thresholds on whole-tensor norms (as clip_global_).
        self.local, self.norms = local, norms
        self._step = torch.zeros((), dtype=torch.int64)  # t: steps clipped and not taken back
        self._calls = 0  # clip_() calls: t on the host when no step was taken back
        n = len(self.params)
        self.gamma = torch.zeros(n, dtype=torch.float32)  # [N] per-tensor threshold state
        self.has_gamma = torch.zeros(n, dtype=torch.bool)  # [N] False: no state yet
        self._index_cache: dict[tuple[int, ...], Tensor] = {}

    @property
    def step(self) -> int:
        """t, the steps clipped and not taken back (reading it syncs)."""
        return int(self._step)

    @step.setter
    def step(self, value: int) -> None:
        self._step = torch.full((), int(value), dtype=torch.int64, device=self._step.device)
        self._calls = int(value)

    def unstep_(self, found_inf: Tensor) -> None:
        """Take back this step's count when the optimizer skipped it (``found_inf`` nonzero), on the device."""
        self._step = self._step - (found_inf != 0).to(torch.int64)

    @torch.no_grad()
    def clip_(self, compute_global_norm: bool = False) -> ClipStats:
        """Clip the gradients in place and update the state. The global norm is returned during warm-up as the host
        counts it (``clip_()`` calls), else only with ``compute_global_norm``."""
        present = [i for i, p in enumerate(self.params) if p.grad is not None]
        self._calls += 1
        if not present:
            self._step = self._step + 1
            return ClipStats(None, torch.zeros((), dtype=torch.int64))
        grads = [self.local(self.params[i].grad) for i in present]
        device = grads[0].device
        if self.gamma.device != device:
            self.gamma, self.has_gamma = self.gamma.to(device), self.has_gamma.to(device)
        self._step = self._step.to(device) + 1
        idx = None if len(present) == len(self.params) else self._index(present, device)
        gamma, has = (self.gamma, self.has_gamma) if idx is None else (self.gamma[idx], self.has_gamma[idx])

        norms = self.norms(grads)  # [n] before clipping
        warm = self._step <= self.warmup_steps  # 0-dim bool, on the device
        global_norm = torch.linalg.vector_norm(norms)
        # Warm-up: one factor for all tensors, from the global norm.
        coef = torch.clamp(self.lambda_abs / (global_norm + self.eps), max=1.0)
        clipped = norms * coef
        warm_gamma = torch.where(has, torch.minimum(gamma, clipped), clipped)
        # After warm-up: a factor per tensor, from its own threshold.
        start = torch.where(has, gamma, norms)
        h = torch.clamp(self.lambda_rel * start / (norms + self.eps), max=1.0)  # [n]
        late_gamma = self.beta * start + (1 - self.beta) * torch.minimum(norms, self.lambda_rel * start)
        factor = torch.where(warm, coef.expand_as(h), h)
        # A different factor per tensor, kept on the device (no list of Python floats).
        torch._foreach_mul_(grads, list(factor.unbind(0)))
        new_gamma = torch.where(warm, warm_gamma, late_gamma)
        num_clipped = torch.where(warm, (coef < 1).long() * len(grads), (h < 1).sum())
        clip_ratio = torch.where(warm, coef, h.mean())

        finite = torch.isfinite(norms).all()
        new_gamma = torch.where(finite, new_gamma, torch.where(warm, gamma, start))
        new_has = has | finite
        if idx is None:
            self.gamma, self.has_gamma = new_gamma, new_has
        else:
            self.gamma = self.gamma.index_copy(0, idx, new_gamma)
            self.has_gamma = self.has_gamma.index_copy(0, idx, new_has)
        shown = global_norm if compute_global_norm or self._calls <= self.warmup_steps else None
        return ClipStats(shown, num_clipped, len(grads), clip_ratio)

    def _index(self, present: list[int], device) -> Tensor:
        key = tuple(present)
        idx = self._index_cache.get(key)
        if idx is None or idx.device != device:
            idx = torch.tensor(present, dtype=torch.long, device=device)
            self._index_cache = {key: idx}  # the set of present tensors rarely changes
        return idx

    def state_dict(self) -> dict:
        gamma, has = self.gamma.detach().cpu().clone(), self.has_gamma.detach().cpu().clone()
        return {"step": self.step, "names": list(self.names), "gamma": gamma, "has_gamma": has}

    def load_state_dict(self, state: dict) -> None:
        """Restore by parameter name; tensors the state does not know start without state."""
        for key in ("step", "names", "gamma", "has_gamma"):
            if key not in state:
                raise ValueError(f"AdaGC state: missing key {key!r}")
        names, gamma, has = list(state["names"]), state["gamma"], state["has_gamma"]
        if gamma.shape != (len(names),) or has.shape != (len(names),):
            raise ValueError(
                f"AdaGC state: gamma/has_gamma shapes {tuple(gamma.shape)}/{tuple(has.shape)} "
                f"do not match {len(names)} names"
            )
        position = {n: i for i, n in enumerate(self.names)}
        if unknown := [n for n in names if n not in position]:
            raise ValueError(
                f"AdaGC state: parameters not in this model: {', '.join(unknown[:5])}"
                + (f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else "")
            )
        device = self.gamma.device
        new_gamma = torch.zeros(len(self.names), dtype=torch.float32)
        new_has = torch.zeros(len(self.names), dtype=torch.bool)
        dest = torch.tensor([position[n] for n in names], dtype=torch.long)
        new_gamma[dest] = gamma.detach().to("cpu", torch.float32)
        new_has[dest] = has.detach().to("cpu", torch.bool)
        self.gamma, self.has_gamma = new_gamma.to(device), new_has.to(device)
        self.step = int(state["step"])
