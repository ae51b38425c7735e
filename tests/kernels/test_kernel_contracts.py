"""Contracts the attention kernels enforce: max_seqlen bounds the longest sequence, fp32
inputs follow torch's TF32 switch, and every kernel module imports on torch 2.7 (whose
``torch.library.custom_op`` has no ``tags=``). Runs in Triton's interpreter on CPU."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import flashmask as fm  # noqa: E402
from kernels import masks  # noqa: E402
from kernels.runtime import jit_kernels  # noqa: E402
from kernels.varlen_attention import grouped_varlen_attention, varlen_attention  # noqa: E402
from tests.helpers import REPO as ROOT  # noqa: E402


def _qkv(t, heads=1, dim=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(t, heads, dim, generator=g, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("grouped", [False, True])
def test_max_seqlen_below_the_longest_sequence_is_an_error(grouped):
    q, k, v = _qkv(40)
    cu = torch.tensor([0, 10, 40], dtype=torch.int32)  # lengths 10, 30
    fn = grouped_varlen_attention if grouped else varlen_attention
    with pytest.raises(
        ValueError,
        match=r"max_seqlen=29 is smaller than the longest sequence \(30 tokens, "
        r"sequence 1",
    ):
        fn(q, k, v, cu, 29)
    assert fn(q, k, v, cu, 30).shape == q.shape  # exactly the longest: fine


def _recorded_precisions(monkeypatch, module, call):
    seen = []

    def record(kernel, grid, *args, **kwargs):
        seen.append(kwargs["DOT_PRECISION"])

    monkeypatch.setattr(module, "_launch", record)
    call()
    return seen


@pytest.fixture
def tf32_switch():
    """Sets torch.backends.cuda.matmul.allow_tf32 (a property, not an attribute) and restores it."""
    saved = torch.backends.cuda.matmul.allow_tf32
    yield lambda on: setattr(torch.backends.cuda.matmul, "allow_tf32", on)
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_fp32_dot_precision_follows_torch_tf32_switch(monkeypatch, tf32_switch, allow_tf32):
    """fp32 launches multiply in TF32 exactly when torch.backends.cuda.matmul.allow_tf32 is set
    (the launch is recorded, not run: the interpreter ignores the precision)."""
    tf32_switch(allow_tf32)
    want = "tf32" if allow_tf32 else "ieee"
    q, k, v = (x.requires_grad_() for x in _qkv(8))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    seen = _recorded_precisions(
        monkeypatch, jit_kernels(q.device), lambda: varlen_attention(q, k, v, cu, 8).sum().backward()
    )
    assert seen == [want] * 3  # forward, dK/dV, dQ
    qb, kb, vb = (x.detach().view(1, 8, 1, 16).requires_grad_() for x in (q, k, v))
    spec = masks.causal_mask(1, 8)
    seen = _recorded_precisions(
        monkeypatch, jit_kernels(q.device), lambda: fm.flashmask_attention(qb, kb, vb, *spec).sum().backward()
    )
    assert seen == [want] * 3


SHIM = """
import torch
_custom_op = torch.library.custom_op

def custom_op(name, fn=None, /, *, mutates_args, device_types=None, schema=None):  # torch 2.7's signature
    return _custom_op(name, fn, mutates_args=mutates_args, device_types=device_types, schema=schema)

torch.library.custom_op = custom_op
import importlib, pkgutil, kernels
names = [m.name for m in pkgutil.walk_packages(kernels.__path__, "kernels.") if not m.name.endswith("_jit")]
for name in names:
    importlib.import_module(name)
print(" ".join(sorted(n.removeprefix("kernels.") for n in names)))
"""


def test_kernel_modules_import_without_custom_op_tags():
    """Feature detection, not version strings: on a custom_op without ``tags=`` every kernel
    module still imports (the seeded ops just go untagged)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SHIM], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {"flashmask", "varlen_attention", "ops.fused", "ops.rotary", "grouped"} <= set(proc.stdout.split())
