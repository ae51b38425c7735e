"""The reference and padded attention backends agree, with and without dropout."""

import math

import pytest
import torch

from kernels.interface import BackendUnavailable, PaddedLayout, VarlenLayout
from kernels.reference import padded_attention, reference_attention
from kernels.registry import get_backend


def varlen_inputs(lengths, heads=3, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, heads, dim, generator=g) for _ in range(3))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return q, k, v, VarlenLayout(cu, max(lengths))


def dense_reference(q, k, v, lengths):
    """Attention over the whole flat batch with a block-diagonal mask (no per-sequence loop)."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = seq[:, None] == seq[None, :]  # [T, T]
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v)


@pytest.mark.parametrize("backend", [reference_attention, padded_attention])
def test_against_dense_mask(backend):
    lengths = [1, 2, 97, 64, 5]
    q, k, v, layout = varlen_inputs(lengths)
    out = backend(q, k, v, layout, 0.1, False)  # dropout_p ignored when not training
    torch.testing.assert_close(out, dense_reference(q, k, v, lengths), rtol=1e-5, atol=1e-5)


def test_reference_and_padded_agree_on_padded_layout():
    lengths = [7, 3, 12]
    q, k, v, layout = varlen_inputs(lengths, heads=2, dim=8, seed=1)
    s = 12
    mask = torch.arange(s)[None] < torch.tensor(lengths)[:, None]
    dest = mask.flatten().nonzero().squeeze(1)

    def to_padded(x):
        buf = x.new_zeros(len(lengths) * s, *x.shape[1:])
        buf[dest] = x
        return buf

    pl = PaddedLayout(mask)
    a = reference_attention(to_padded(q), to_padded(k), to_padded(v), pl, 0.0, False)[dest]
    b = padded_attention(to_padded(q), to_padded(k), to_padded(v), pl, 0.0, False)[dest]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a, dense_reference(q, k, v, lengths), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", [reference_attention, padded_attention])
def test_dropout_when_training(backend):
    q, k, v, layout = varlen_inputs([40, 30], heads=2, dim=8, seed=2)
    torch.manual_seed(0)
    a = backend(q, k, v, layout, 0.5, True)
    torch.manual_seed(1)
    b = backend(q, k, v, layout, 0.5, True)
    clean = backend(q, k, v, layout, 0.5, False)
    assert not torch.allclose(a, b) and not torch.allclose(a, clean)
    # Inverted dropout keeps the expectation: the mean over many draws approaches the clean output.
    torch.manual_seed(3)
    mean = torch.stack([backend(q, k, v, layout, 0.5, True) for _ in range(300)]).mean(0)
    assert (mean - clean).abs().mean() < 0.1 * clean.abs().mean() + 0.02


def test_gradients_agree():
    lengths = [3, 17, 1, 9]
    outs = []
    for backend in (reference_attention, padded_attention):
        q, k, v, layout = varlen_inputs(lengths, seed=4)
        for x in (q, k, v):
            x.requires_grad_(True)
        backend(q, k, v, layout, 0.0, False).square().sum().backward()
        outs.append([x.grad for x in (q, k, v)])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(BackendUnavailable, match="model.attention: unknown backend 'fast'"):
        get_backend("fast")
