"""The sliding window (|i - j| <= window // 2 inside each sequence) in the pure-PyTorch paths:
the ``reference``, ``padded`` and ``sdpa`` backends, the packed layout's document-plus-window bounds, and
the registry's refusal of a window where a backend has none.

Every check is against a dense banded mask written here over the whole flat batch (no
per-sequence loop, no code from ``kernels/``): query t sees key u when both lie in one
sequence and |t - u| <= window // 2. Windows are drawn at random from a seeded generator;
lengths are odd (1, 97, ...), and a window of at least twice the longest sequence must equal
no window bitwise.
"""

import math

import pytest
import torch

from kernels import masks, registry
from kernels.interface import BackendUnavailable, PackedLayout, PaddedLayout, VarlenLayout, requested_settings
from kernels.reference import padded_attention, reference_attention, sdpa_attention

LENGTHS = [1, 97, 33, 2, 5]


def inputs(lengths, heads=2, dim=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, heads, dim, generator=g, dtype=dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def dense_banded(q, k, v, lengths, window):
    """Attention over the flat batch with the block-diagonal, banded mask."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    t = torch.arange(seq.numel())
    allowed = seq[:, None] == seq[None, :]
    if window is not None:
        allowed &= (t[:, None] - t[None, :]).abs() <= window // 2
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hts,shd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def to_padded(x, lengths):
    s = max(lengths)
    key_mask = torch.arange(s)[None] < torch.tensor(lengths)[:, None]  # [B, S]
    dest = key_mask.flatten().nonzero().squeeze(1)
    buf = x.new_zeros(len(lengths) * s, *x.shape[1:])
    buf[dest] = x
    return buf, key_mask, dest


def windows():
    g = torch.Generator().manual_seed(23)
    return [1, 2, 3, *torch.randint(1, 2 * max(LENGTHS), (5,), generator=g).tolist()]


@pytest.mark.parametrize("window", windows())
@pytest.mark.parametrize("backend", [reference_attention, padded_attention, sdpa_attention])
def test_varlen_window_against_the_dense_band(backend, window):
    q, k, v, cu = inputs(LENGTHS, seed=window)
    out = backend(q, k, v, VarlenLayout(cu, max(LENGTHS), window=window), 0.1, False)
    torch.testing.assert_close(out, dense_banded(q, k, v, LENGTHS, window), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [2, 7, 40])
def test_padded_layout_window_against_the_dense_band(window):
    q, k, v, _ = inputs(LENGTHS, seed=3)
    (qp, key_mask, dest), (kp, _, _), (vp, _, _) = (to_padded(x, LENGTHS) for x in (q, k, v))
    layout = PaddedLayout(key_mask, window=window)
    want = dense_banded(q, k, v, LENGTHS, window)
    for backend in (reference_attention, padded_attention):
        out = backend(qp, kp, vp, layout, 0.0, False)
        assert not out.isnan().any()  # padding queries far from every real key included
        torch.testing.assert_close(out[dest], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", [reference_attention, padded_attention, sdpa_attention])
def test_a_window_twice_the_longest_sequence_is_no_window_bitwise(backend):
    q, k, v, cu = inputs(LENGTHS, seed=5, dtype=torch.float32)
    plain = backend(q, k, v, VarlenLayout(cu, max(LENGTHS)), 0.0, False)
    for window in (2 * max(LENGTHS), 2 * max(LENGTHS) + 1, 10_000):
        assert torch.equal(backend(q, k, v, VarlenLayout(cu, max(LENGTHS), window=window), 0.0, False), plain)


def test_window_gradients_agree_between_reference_padded_and_sdpa():
    grads = []
    for backend in (reference_attention, padded_attention, sdpa_attention):
        q, k, v, cu = inputs(LENGTHS, seed=6)
        for x in (q, k, v):
            x.requires_grad_(True)
        backend(q, k, v, VarlenLayout(cu, max(LENGTHS), window=6), 0.0, False).square().sum().backward()
        grads.append([x.grad for x in (q, k, v)])
    for want, *others in zip(*grads):
        for got in others:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "128"])
def test_a_bad_window_is_named(bad):
    with pytest.raises(ValueError, match="window: must be an int >= 1"):
        VarlenLayout(torch.tensor([0, 4], dtype=torch.int32), 4, window=bad)


# ------------------------------------------------------------------- packed: document + window


def dense_document_window(row_lengths, seqlen, window):
    """[R, 1, S, S] True = masked: keys outside the query's document or band; padding masked."""
    out = []
    for lengths in row_lengths:
        doc = torch.full((seqlen,), -1)
        doc[: sum(lengths)] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        i = torch.arange(seqlen)
        seen = (doc[:, None] == doc[None, :]) & (doc[None, :] >= 0) & ((i[:, None] - i[None, :]).abs() <= window // 2)
        out.append(~seen)
    return torch.stack(out)[:, None]


@pytest.mark.parametrize("window", [1, 2, 5, 16, 64, 200])
def test_document_window_mask_is_its_definition(window):
    rows, s = [[30, 1, 17, 9], [63], [2, 3]], 63
    want = dense_document_window(rows, s, window)
    spec = masks.document_window_mask(rows, s, window)
    assert spec.startend_row_indices.shape == (3, 1, s, 4) and spec.startend_row_indices.dtype == torch.int32
    assert not spec.causal
    assert torch.equal(masks.to_dense(*spec, s), want)
    two = masks.document_window_mask(rows, s, window, n=2)
    assert two.startend_row_indices.shape == (3, 1, s, 2) and torch.equal(masks.to_dense(*two, s), want)


def test_window_bounds_of_the_packed_batch_equal_the_builder():
    rows, s = [[10, 20, 5], [33]], 40
    doc = masks.document_mask(rows, s).startend_row_indices
    assert torch.equal(masks.window_bounds(doc, 6), masks.document_window_mask(rows, s, 6).startend_row_indices)
    wide = masks.window_bounds(doc, 2 * s)
    assert torch.equal(masks.to_dense(wide, False, s), masks.to_dense(doc, False, s))
    with pytest.raises(ValueError, match="window_bounds"):
        masks.window_bounds(masks.global_sliding_window_mask(1, s, 2, 3).startend_row_indices, 4)


def test_packed_reference_with_a_window_equals_varlen_reference():
    rows, s, window = [[30, 1, 17], [40]], 48, 9
    lengths = [n for row in rows for n in row]
    q, k, v, cu = inputs(lengths, seed=8)
    want = reference_attention(q, k, v, VarlenLayout(cu, max(lengths), window=window), 0.0, False)

    def pack(x):  # [T, H, D] -> [R*S, H, D], each row's sequences then zeros
        buf = x.new_zeros(len(rows) * s, *x.shape[1:])
        at, flat = 0, []
        for r, row in enumerate(rows):
            n = sum(row)
            buf[r * s : r * s + n] = x[at : at + n]
            flat.append(torch.arange(r * s, r * s + n))
            at += n
        return buf, torch.cat(flat)

    (qp, real), (kp, _), (vp, _) = pack(q), pack(k), pack(v)
    layout = PackedLayout(masks.document_window_mask(rows, s, window).startend_row_indices)
    got = reference_attention(qp, kp, vp, layout, 0.0, False)
    torch.testing.assert_close(got[real], want, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------ the registry


def test_torch_varlen_refuses_a_window_in_one_line():
    reason = registry.refusal("torch_varlen", VarlenLayout, ["window"])
    assert reason == (
        "model.attention=torch_varlen: does not implement the attention setting 'window' (VarlenLayout); "
        "backends that do: reference, padded, sdpa, triton, triton_grouped, flash_attn"
    )
    assert registry.refusal("flash_attn", VarlenLayout, ["window"]) is None


def test_every_call_is_checked_against_what_the_backend_declares(monkeypatch):
    """A backend without the window is refused it before its code runs, whatever the code."""
    calls = []
    monkeypatch.setitem(
        registry.BACKENDS, "plain", registry.Backend("plain", "kernels.reference:reference_attention", (VarlenLayout,))
    )
    monkeypatch.setattr("kernels.reference.reference_attention", lambda *a: calls.append(a) or a[0])
    fn = registry.get_backend("plain")
    q, k, v, cu = inputs([4, 3])
    fn(q, k, v, VarlenLayout(cu, 4), 0.0, False)
    with pytest.raises(BackendUnavailable, match=r"^model.attention=plain: does not implement .*'window'"):
        fn(q, k, v, VarlenLayout(cu, 4, window=2), 0.0, False)
    with pytest.raises(BackendUnavailable, match=r"^model.attention=plain: needs a VarlenLayout .* got PaddedLayout"):
        fn(q, k, v, PaddedLayout(torch.ones(1, 7, dtype=torch.bool)), 0.0, False)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="takes no option"):
        registry.get_backend("plain", buckets=(128,))


def test_settings_a_layout_turns_on():
    cu = torch.tensor([0, 4], dtype=torch.int32)
    assert requested_settings(VarlenLayout(cu, 4)) == {}
    assert requested_settings(VarlenLayout(cu, 4, window=128)) == {"window": 128}
    assert requested_settings(PackedLayout(torch.zeros(1, 1, 4, 2, dtype=torch.int32))) == {}


def test_every_backend_target_exists():
    """Each registered "module:attribute" names a function (imports the module, runs nothing)."""
    import importlib

    for spec in registry.BACKENDS.values():
        module, attribute = spec.target.split(":")
        assert callable(getattr(importlib.import_module(module), attribute)), spec.name
