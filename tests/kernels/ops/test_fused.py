"""The fused bias+GELU and bias+dropout+residual+LayerNorm kernels, in Triton's interpreter,
against their PyTorch references (fp32 within 1e-5; fp16/bf16 within twice PyTorch's own
error against fp64)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.ops.fused import (
    bias_dropout_add_layer_norm,
    bias_dropout_add_layer_norm_reference,
    bias_gelu,
    bias_gelu_reference,
)
from tests.kernels.dropout_masks import bias_dropout_add_layer_norm_with_mask

R, N = 37, 96  # odd row count, a width that is not a power of two
EPS = 1e-12


def tensors(dtypes, shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(d) for d, s in zip(dtypes, shapes)]


def run(fn, inputs, dout):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return out.detach(), [x.grad for x in leaves]


def errors(got, ref):
    (out, grads), (out_r, grads_r) = got, ref
    return [float((a.double() - b.double()).abs().max()) for a, b in zip([out, *grads], [out_r, *grads_r])]


def ln_inputs(dtype, seed, shape=(R, N)):
    n = shape[-1]
    x, res, dout = tensors([dtype] * 3, [shape] * 3, seed)
    bias, weight, ln_bias = tensors([dtype] * 3, [(n,)] * 3, seed + 1)
    return [x, bias, res, 1.0 + 0.1 * weight, ln_bias], dout


def test_bias_gelu_fp32():
    x, bias, dout = tensors([torch.float32] * 3, [(R, N), (N,), (R, N)], 0)
    got = run(bias_gelu, [x, bias], dout)
    ref = run(bias_gelu_reference, [x, bias], dout)
    for a, b in zip([got[0], *got[1]], [ref[0], *ref[1]]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bias_dropout_add_layer_norm_fp32_no_dropout_and_3d():
    inputs, dout = ln_inputs(torch.float32, 1, shape=(3, 13, N))
    got = run(lambda *t: bias_dropout_add_layer_norm(*t, 0.1, EPS, False), inputs, dout)  # eval: no dropout
    ref = run(lambda *t: bias_dropout_add_layer_norm_reference(*t, 0.1, EPS, False), inputs, dout)
    assert got[0].shape == (3, 13, N)
    for a, b in zip([got[0], *got[1]], [ref[0], *ref[1]]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_within_twice_pytorch(dtype):
    x, bias, dout = tensors([dtype] * 3, [(R, N), (N,), (R, N)], 2)
    got = run(bias_gelu, [x, bias], dout)
    pt = run(bias_gelu_reference, [x, bias], dout)
    f64 = run(bias_gelu_reference, [x.double(), bias.double()], dout.double())
    for name, ek, et in zip(("y", "dx", "dbias"), errors(got, f64), errors(pt, f64)):
        assert ek <= 2 * et + 1e-6, f"bias_gelu {dtype} {name}: {ek:.3g} > 2 x {et:.3g}"

    inputs, dout = ln_inputs(dtype, 3)
    fn = lambda impl: lambda *t: impl(*t, 0.0, 1e-5, True)  # noqa: E731
    got = run(fn(bias_dropout_add_layer_norm), inputs, dout)
    pt = run(fn(bias_dropout_add_layer_norm_reference), inputs, dout)
    f64 = run(fn(bias_dropout_add_layer_norm_reference), [t.double() for t in inputs], dout.double())
    for name, ek, et in zip(
        ("y", "dx", "dbias", "dresidual", "dweight", "dln_bias"), errors(got, f64), errors(pt, f64)
    ):
        assert ek <= 2 * et + 1e-6, f"layer_norm {dtype} {name}: {ek:.3g} > 2 x {et:.3g}"


def test_mixed_precision_as_under_autocast():
    """x from a bf16 matmul, residual and parameters fp32: output and grads follow the reference."""
    inputs, dout = ln_inputs(torch.float32, 4)
    inputs[0] = inputs[0].bfloat16()
    got = run(lambda *t: bias_dropout_add_layer_norm(*t, 0.0, EPS, True), inputs, dout)
    ref = run(lambda *t: bias_dropout_add_layer_norm_reference(*t, 0.0, EPS, True), inputs, dout)
    assert got[0].dtype == torch.float32 and got[1][0].dtype == torch.bfloat16
    for a, b in zip([got[0], *got[1]], [ref[0], *ref[1]]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    y = bias_gelu(inputs[0], inputs[1])
    assert y.dtype == torch.bfloat16


def test_dropout_mask_is_reported_used_in_backward_and_reproducible():
    p = 0.25
    inputs, dout = ln_inputs(torch.float32, 5)
    torch.manual_seed(11)
    got = run(lambda *t: bias_dropout_add_layer_norm(*t, p, EPS, True), inputs, dout)
    torch.manual_seed(11)
    y_dbg, keep = bias_dropout_add_layer_norm_with_mask(*inputs, p, EPS)
    assert torch.equal(got[0], y_dbg)  # the mask comes from the same kernel call and seed

    def masked_reference(x, bias, res, weight, ln_bias):
        return F.layer_norm(res + (x + bias) * keep / (1 - p), (N,), weight, ln_bias, EPS)

    ref = run(masked_reference, [t.double() for t in inputs], dout.double())
    for a, b in zip([got[0], *got[1]], [ref[0], *ref[1]]):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)

    kept = float(keep.float().mean())
    sigma = math.sqrt(p * (1 - p) / keep.numel())
    assert abs(kept - (1 - p)) < 5 * sigma, f"kept {kept:.4f}, expected {1 - p}"
    torch.manual_seed(11)
    again = bias_dropout_add_layer_norm(*inputs, p, EPS, True)
    torch.manual_seed(12)
    other = bias_dropout_add_layer_norm(*inputs, p, EPS, True)
    assert torch.equal(again, got[0]) and not torch.equal(other, got[0])


def test_bad_shapes_are_named():
    inputs, _ = ln_inputs(torch.float32, 6)
    with pytest.raises(ValueError, match="weight"):
        bias_dropout_add_layer_norm(inputs[0], inputs[1], inputs[2], inputs[3][:-1], inputs[4], 0.0, EPS, True)
    with pytest.raises(ValueError, match="bias"):
        bias_gelu(inputs[0], inputs[1][:5])
