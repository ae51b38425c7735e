"""Optimizers: LAMB (MLPerf BERT's) and AdamW, with BERT's weight-decay exclusions.

Sits after gradient clipping in the data flow (``bert.clipping``): grads are final and
clipped when ``step()`` runs, so no optimizer here clips.

LAMB semantics (the MLPerf reference optimizer and apex's ``FusedLAMB``, whose defaults the
NVIDIA submissions use). For a parameter w with gradient g at step t (from 1):

    m = beta1 * m + (1 - beta1) * g          v = beta2 * v + (1 - beta2) * g * g
    u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * w
    r = ||w|| / ||u||, or 1 when either norm is 0          (per tensor: the trust ratio)
    w = w - lr * r * u

Weight decay is decoupled (added to the Adam direction before the trust ratio). The trust
ratio is applied only in groups with non-zero weight decay, as in the MLPerf reference
(``exclude_from_layer_adaptation`` defaults to the weight-decay exclusions) and apex
(``use_nvlamb=False``); ``use_nvlamb=True`` applies it everywhere.

``build_optimizer`` picks apex's fused kernel when apex (with its CUDA extension) is
importable and the parameters are on CUDA, and this module's multi-tensor ``Lamb`` otherwise
(``impl='apex'`` or ``impl='torch'`` force one; asking for apex where it cannot run is an
error). Both keep the same state layout (``exp_avg``, ``exp_avg_sq`` per parameter, ``step``
per group), so a checkpoint moves between them.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from bert.train_config import OptimSection

# Normalisation layers: their scale and shift are excluded from weight decay. Every other
# parameter with fewer than two dimensions (biases) is excluded too.
_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)


def param_groups_for(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two optimizer groups: decayed weights, and biases + normalisation parameters (no decay).

    Decided by module type and tensor rank, not by names: a parameter owned by a
    normalisation module, or with ndim <= 1, gets no weight decay. Shared (tied) parameters
    appear once; frozen ones are left out. Empty groups are dropped.
    """
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
    return [g for g in groups if g["params"]]


class Lamb(torch.optim.Optimizer):
    """LAMB with ``torch._foreach_*`` ops: a few multi-tensor kernels per group, no host sync.

    Arguments as apex's ``FusedLAMB`` (without its built-in clipping): ``params`` (tensors or
    group dicts), ``lr``, ``betas``, ``eps``, ``weight_decay``, ``bias_correction``,
    ``use_nvlamb`` (trust ratio also where weight decay is 0).
    """

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        use_nvlamb: bool = False,
    ):
        _check_hparams(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.use_nvlamb = use_nvlamb

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1  # per group, as apex keeps it
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Lamb: sparse gradients are not supported")
            for p in params:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self._update(group, params)
        return loss

    def _update(self, group: dict, params: list[Tensor]) -> None:
        grads = [p.grad for p in params]
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
        beta1, beta2 = group["betas"]
        step, lr, eps, wd = group["step"], group["lr"], group["eps"], group["weight_decay"]
        bc1, bc2 = (1 - beta1**step, 1 - beta2**step) if group["bias_correction"] else (1.0, 1.0)

        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
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
            w_norm = torch.stack(torch._foreach_norm(params))  # [N]
            u_norm = torch.stack(torch._foreach_norm(update))  # [N]
            ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            # One scale per tensor, kept on the device (a Python list of floats would sync).
            torch._foreach_mul_(update, list((ratio * -lr).unbind(0)))
            torch._foreach_add_(params, update)
        else:
            torch._foreach_add_(params, update, alpha=-lr)


def apex_lamb_available() -> bool:
    """True when apex's FusedLAMB and its CUDA extension (``amp_C``) can be imported."""
    if importlib.util.find_spec("apex") is None or importlib.util.find_spec("amp_C") is None:
        return False
    try:
        import amp_C  # noqa: F401
        from apex.optimizers import FusedLAMB  # noqa: F401
    except ImportError:
        return False
    return True


def build_optimizer(optim: OptimSection, model: nn.Module, impl: str = "auto") -> torch.optim.Optimizer:
    """``optim.name``: ``lamb`` or ``adamw``, with ``optim``'s lr, betas, eps and weight decay;
    groups from ``param_groups_for(model, optim.weight_decay)``.

    ``impl`` (LAMB only): ``auto`` = apex's FusedLAMB when ``apex_lamb_available()`` and the
    parameters are on CUDA, else ``Lamb``; ``apex`` = FusedLAMB or an error saying why not;
    ``torch`` = ``Lamb``. FusedLAMB's own global-norm clipping is switched off
    (``max_grad_norm=inf``): clipping happens before ``step()``, in ``bert.clipping``.
    """
    name, lr, betas, eps = optim.name, optim.lr, tuple(optim.betas), optim.eps
    groups = param_groups_for(model, optim.weight_decay)
    if not groups:
        raise ValueError("model: has no trainable parameters")
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)
    if name != "lamb":
        raise ValueError(f"optim.name: unknown optimizer {name!r}; choose from 'lamb', 'adamw'")
    if impl not in ("auto", "apex", "torch"):
        raise ValueError(f"optim.impl: unknown LAMB implementation {impl!r}; choose from 'auto', 'apex', 'torch'")
    on_cuda = all(p.is_cuda for g in groups for p in g["params"])
    if impl == "apex" or (impl == "auto" and on_cuda and apex_lamb_available()):
        if not apex_lamb_available():
            raise ValueError(
                "optim.impl: 'apex' asked for, but apex.optimizers.FusedLAMB with its CUDA "
                "extension is not importable here"
            )
        if not on_cuda:
            raise ValueError("optim.impl: 'apex' asked for, but the parameters are not on CUDA")
        from apex.optimizers import FusedLAMB

        return FusedLAMB(
            groups,
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            bias_correction=True,
            adam_w_mode=True,
            grad_averaging=True,
            max_grad_norm=float("inf"),
            use_nvlamb=False,
        )
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
