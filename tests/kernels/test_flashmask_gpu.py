"""FlashMask on a CUDA GPU, compiled: outputs and gradients against the dense reference on a
packed BERT-large-shaped batch, exact tile counts at the GPU's tile sizes, seeded dropout.
Skipped (with the reason) where there is no GPU; the CPU tests run the same kernels in
Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none found)"),
]


def _batch(dtype, seed=0):
    from kernels.masks import document_mask

    lens = [[128, 100, 90, 80, 70, 40], [512], [300, 200], [1, 255, 3, 200]]
    spec = document_mask(lens, 512)
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(4, 512, 16, 64, generator=g).to("cuda", dtype) for _ in range(4))
    return spec._replace(startend_row_indices=spec.startend_row_indices.cuda()), (q, k, v), dout


def _run(fn, qkv, dout):
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv)
    out = fn(q, k, v)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_kernel_error_within_twice_pytorch(dtype):
    from kernels.flashmask import flashmask_attention
    from kernels.masks import flashmask_reference

    spec, qkv, dout = _batch(dtype)
    got = _run(lambda q, k, v: flashmask_attention(q, k, v, *spec), qkv, dout)
    pt = _run(lambda q, k, v: flashmask_reference(q, k, v, *spec), qkv, dout)
    exact = _run(lambda q, k, v: flashmask_reference(q, k, v, *spec), [x.double() for x in qkv], dout.double())
    for name, a, p, e in zip(("out", "dq", "dk", "dv"), got, pt, exact):
        ek, et = float((a.double() - e).abs().max()), float((p.double() - e).abs().max())
        assert ek <= 2 * et + 1e-6, f"{dtype} {name}: kernel error {ek:.3g} > 2 x PyTorch's {et:.3g}"


def test_compiled_tile_counts_are_exact():
    from kernels.flashmask import flashmask_tile_counts
    from kernels.masks import reference_tile_counts

    spec, (q, k, v), _ = _batch(torch.bfloat16)
    for name, (got, blocks) in flashmask_tile_counts(q, k, v, *spec).items():
        want = reference_tile_counts(spec.startend_row_indices.cpu(), spec.causal, 512, 16, *blocks)
        assert got[:3] == want[:3], f"{name}: kernel {got}, dense mask {want}"


def test_compiled_dropout_is_seeded():
    from kernels.flashmask import flashmask_attention

    spec, (q, k, v), _ = _batch(torch.bfloat16)
    outs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        outs.append(flashmask_attention(q, k, v, *spec, dropout_p=0.1))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
