"""Optimizers: LAMB (MLPerf BERT's), AdamW and StableAdamW (ModernBERT's), with BERT's weight-decay exclusions.

None clips (``bert.optim.clipping`` runs first). ``Lamb`` is apex's ``FusedLAMB`` on ``torch._foreach_*`` ops, with its
state layout. Every optimizer here takes ``step(found_inf=t)``, a 0-dim device tensor, nonzero when the gradients are
not finite, that skips the update on the device (``apply_update`` reads it for the others). The update rules, the
exclusions and the skip's cost: docs/training.md, "Optimizer, schedule and clipping", and docs/step.md.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from bert.config import OptimSection

_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)


def param_groups_for(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two optimizer groups: decayed weights, and no decay for a parameter of a normalisation module or with ndim <= 1
    (by type and rank, not names). Tied parameters appear once, frozen ones not at all; empty groups are dropped
    (ValueError when both are)."""
    no_decay_ids = set()
    for module in model.modules():
        is_norm = isinstance(module, _NORM_TYPES)
        for p in module.parameters(recurse=False):
            if is_norm or p.ndim <= 1:
                no_decay_ids.add(id(p))
    decay, no_decay = [], []
    for p in model.parameters():  # de-duplicates tied parameters
        if p.requires_grad:
            (no_decay if id(p) in no_decay_ids else decay).append(p)
    groups = [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("model: has no trainable parameters")
    return groups


class Lamb(torch.optim.Optimizer):
    """LAMB with ``torch._foreach_*`` ops: a few multi-tensor kernels per group, no host sync. Arguments as apex's
    ``FusedLAMB`` without its clipping; ``use_nvlamb``: the trust ratio also where weight decay is 0."""

    def __init__(
        self, params, lr: float, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True, use_nvlamb=False
    ):
        _check_hparams(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.use_nvlamb = use_nvlamb

    @torch.no_grad()
    def step(self, closure=None, found_inf: Tensor | None = None):
        """One update; ``found_inf`` (0-dim device tensor, nonzero = skip): see the module docstring."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            step = group.get("step", 0)  # per group, as apex keeps it
            if found_inf is None:
                group["step"] = step + 1
            else:  # a float64 0-dim tensor beside found_inf (from an int, or a checkpoint's tensor)
                step = torch.as_tensor(step, dtype=torch.float64, device=found_inf.device)
                group["step"] = step + (found_inf == 0).double()
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Lamb: sparse gradients are not supported")
            for p in params:
                self.init_state(p)
            self._update(group, params, found_inf)
        return loss

    def init_state(self, p: Tensor) -> dict:
        """``p``'s moments, created (zeros) if it has none yet; a checkpoint is loaded into them."""
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _local(self, t: Tensor) -> Tensor:
        """The tensor the update runs on: ``t`` itself here; a DTensor's local shard in ``ShardedLamb``."""
        return t

    def _trust_norms(self, params: list[Tensor], update: list[Tensor]) -> tuple[Tensor, Tensor]:
        """[N] whole-tensor L2 norms of the weights and of the updates (sharded: summed over shards)."""
        return torch.stack(torch._foreach_norm(params)), torch.stack(torch._foreach_norm(update))

    def _update(self, group: dict, params: list[Tensor], found_inf: Tensor | None) -> None:
        grads = [self._local(p.grad) for p in params]
        state_avgs = [self._local(self.state[p]["exp_avg"]) for p in params]
        state_avg_sqs = [self._local(self.state[p]["exp_avg_sq"]) for p in params]
        params = [self._local(p) for p in params]
        beta1, beta2 = group["betas"]
        step, lr, eps, wd = group["step"], group["lr"], group["eps"], group["weight_decay"]
        bc1, bc2 = (1 - beta1**step, 1 - beta2**step) if group["bias_correction"] else (1.0, 1.0)
        if isinstance(bc1, Tensor):  # the device step: cast as a Python float would be
            bc1, bc2 = bc1.to(params[0].dtype), bc2.to(params[0].dtype)

        if found_inf is None:
            exp_avgs, exp_avg_sqs = state_avgs, state_avg_sqs
            torch._foreach_mul_(exp_avgs, beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
        else:  # new moments beside the old ones, selected at the end
            exp_avgs, exp_avg_sqs = torch._foreach_mul(state_avgs, beta1), torch._foreach_mul(state_avg_sqs, beta2)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)

        denom = torch._foreach_div(exp_avg_sqs, bc2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(exp_avgs, bc1)
        torch._foreach_div_(update, denom)
        del denom
        if wd != 0:
            torch._foreach_add_(update, params, alpha=wd)

        if wd != 0 or self.use_nvlamb:
            w_norm, u_norm = self._trust_norms(params, update)  # [N] each
            ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            # One scale per tensor, kept on the device (a Python list of floats would sync).
            torch._foreach_mul_(update, list((ratio * -lr).unbind(0)))
            alpha = 1.0
        elif isinstance(lr, Tensor):
            torch._foreach_mul_(update, -lr.to(params[0].dtype))
            alpha = 1.0
        else:
            alpha = -lr
        if found_inf is None:
            torch._foreach_add_(params, update, alpha=alpha)
        else:
            new_params = torch._foreach_add(params, update, alpha=alpha)
            del update
            skip = found_inf != 0
            for olds, news in ((state_avgs, exp_avgs), (state_avg_sqs, exp_avg_sqs), (params, new_params)):
                _keep_where_skipped(skip, olds, news)


class AdamW(torch.optim.AdamW):
    """torch's AdamW that also takes ``step(found_inf=...)`` and a device-tensor learning rate: without either,
    ``step()`` is torch's own; with them, the same update on ``_foreach`` ops that read nothing back, in torch's state
    layout (``amsgrad`` and ``maximize``: torch's only). ``decouple_lr=True``: w <- w (1 - lr_t / max_lr x
    weight_decay), ``max_lr`` the peak rate (default ``lr``; configuration, not state)."""

    clips_update = False  # StableAdamW's per-tensor learning-rate scaling (the subclass below)

    def __init__(self, params, lr: float = 1e-3, *args, decouple_lr: bool = False, max_lr: float | None = None, **kw):
        super().__init__(params, lr, *args, **kw)
        self.decouple_lr, self.max_lr = decouple_lr, float(lr if max_lr is None else max_lr)

    @torch.no_grad()
    def step(self, closure=None, found_inf: Tensor | None = None):
        plain = found_inf is None and not any(isinstance(g["lr"], Tensor) for g in self.param_groups)
        if plain and not (self.clips_update or self.decouple_lr):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise RuntimeError("AdamW: amsgrad/maximize are not supported with found_inf or a tensor lr")
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params, found_inf)
        return loss

    def _update(self, group: dict, params: list[Tensor], found_inf: Tensor | None) -> None:
        device, dtype = params[0].device, params[0].dtype
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != device:  # torch's load_state_dict keeps steps on the CPU
                state["step"] = state["step"].to(device)
        grads = [p.grad for p in params]
        steps = [self.state[p]["step"] for p in params]
        state_avgs = [self.state[p]["exp_avg"] for p in params]
        state_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        if found_inf is None:
            torch._foreach_add_(steps, 1.0)
        else:  # a list of tensors: the one-tensor overload reads its scalar on the host
            torch._foreach_add_(steps, [(found_inf == 0).float()] * len(steps))
        step = torch.stack(steps).double()  # [N]
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step  # [N] float64, as torch's Python floats

        exp_avgs = torch._foreach_lerp(state_avgs, grads, 1 - beta1)
        exp_avg_sqs = torch._foreach_mul(state_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        if self.clips_update:  # one learning rate per tensor: [N] float64
            lr = lr / _update_rms(grads, exp_avg_sqs, bc2, eps).clamp(min=1.0)
        decay = 1 - (lr / self.max_lr if self.decouple_lr else lr) * wd
        new_params = torch._foreach_mul(params, list(decay.to(dtype).unbind(0)) if self.clips_update else decay)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, list(bc2.sqrt().to(dtype).unbind(0)))
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(exp_avgs, denom)
        del denom
        torch._foreach_mul_(update, list((-lr / bc1).to(dtype).unbind(0)))
        torch._foreach_add_(new_params, update)
        del update
        skip = None if found_inf is None else found_inf != 0
        for olds, news in ((params, new_params), (state_avgs, exp_avgs), (state_avg_sqs, exp_avg_sqs)):
            if skip is None:
                torch._foreach_copy_(olds, news)
            else:
                _keep_where_skipped(skip, olds, news)


class StableAdamW(AdamW):
    """StableAdamW (Wortsman et al. 2023, arXiv:2304.13013, Algorithm 2), ModernBERT's: AdamW with the learning rate
    scaled per tensor and step,

        lr_t = lr / max(1, RMS_t),    RMS_t = sqrt(mean(g_t^2 / max(v_t / (1 - beta2^t), eps^2)))

    and weight decay with the same lr_t (``decouple_lr`` as ``AdamW``); always the ``_foreach`` path. Why and what it
    costs: docs/modern_encoders.md."""

    clips_update = True


def _update_rms(grads: list[Tensor], exp_avg_sqs: list[Tensor], bc2: Tensor, eps: float) -> Tensor:
    """[N] float64: each tensor's sqrt(mean(g^2 / max(v / bc2, eps^2))), StableAdamW's RMS_t."""
    dtype = grads[0].dtype
    v_hat = torch._foreach_div(exp_avg_sqs, list(bc2.to(dtype).unbind(0)))
    torch._foreach_clamp_min_(v_hat, eps * eps)
    ratio = torch._foreach_mul(grads, grads)
    torch._foreach_div_(ratio, v_hat)
    del v_hat
    sums = torch.stack(torch._foreach_norm(ratio, 1)).double()  # the ratios are >= 0: their L1 norm is their sum
    numel = torch.tensor([g.numel() for g in grads], dtype=torch.float64, device=sums.device)
    return (sums / numel).sqrt()


def _keep_where_skipped(skip: Tensor, olds: list[Tensor], news: list[Tensor]) -> None:
    """olds[i] <- olds[i] if skip else news[i], in place, without reading ``skip`` on the host."""
    for old, new in zip(olds, news):
        torch.where(skip, old, new, out=old)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` takes ``found_inf`` (the device-side skip of the module docstring)."""
    return "found_inf" in inspect.signature(optimizer.step).parameters


def apply_update(optimizer, schedule, found_inf: Tensor, scaler=None) -> None:
    """The update and the schedule's step, skipped where ``found_inf`` (0-dim device bool): on the device, without a
    read, for an optimizer that ``skips_on_device`` with a device schedule; else the host reads ``found_inf`` (apex's
    FusedLAMB: one read per step), and fp16's GradScaler decides its own skip on the host (``scaler.step`` reads)."""
    on_device = skips_on_device(optimizer) and schedule.device is not None
    applied = True if on_device else not bool(found_inf)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    elif on_device:
        optimizer.step(found_inf=found_inf)
    elif applied:
        optimizer.step()
    if on_device:
        schedule.step(found_inf)
    elif applied:
        schedule.step()


def apex_lamb_available() -> bool:
    """True when apex's FusedLAMB and its CUDA extension (``amp_C``) can be imported."""
    try:
        import amp_C  # noqa: F401
        from apex.optimizers import FusedLAMB  # noqa: F401
    except ImportError:
        return False
    return True


def build_optimizer(optim: OptimSection, model: nn.Module, impl: str = "auto") -> torch.optim.Optimizer:
    """``optim.name`` with ``optim``'s hyperparameters over ``param_groups_for(model, optim.weight_decay)``. ``impl``
    (LAMB only): ``auto`` = apex's FusedLAMB when available and the parameters are on CUDA, else ``Lamb``; ``apex`` =
    FusedLAMB or an error saying why not; ``torch`` = ``Lamb``. FusedLAMB's clipping is off (clipping runs first)."""
    name, lr, betas, eps = optim.name, optim.lr, tuple(optim.betas), optim.eps
    groups = param_groups_for(model, optim.weight_decay)
    if name in ("adamw", "stable_adamw"):
        kind = StableAdamW if name == "stable_adamw" else AdamW
        return kind(groups, lr=lr, betas=betas, eps=eps, decouple_lr=optim.decouple_lr)
    if impl not in ("auto", "apex", "torch"):
        raise ValueError(f"impl: unknown LAMB implementation {impl!r}; choose from 'auto', 'apex', 'torch'")
    on_cuda = all(p.is_cuda for g in groups for p in g["params"])
    if impl == "apex" or (impl == "auto" and on_cuda and apex_lamb_available()):
        if not apex_lamb_available():
            raise ValueError(
                "impl: 'apex' asked for, but apex.optimizers.FusedLAMB with its CUDA extension is not importable here"
            )
        if not on_cuda:
            raise ValueError("impl: 'apex' asked for, but the parameters are not on CUDA")
        from apex.optimizers import FusedLAMB

        fixed = dict(bias_correction=True, adam_w_mode=True, grad_averaging=True, use_nvlamb=False)
        return FusedLAMB(groups, lr=lr, betas=betas, eps=eps, max_grad_norm=float("inf"), **fixed)
    return Lamb(groups, lr=lr, betas=betas, eps=eps)


def _check_hparams(lr: float, betas: Iterable[float], eps: float, weight_decay: float) -> None:
    betas = tuple(betas)
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"optim.lr: must be finite and >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"optim.betas: must be two numbers in [0, 1), got {betas}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"optim.eps: must be finite and > 0, got {eps}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"optim.weight_decay: must be finite and >= 0, got {weight_decay}")
