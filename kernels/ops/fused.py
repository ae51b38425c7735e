"""Fused elementwise ops of a BERT layer, as Triton kernels with PyTorch references.

``bias_gelu(x, bias)``: erf GELU of ``x + bias`` in one pass; ``bias_dropout_add_layer_norm``:
``LayerNorm(residual + dropout(x + bias))``, the post-LN residual block, one kernel each way,
its Philox dropout mask regenerated in the backward. Each has a ``*_reference`` with the same
signature; ``model.fused_ops`` chooses. The device code is ``kernels/ops/fused_jit.py``; on
neither CUDA nor the interpreter the kernels raise ``BackendUnavailable``.
Shapes: x, residual [..., N]; bias, weight, ln_bias [N]. Math is fp32 inside the kernels.
"""

from __future__ import annotations

from functools import reduce
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.runtime import draw_philox, jit_kernels

JIT_SOURCE = Path(__file__).with_name("fused_jit.py")  # the device code, loaded by kernels.runtime


def _rows(x: Tensor, n: int) -> Tensor:
    return x.reshape(-1, n).contiguous()  # [R, N]


def _check_vec(t: Tensor, n: int, name: str, device) -> None:
    if t.shape != (n,) or t.device != device:
        raise ValueError(f"{name}: expected shape ({n},) on {device}, got {tuple(t.shape)} on {t.device}")


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        kern = jit_kernels(x.device, "fused bias_gelu", JIT_SOURCE)
        x_RN = _rows(x, x.shape[-1])
        y_RN = torch.empty_like(x_RN)
        kern.bias_gelu_fwd(x_RN, bias.contiguous(), y_RN)
        ctx.save_for_backward(x_RN, bias)
        return y_RN.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x_RN, bias = ctx.saved_tensors
        kern = jit_kernels(x_RN.device, "fused bias_gelu", JIT_SOURCE)
        dx_RN = torch.empty_like(x_RN)
        kern.bias_gelu_bwd(_rows(dy, x_RN.shape[1]), x_RN, bias.contiguous(), dx_RN)
        dbias = dx_RN.sum(0, dtype=torch.float32).to(bias.dtype)
        return dx_RN.view(dy.shape), dbias


def bias_gelu(x: Tensor, bias: Tensor) -> Tensor:
    """gelu(x + bias) with erf GELU. x [..., N] (fp32/fp16/bf16), bias [N]; returns x's dtype."""
    _check_vec(bias, x.shape[-1], "bias_gelu: bias", x.device)
    return _BiasGelu.apply(x, bias)


def bias_gelu_reference(x: Tensor, bias: Tensor) -> Tensor:
    return F.gelu(x + bias.to(x.dtype))


class _BiasDropoutAddLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, weight, ln_bias, dropout_p, eps, keep_out):
        kern = jit_kernels(x.device, "fused bias_dropout_add_layer_norm", JIT_SOURCE)
        n = x.shape[-1]
        out_dtype = reduce(torch.promote_types, (t.dtype for t in (x, bias, residual, weight, ln_bias)))
        x_RN, res_RN = _rows(x, n), _rows(residual, n)
        r = x_RN.shape[0]
        y_RN = torch.empty(r, n, dtype=out_dtype, device=x.device)
        h_RN = torch.empty(r, n, dtype=out_dtype, device=x.device)  # residual + dropout(x + bias), kept
        mean, rstd = torch.empty(2, r, dtype=torch.float32, device=x.device)
        rng = draw_philox(dropout_p, x.device)  # [2] int64 (seed, offset), read by the kernels only
        vectors = (bias.contiguous(), res_RN, weight.contiguous(), ln_bias.contiguous())
        kern.bdaln_fwd(x_RN, *vectors, y_RN, h_RN, mean, rstd, eps, dropout_p, rng, keep_out)
        ctx.save_for_backward(h_RN, weight, mean, rstd, rng)  # the backward replays the forward's mask
        ctx.meta = (x.shape, x.dtype, residual.shape, residual.dtype, bias.dtype, ln_bias.dtype, dropout_p)
        return y_RN.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        h_RN, weight, mean, rstd, rng = ctx.saved_tensors
        x_shape, x_dtype, res_shape, res_dtype, bias_dtype, lb_dtype, dropout_p = ctx.meta
        kern = jit_kernels(h_RN.device, "fused bias_dropout_add_layer_norm", JIT_SOURCE)
        dx_RN = torch.empty(h_RN.shape, dtype=x_dtype, device=h_RN.device)
        dres_RN = torch.empty(h_RN.shape, dtype=res_dtype, device=h_RN.device)
        dw_part, dlb_part, db_part = kern.bdaln_bwd(
            _rows(dy, h_RN.shape[1]), h_RN, weight.contiguous(), mean, rstd, dx_RN, dres_RN, dropout_p, rng
        )
        dbias, dweight, dln_bias = db_part.sum(0).to(bias_dtype), dw_part.sum(0).to(weight.dtype), dlb_part.sum(0)
        return dx_RN.view(x_shape), dbias, dres_RN.view(res_shape), dweight, dln_bias.to(lb_dtype), None, None, None


def _check_ln(x, bias, residual, weight, ln_bias, dropout_p):
    n = x.shape[-1]
    if residual.shape != x.shape or residual.device != x.device:
        raise ValueError(
            f"bias_dropout_add_layer_norm: residual {tuple(residual.shape)} on {residual.device} "
            f"must match x {tuple(x.shape)} on {x.device}"
        )
    for name, t in (("bias", bias), ("weight", weight), ("ln_bias", ln_bias)):
        _check_vec(t, n, f"bias_dropout_add_layer_norm: {name}", x.device)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"bias_dropout_add_layer_norm: dropout_p must lie in [0, 1), got {dropout_p}")


def bias_dropout_add_layer_norm(
    x: Tensor,
    bias: Tensor,
    residual: Tensor,
    weight: Tensor,
    ln_bias: Tensor,
    dropout_p: float,
    eps: float,
    training: bool,
) -> Tensor:
    """LayerNorm(residual + dropout(x + bias)) * weight + ln_bias over the last dim.

    x, residual: [..., N]; bias, weight, ln_bias: [N]. Dropout only when training. Returns the
    promoted dtype of the five inputs (fp32 under autocast, where x is bf16/fp16 and the
    parameters fp32). One kernel each way; saves residual + dropout(x + bias) and the row
    statistics for the backward."""
    _check_ln(x, bias, residual, weight, ln_bias, dropout_p)
    p = float(dropout_p) if training else 0.0
    return _BiasDropoutAddLayerNorm.apply(x, bias, residual, weight, ln_bias, p, float(eps), None)


def bias_dropout_add_layer_norm_reference(x, bias, residual, weight, ln_bias, dropout_p, eps, training) -> Tensor:
    return F.layer_norm(residual + F.dropout(x + bias, dropout_p, training), (x.shape[-1],), weight, ln_bias, eps)
