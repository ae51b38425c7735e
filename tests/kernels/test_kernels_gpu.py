"""GPU-only checks of the compiled Triton kernels (and the library backends) against references.

Skipped, with the reason, without a CUDA GPU or when this process's Triton runs in
interpreter mode (the CPU kernel tests set TRITON_INTERPRET=1 unless it is set: run these
with TRITON_INTERPRET=0, as bench/gpu_check.sh does). Nothing touches the GPU at import.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.interface import VarlenLayout
from kernels.reference import reference_attention
from kernels.registry import get_backend

pytestmark = pytest.mark.gpu

AWKWARD = [1, 2, 63, 64, 65, 97, 128, 200, 511, 512]


@pytest.fixture(autouse=True)
def compiled_triton_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kernels.runtime import triton_available, triton_interpreted

    if triton_available():
        pytest.skip(triton_available())
    if triton_interpreted():
        pytest.skip(
            "Triton runs in interpreter mode in this process; set TRITON_INTERPRET=0 to test the compiled kernels"
        )


def mlperf_like_lengths(n, seed):
    import numpy as np

    from bench.lengths import builtin_lengths

    return [int(x) for x in builtin_lengths(np.random.default_rng(seed), n)]


def inputs(lengths, heads, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    qkv = torch.randn(t, 3, heads, dim, generator=g).to("cuda", dtype)
    dout = torch.randn(t, heads, dim, generator=g).to("cuda", dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return qkv, dout, cu


def run(fn, qkv, dout):
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv.unbind(1))
    out = fn(q, k, v)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def errors(got, ref):
    return [float((a.double() - b.double()).abs().max()) for a, b in zip(got, ref)]


@pytest.mark.parametrize(
    "backend,dtype,dim",
    [
        ("triton", torch.bfloat16, 64),
        ("triton_grouped", torch.bfloat16, 64),
        ("triton", torch.float16, 64),
        ("triton", torch.bfloat16, 128),
        ("triton", torch.float16, 32),
    ],
)
def test_low_precision_within_twice_pytorch(backend, dtype, dim):
    lengths = AWKWARD + mlperf_like_lengths(10, seed=dim)
    qkv, dout, cu = inputs(lengths, 16 if dim == 64 else 4, dim, dtype, seed=dim)
    layout = VarlenLayout(cu, max(lengths))
    fn = get_backend(backend)
    got = run(lambda q, k, v: fn(q, k, v, layout, 0.0, True), qkv, dout)
    pt = run(lambda q, k, v: reference_attention(q, k, v, layout, 0.0, False), qkv, dout)
    f64 = run(lambda q, k, v: reference_attention(q, k, v, layout, 0.0, False), qkv.double(), dout.double())
    for name, ek, et in zip(("out", "dq", "dk", "dv"), errors(got, f64), errors(pt, f64)):
        assert ek <= 2 * et + 1e-6, f"{backend} {dtype} D={dim} {name}: {ek:.3g} > 2 x PyTorch's {et:.3g}"


def test_fp32_within_1e5():
    lengths = AWKWARD
    qkv, dout, cu = inputs(lengths, 3, 64, torch.float32, seed=1)
    layout = VarlenLayout(cu, max(lengths))
    fn = get_backend("triton")
    got = run(lambda q, k, v: fn(q, k, v, layout, 0.0, True), qkv, dout)
    ref = run(lambda q, k, v: reference_attention(q, k, v, layout, 0.0, False), qkv.double(), dout.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_dropout_mask_consistent_and_grouped_identical():
    from kernels.varlen_attention import grouped_varlen_attention, varlen_attention
    from tests.kernels.dropout_masks import varlen_attention_with_dropout_mask

    p = 0.1
    lengths = [1, 97, 200, 300, 511, 512, 64, 130]
    qkv, dout, cu = inputs(lengths, 4, 64, torch.float32, seed=2)
    s = max(lengths)
    torch.manual_seed(5)
    single = run(lambda q, k, v: varlen_attention(q, k, v, cu, s, dropout_p=p), qkv, dout)
    torch.manual_seed(5)
    grouped = run(lambda q, k, v: grouped_varlen_attention(q, k, v, cu, s, dropout_p=p), qkv, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), single, grouped):
        assert torch.equal(a, b), f"grouped (4 streams) and single launch differ in {name}"
    torch.manual_seed(5)
    out_dbg, keep = varlen_attention_with_dropout_mask(*qkv.unbind(1), cu, s, p)
    assert torch.equal(out_dbg, single[0])

    def masked(q, k, v):
        out = torch.empty_like(q)
        bounds = cu.tolist()
        for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            n = end - start
            qh, kh, vh = (x[start:end].transpose(0, 1) for x in (q, k, v))
            probs = ((qh @ kh.transpose(-1, -2)) / math.sqrt(q.shape[-1])).softmax(-1)
            out[start:end] = ((probs * keep[b, :, :n, :n] / (1 - p)) @ vh).transpose(0, 1)
        return out

    ref = run(masked, qkv.double(), dout.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), single, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    inside = sum(n * n for n in lengths) * 4
    kept = float(keep.sum()) / inside
    assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / inside)


def test_torch_compile_inductor_fullgraph():
    from kernels.varlen_attention import varlen_attention

    lengths = [5, 300, 64]
    qkv, dout, cu = inputs(lengths, 4, 64, torch.bfloat16, seed=3)

    def f(q, k, v):
        return varlen_attention(q * 1.25, k, v, cu, 300).float().sin()

    eager = run(f, qkv, dout.float())
    torch._dynamo.reset()
    compiled = run(torch.compile(f, fullgraph=True), qkv, dout.float())
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["torch_varlen", "flash_attn"])
def test_library_backends_match_reference(name):
    from kernels.interface import BackendUnavailable

    try:
        fn = get_backend(name)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    lengths = AWKWARD
    qkv, dout, cu = inputs(lengths, 16, 64, torch.bfloat16, seed=4)
    layout = VarlenLayout(cu, max(lengths))
    got = run(lambda q, k, v: fn(q, k, v, layout, 0.0, True), qkv, dout)
    pt = run(lambda q, k, v: reference_attention(q, k, v, layout, 0.0, False), qkv, dout)
    f64 = run(lambda q, k, v: reference_attention(q, k, v, layout, 0.0, False), qkv.double(), dout.double())
    for label, ek, et in zip(("out", "dq", "dk", "dv"), errors(got, f64), errors(pt, f64)):
        assert ek <= 2 * et + 1e-6, f"{name} {label}: {ek:.3g} > 2 x PyTorch's {et:.3g}"


@pytest.mark.parametrize("window", [2, 37, 128, 2 * max(AWKWARD)])
def test_flash_attn_window_matches_the_reference_band(window):
    """flash_attn's window_size=(window // 2, window // 2) is the band |i - j| <= window // 2."""
    from kernels.interface import BackendUnavailable

    try:
        fn = get_backend("flash_attn")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    qkv, dout, cu = inputs(AWKWARD, 8, 64, torch.bfloat16, seed=window)
    layout = VarlenLayout(cu, max(AWKWARD), window=window)
    got = run(lambda q, k, v: fn(q, k, v, layout, 0.0, False), qkv, dout)
    pt = run(lambda q, k, v: reference_attention(q, k, v, layout, 0.0, False), qkv, dout)
    f64 = run(lambda q, k, v: reference_attention(q, k, v, layout, 0.0, False), qkv.double(), dout.double())
    for label, ek, et in zip(("out", "dq", "dk", "dv"), errors(got, f64), errors(pt, f64)):
        assert ek <= 2 * et + 1e-6, f"flash_attn window={window} {label}: {ek:.3g} > 2 x PyTorch's {et:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_ops_within_twice_pytorch(dtype):
    from kernels.ops.fused import (
        bias_dropout_add_layer_norm,
        bias_dropout_add_layer_norm_reference,
        bias_gelu,
        bias_gelu_reference,
    )

    g = torch.Generator().manual_seed(6)
    r, n, i = 3000, 1024, 4096

    def make(*shape):
        return torch.randn(*shape, generator=g).to("cuda", dtype)

    def grads(fn, tensors, dout):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out = fn(*leaves)
        out.backward(dout.to(out.dtype))
        return [out.detach()] + [t.grad for t in leaves]

    x, b, d = make(r, i), make(i), make(r, i)
    got, pt = grads(bias_gelu, [x, b], d), grads(bias_gelu_reference, [x, b], d)
    f64 = grads(bias_gelu_reference, [x.double(), b.double()], d.double())
    for ek, et in zip(errors(got, f64), errors(pt, f64)):
        assert ek <= 2 * et + 1e-6
    ln = [make(r, n), make(n), make(r, n), 1 + 0.1 * make(n), make(n)]
    d = make(r, n)
    fn = lambda impl: lambda *t: impl(*t, 0.0, 1e-12, True)  # noqa: E731
    got, pt = grads(fn(bias_dropout_add_layer_norm), ln, d), grads(fn(bias_dropout_add_layer_norm_reference), ln, d)
    f64 = grads(fn(bias_dropout_add_layer_norm_reference), [t.double() for t in ln], d.double())
    for ek, et in zip(errors(got, f64), errors(pt, f64)):
        assert ek <= 2 * et + 1e-6


def test_model_step_matches_reference_on_gpu():
    from bert.model.config import BertConfig
    from bert.model.pretraining import BertForPreTraining
    from tests.batches import random_batch

    torch.manual_seed(0)
    config = BertConfig.preset("small", vocab_size=2048)
    batch = random_batch([3, 511, 512, 130, 64, 65], config.vocab_size, seed=1).to("cuda")
    results = []
    state = None
    for attention, fused in (("reference", False), ("triton_grouped", True)):
        with torch.device("cuda"):
            model = BertForPreTraining(config, attention=attention, fused_ops=fused).eval()
        if state is None:
            state = model.state_dict()
        model.load_state_dict(state)
        out = model(batch)
        loss = F.cross_entropy(out.mlm_logits, batch.mlm_labels) + F.cross_entropy(out.nsp_logits, batch.nsp_labels)
        loss.backward()
        results.append((out.mlm_logits.detach(), {k: p.grad for k, p in model.named_parameters()}))
    (ref_logits, ref_grads), (logits, grads) = results
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    for k, gk in grads.items():
        torch.testing.assert_close(gk, ref_grads[k], rtol=1e-3, atol=1e-4, msg=lambda m: f"{k}: {m}")
