"""The FFN-in's three bias+GELU implementations (eager, the Triton kernel in the interpreter,
the GEMM epilogue) against an fp32 reference, forward and backward, on awkward shapes.

Rule (flash-attention's): in fp32 each is within 1e-5 of the reference; in bf16 each one's
error against the fp32 reference is at most twice plain PyTorch's own bf16 error (eager
F.linear + F.gelu under bf16), plus the tanh-vs-erf GELU gap (<= 4.8e-4) where the backend's
epilogue computes the tanh approximation.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.ops.fused import bias_gelu  # noqa: E402
from kernels.ops.gemm_epilogue import epilogue_gelu, linear_bias_gelu, linear_bias_gelu_reference  # noqa: E402

SHAPES = [(1, 16, 32), (37, 48, 96), (97, 64, 200)]  # (N tokens, C in, I out): odd N, I not a power of two
TANH_GAP = 4.8e-4  # max |erf GELU - tanh GELU| over the reals (4.73e-4 at |x| = 2.70)


def eager(x, w, b):
    return F.gelu(F.linear(x, w, b))


def triton(x, w, b):
    return bias_gelu(F.linear(x, w), b)


IMPLS = {"eager": eager, "triton": triton, "epilogue": linear_bias_gelu}


def inputs(n, c, i, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g)
    w = torch.randn(i, c, generator=g) / c**0.5
    b = torch.randn(i, generator=g)
    dy = torch.randn(n, i, generator=g)
    return x, w, b, dy


def run(fn, x, w, b, dy, dtype):
    leaves = [t.detach().clone().to(dtype).requires_grad_() for t in (x, w, b)]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    return [y.detach().float()] + [t.grad.float() for t in leaves]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_matches_the_reference(impl, shape):
    x, w, b, dy = inputs(*shape, seed=shape[0])
    ref = run(linear_bias_gelu_reference, x.double(), w.double(), b.double(), dy.double(), torch.float64)
    got = run(IMPLS[impl], x, w, b, dy, torch.float32)
    gap = TANH_GAP if impl == "epilogue" and epilogue_gelu(x.device) == "tanh" else 0.0
    for name, g, r in zip(("y", "dx", "dw", "db"), got, ref):
        torch.testing.assert_close(g, r.float(), atol=1e-5 + gap * r.abs().max().item(), rtol=1e-5, msg=name)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_error_is_at_most_twice_pytorchs(impl, shape):
    assert_bf16_within_twice_pytorchs_error(impl, *inputs(*shape, seed=shape[0] + 1))


def assert_bf16_within_twice_pytorchs_error(impl, x, w, b, dy):
    ref = run(linear_bias_gelu_reference, x, w, b, dy, torch.float32)
    base = run(eager, x, w, b, dy, torch.bfloat16)
    got = run(IMPLS[impl], x, w, b, dy, torch.bfloat16)
    gap = TANH_GAP if impl == "epilogue" and epilogue_gelu(x.device) == "tanh" else 0.0
    for name, g, p, r in zip(("y", "dx", "dw", "db"), got, base, ref):
        err, allowed = (g - r).abs().max().item(), 2 * (p - r).abs().max().item() + gap * r.abs().max().item()
        assert err <= allowed, f"{impl} {name}: max error {err:.3g} > {allowed:.3g}"


def test_epilogue_under_autocast_gives_the_autocast_dtype():
    x, w, b, _ = inputs(37, 48, 96, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear_bias_gelu(x, w, b)
    assert y.dtype == torch.bfloat16
    ref = linear_bias_gelu_reference(x, w, b)
    assert (y.float() - ref).abs().max().item() <= 0.05 * ref.abs().max().item()


def test_epilogue_probe_names_the_cpu_gelu():
    # ATen's CPU _addmm_activation applies erf GELU after the GEMM.
    assert epilogue_gelu(torch.device("cpu")) == "none"


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        linear_bias_gelu(torch.randn(4, 8), torch.randn(16, 9), torch.randn(16))


@pytest.mark.parametrize("impl", ["eager", "triton", "epilogue"])
def test_model_layers_agree_across_implementations(impl):
    """The model's FFN-in choice (model.bias_gelu) changes no number beyond fp32 rounding."""
    from bert.model.config import BertConfig
    from bert.model.pretraining import BertForPreTraining
    from tests.batches import random_batch

    config = BertConfig.preset("tiny", vocab_size=96, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    batch = random_batch([5, 17, 33], 96, seed=3)
    out = {}
    for name in ("eager", impl):
        torch.manual_seed(0)
        model = BertForPreTraining(config, bias_gelu=name)
        logits = model(batch).mlm_logits
        logits.square().mean().backward()
        out[name] = (logits.detach(), model.layers[0].ffn_in.weight.grad)
    torch.testing.assert_close(out[impl][0], out["eager"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[impl][1], out["eager"][1], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_on_the_gpu_within_twice_pytorchs_error(impl):
    """cuBLASLt's GELU epilogue (and the compiled Triton kernel) at BERT-large's FFN-in width."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kernels.runtime import triton_interpreted

    if impl == "triton" and triton_interpreted():
        pytest.skip("Triton runs in interpreter mode in this process; set TRITON_INTERPRET=0")
    assert_bf16_within_twice_pytorchs_error(impl, *(t.cuda() for t in inputs(1001, 1024, 4096, seed=7)))
