"""The FFN's first projection with bias and GELU in the GEMM's epilogue.

``linear_bias_gelu(x, weight, bias)`` = GELU(x @ weight.T + bias) through
``torch._addmm_activation(..., use_gelu=True)`` (cuBLASLt's GELU_BIAS epilogue on CUDA);
``linear_bias_gelu_reference`` is ``F.linear`` then ``F.gelu``. The backward differentiates
the GELU the first call probed (tanh on cuBLASLt, erf on the CPU):
[docs/fp8.md](../docs/fp8.md#biasgelu-in-the-gemm-epilogue). Shapes: x [N, C], weight [I, C],
bias [I] -> [N, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_APPROXIMATION: dict[str, str] = {}  # device type -> "none" (erf) or "tanh", found by probing


def epilogue_gelu(device: torch.device) -> str:
    """Which GELU ``_addmm_activation`` computes on ``device`` ("none": erf, or "tanh")."""
    kind = device.type
    if kind not in _APPROXIMATION:
        z = torch.tensor([[-2.0, -0.7, 0.6, 1.9]], dtype=torch.float32, device=device)  # [1, 4]
        one = torch.ones(1, 1, dtype=torch.float32, device=device)
        y = torch._addmm_activation(torch.zeros(4, device=device), one, z, use_gelu=True)
        erf = (y - F.gelu(z)).abs().max().item()
        tanh = (y - F.gelu(z, approximate="tanh")).abs().max().item()
        _APPROXIMATION[kind] = "none" if erf <= tanh else "tanh"
    return _APPROXIMATION[kind]


class _LinearBiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NC, weight_IC, bias_I):
        ctx.save_for_backward(x_NC, weight_IC, bias_I)
        return torch._addmm_activation(bias_I, x_NC, weight_IC.t(), use_gelu=True)

    @staticmethod
    def backward(ctx, dy_NI):
        x_NC, weight_IC, bias_I = ctx.saved_tensors
        z_NI = torch.addmm(bias_I, x_NC, weight_IC.t())  # the pre-activation, recomputed
        dz_NI = torch.ops.aten.gelu_backward(dy_NI.to(z_NI.dtype), z_NI, approximate=epilogue_gelu(x_NC.device))
        dx = dz_NI @ weight_IC if ctx.needs_input_grad[0] else None
        dw = dz_NI.t() @ x_NC if ctx.needs_input_grad[1] else None
        db = dz_NI.sum(0, dtype=torch.float32).to(bias_I.dtype) if ctx.needs_input_grad[2] else None
        return dx, dw, db


def linear_bias_gelu(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """GELU(x @ weight.T + bias) with bias and GELU in the GEMM epilogue. x [N, C] (or [..., C]),
    weight [I, C], bias [I]; under autocast the three are cast to the autocast dtype first (as
    ``F.linear`` would be), and the result has that dtype."""
    if weight.dim() != 2 or bias.shape != (weight.shape[0],) or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_bias_gelu: x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias {tuple(bias.shape)} "
            "do not fit [..., C], [I, C], [I]"
        )
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
    epilogue_gelu(x.device)  # probed outside the autograd graph, once per device type
    with torch.autocast(device, enabled=False):
        y = _LinearBiasGelu.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_bias_gelu_reference(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """The same in plain PyTorch: erf GELU of F.linear (the eager FFN-in)."""
    return F.gelu(F.linear(x, weight, bias))
