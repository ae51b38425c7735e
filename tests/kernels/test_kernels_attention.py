"""The Triton varlen attention kernels, run in Triton's interpreter on CPU, against references.

Triton takes its mode from TRITON_INTERPRET when first imported, so this module sets it
(unless already set) before anything imports Triton. Shapes stay small: the interpreter
runs each program in Python. Tolerances: fp32 within 1e-5 of the ``reference`` backend;
fp16/bf16 by flash-attention's rule, the kernel's error against an fp64 reference at most
twice that of the PyTorch ``reference`` backend in the same precision.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest
import torch  # noqa: E402

from kernels.grouped import Group, plan_groups
from kernels.interface import BackendUnavailable, PaddedLayout, VarlenLayout
from kernels.reference import reference_attention
from kernels.registry import get_backend
from kernels.varlen_attention import varlen_attention, varlen_attention_qkvpacked
from tests.helpers import REPO as ROOT
from tests.kernels.dropout_masks import varlen_attention_with_dropout_mask

# Each side of the interpreter's 32- and 64-row tiles, from one tile to eight (the GPU tests'
# 511 and 512 cross its own tiles; here, where every program runs in Python and the cost grows
# as the square of the length, they took 4x the time of 255 and 256 for the same crossings).
AWKWARD = [1, 2, 63, 64, 65, 97, 128, 200, 255, 256]


def make_inputs(lengths, heads, dim, dtype, seed=0, packed=False):
    """q, k, v [T, H, D] (views of one [T, 3, H, D] tensor when packed), dout, cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    qkv = torch.randn(t, 3, heads, dim, generator=g).to(dtype)
    dout = torch.randn(t, heads, dim, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return qkv, dout, cu


def run(fn, qkv, dout, packed=False):
    """out and (dq, dk, dv) of fn(q, k, v)."""
    qkv = qkv.detach().clone().requires_grad_()
    if packed:
        out = fn(qkv)
        out.backward(dout)
        return out.detach(), tuple(qkv.grad.unbind(1))
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv.unbind(1))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), (q.grad, k.grad, v.grad)


def reference_fn(cu, lengths, dtype=None):
    layout = VarlenLayout(cu, max(lengths))
    return lambda q, k, v: reference_attention(q, k, v, layout, 0.0, False)


def max_errors(out, grads, out_ref, grads_ref):
    return [float((a.double() - b.double()).abs().max()) for a, b in zip((out, *grads), (out_ref, *grads_ref))]


@pytest.mark.parametrize(
    "lengths,heads,dim,packed",
    [
        (AWKWARD, 2, 64, False),
        ([1, 65, 97, 130], 3, 32, True),
        ([2, 64, 97], 1, 128, False),
    ],
)
def test_fp32_matches_reference(lengths, heads, dim, packed):
    qkv, dout, cu = make_inputs(lengths, heads, dim, torch.float32, seed=len(lengths))
    s = max(lengths)
    kernel = (
        (lambda x: varlen_attention_qkvpacked(x, cu, s))
        if packed
        else (lambda q, k, v: varlen_attention(q, k, v, cu, s))
    )
    out, grads = run(kernel, qkv, dout, packed)
    out_ref, grads_ref = run(reference_fn(cu, lengths), qkv, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_ref, *grads_ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize(
    "dtype,dim,lengths",
    [
        (torch.float16, 64, [1, 63, 97, 200]),
        (torch.bfloat16, 64, [1, 63, 97, 200]),
        (torch.bfloat16, 32, [2, 64, 65]),
        (torch.float16, 128, [3, 64, 100]),
    ],
)
def test_low_precision_error_within_twice_pytorch(dtype, dim, lengths):
    heads = 2
    qkv, dout, cu = make_inputs(lengths, heads, dim, dtype, seed=dim)
    s = max(lengths)
    out, grads = run(lambda q, k, v: varlen_attention(q, k, v, cu, s), qkv, dout)
    out_pt, grads_pt = run(reference_fn(cu, lengths), qkv, dout)
    out_64, grads_64 = run(reference_fn(cu, lengths), qkv.double(), dout.double())
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    kernel_err = max_errors(out, grads, out_64, grads_64)
    torch_err = max_errors(out_pt, grads_pt, out_64, grads_64)
    for name, ek, et in zip(("out", "dq", "dk", "dv"), kernel_err, torch_err):
        assert ek <= 2 * et + 1e-6, f"{dtype} D={dim} {name}: kernel error {ek:.3g} > 2 x PyTorch's {et:.3g}"


def masked_reference(q, k, v, cu, keep, p):
    """Attention with an explicit dropout keep mask [B, H, S, S], fp64, sequence by sequence."""
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    bounds = cu.tolist()
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        n = end - start
        q_h, k_h, v_h = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        probs = ((q_h @ k_h.transpose(-1, -2)) * scale).softmax(-1)  # [H, L, L]
        dropped = probs * keep[b, :, :n, :n].to(probs.dtype) / (1.0 - p)
        out[start:end] = (dropped @ v_h).transpose(0, 1)
    return out


def test_dropout_forward_and_backward_use_the_reported_mask():
    lengths, heads, dim, p = [1, 37, 64, 100], 2, 32, 0.3
    qkv, dout, cu = make_inputs(lengths, heads, dim, torch.float32, seed=5)
    s = max(lengths)
    torch.manual_seed(1234)
    out, grads = run(lambda q, k, v: varlen_attention(q, k, v, cu, s, dropout_p=p), qkv, dout)
    torch.manual_seed(1234)
    out_dbg, keep = varlen_attention_with_dropout_mask(*qkv.unbind(1), cu, s, p)
    # The debug call ran the same kernel with the same seed: the mask it reports is the one
    # the forward above applied.
    assert torch.equal(out, out_dbg)
    assert keep.shape == (len(lengths), heads, s, s)
    out_ref, grads_ref = run(lambda q, k, v: masked_reference(q, k, v, cu, keep, p), qkv.double(), dout.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_ref, *grads_ref)):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")

    inside = torch.zeros_like(keep)
    for b, n in enumerate(lengths):
        inside[b, :, :n, :n] = True
    assert not bool((keep & ~inside).any()), "mask reported outside a sequence"
    n = int(inside.sum())
    kept = float(keep.sum()) / n
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept - (1 - p)) < 5 * sigma, f"kept fraction {kept:.4f}, expected {1 - p} +- {5 * sigma:.4f}"


def test_dropout_seed_reproduces_and_differs():
    lengths, heads, dim, p = [40, 70], 2, 32, 0.2
    qkv, _, cu = make_inputs(lengths, heads, dim, torch.float32, seed=6)
    q, k, v = qkv.unbind(1)
    outs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        outs.append(varlen_attention(q, k, v, cu, max(lengths), dropout_p=p))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])
    no_drop = varlen_attention(q, k, v, cu, max(lengths))
    torch.testing.assert_close(
        no_drop, reference_attention(q, k, v, VarlenLayout(cu, max(lengths)), 0.0, False), rtol=1e-5, atol=1e-5
    )


def test_plan_groups_by_bucket_largest_first():
    plan = plan_groups([5, 300, 17, 128, 129, 600, 1], buckets=(128, 256, 512))
    assert plan.order.tolist() == [5, 1, 4, 0, 2, 3, 6]
    assert plan.groups == (Group(0, 1, 600), Group(1, 1, 300), Group(2, 1, 129), Group(3, 4, 128))
    identity = plan_groups([3, 4, 5], buckets=(128,))
    assert identity.order is None and identity.groups == (Group(0, 3, 5),)
    with pytest.raises(ValueError, match="buckets"):
        plan_groups([3], buckets=(256, 128))


def test_backends_through_the_registry():
    lengths = [3, 70, 20]
    qkv, dout, cu = make_inputs(lengths, 2, 32, torch.float32, seed=8)
    layout = VarlenLayout(cu, max(lengths))
    ref = run(lambda q, k, v: reference_attention(q, k, v, layout, 0.0, False), qkv, dout)
    for name in ("triton", "triton_grouped"):
        fn = get_backend(name)
        got = run(lambda q, k, v: fn(q, k, v, layout, 0.1, False), qkv, dout)  # not training: no dropout
        for a, b in zip((got[0], *got[1]), (ref[0], *ref[1])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        q, k, v = qkv.unbind(1)
        with pytest.raises(BackendUnavailable, match="VarlenLayout"):
            fn(q, k, v, PaddedLayout(torch.ones(1, sum(lengths), dtype=torch.bool)), 0.0, False)


@pytest.mark.slow  # a subprocess importing torch and Triton
def test_cpu_without_interpreter_is_a_clear_error():
    """With compiled Triton (no TRITON_INTERPRET), CPU tensors and GPU-less loads are refused."""
    script = """
import torch
from kernels.interface import BackendUnavailable
from kernels.registry import get_backend
from kernels.varlen_attention import varlen_attention
q = torch.zeros(9, 1, 32)
try:
    varlen_attention(q, q, q, torch.tensor([0, 4, 9], dtype=torch.int32), 5)
except BackendUnavailable as e:
    print("call:", e)
if not torch.cuda.is_available():
    for name in ("triton", "triton_grouped", "torch_varlen", "flash_attn"):
        try:
            get_backend(name)
        except BackendUnavailable as e:
            print("load:", e)
"""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("call:") and "TRITON_INTERPRET=1" in lines[0], proc.stdout
    if len(lines) > 1:  # no GPU in the subprocess: every kernel backend refuses to load
        assert len(lines) == 5, proc.stdout
        for line, name in zip(lines[1:], ("triton", "triton_grouped", "torch_varlen", "flash_attn")):
            assert line.startswith(f"load: model.attention={name}:"), line
        assert "TRITON_INTERPRET=1" in lines[1] and "TRITON_INTERPRET=1" in lines[2]


def test_bad_arguments_are_named():
    qkv, _, cu = make_inputs([4, 5], 1, 32, torch.float32)
    q, k, v = qkv.unbind(1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        varlen_attention(q, k, v, cu.long(), 5)
    with pytest.raises(ValueError, match="dtype"):
        varlen_attention(q, k.double(), v, cu, 5)
    with pytest.raises(ValueError, match="dropout_p"):
        varlen_attention(q, k, v, cu, 5, dropout_p=1.0)


def test_torch_compile_traces_through_the_op():
    lengths = [9, 30]
    qkv, dout, cu = make_inputs(lengths, 2, 32, torch.float32, seed=9)
    s = max(lengths)

    def f(q, k, v):
        return varlen_attention(q * 1.5, k, v, cu, s) * 2.0

    eager = run(f, qkv, dout)
    torch._dynamo.reset()
    compiled = run(torch.compile(f, backend="aot_eager", fullgraph=True), qkv, dout)
    for a, b in zip((eager[0], *eager[1]), (compiled[0], *compiled[1])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
