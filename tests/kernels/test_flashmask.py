"""FlashMask: the mask builders against their definitions, the dense reference against torch's
SDPA, and the Triton kernels (run in Triton's interpreter on CPU) against the dense reference:
outputs, gradients, dropout, fully masked rows, and exact tile skipping.

Triton takes its mode from TRITON_INTERPRET when first imported, so this module sets it
(unless already set) before anything imports Triton. The interpreter runs every program in
Python, so each mask type runs fwd+bwd at one of the issue's sizes (1, 63, 65, 200, 512,
rotating) with a few heads, and every type again at seqlen 1 (2 for shared question) and
63 in one cheap test. Tolerances: fp32 1e-5; fp16/bf16: the kernel's error against an fp64
reference at most twice that of the same PyTorch reference run in that precision.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import flashmask as fm  # noqa: E402
from kernels import masks  # noqa: E402
from kernels.interface import BackendUnavailable, PackedLayout, VarlenLayout  # noqa: E402
from kernels.registry import get_backend  # noqa: E402
from tests.helpers import REPO as ROOT  # noqa: E402

# --------------------------------------------------------------------- the masks, by definition


def _doc_ids(lens, seqlen):
    """Per position: document index (-1 on padding) and the document's start."""
    doc = torch.full((seqlen,), -1)
    start = torch.zeros(seqlen, dtype=torch.long)
    at = 0
    for d, n in enumerate(lens):
        doc[at : at + n] = d
        start[at : at + n] = at
        at += n
    return doc, start


def _stack(rows):
    return torch.stack(rows).unsqueeze(1)  # [B, 1, S, S]


def dense_definition(name, args, seqlen):
    """The mask written straight from its definition (True = masked), [B, 1, S, S]."""
    i = torch.arange(seqlen).view(-1, 1)
    j = torch.arange(seqlen).view(1, -1)
    future = i < j
    if name == "causal_mask":
        return _stack([future] * args[0])
    if name == "sliding_window_mask":
        return _stack([future | (i - j >= args[2])] * args[0])
    if name in ("causal_document_mask", "document_mask"):
        rows = []
        for lens in args[0]:
            doc, _ = _doc_ids(lens, seqlen)
            other = (doc.view(-1, 1) != doc.view(1, -1)) | (doc.view(1, -1) < 0)
            rows.append(other | future if name == "causal_document_mask" else other)
        return _stack(rows)
    if name == "shared_question_mask":
        rows = []
        for samples in args[0]:
            sample, part, at = torch.full((seqlen,), -1), torch.full((seqlen,), -1), 0
            for s, parts in enumerate(samples):
                for p, n in enumerate(parts):
                    sample[at : at + n], part[at : at + n] = s, p
                    at += n
            same = (sample.view(-1, 1) == sample.view(1, -1)) & (sample.view(1, -1) >= 0)
            seen = (part.view(-1, 1) == part.view(1, -1)) | (part.view(1, -1) == 0)
            rows.append(~(same & seen) | future)
        return _stack(rows)
    if name == "global_sliding_window_mask":
        b, _, g, w = args
        return _stack([~(((i - j).abs() < w) | (i < g) | (j < g))] * b)
    if name == "causal_blockwise_mask":
        rows = []
        for lens in args[0]:
            blk, _ = _doc_ids(lens, seqlen)
            last = len(lens) - 1
            rows.append(~((blk.view(-1, 1) == blk.view(1, -1)) | (blk.view(-1, 1) == last)) | future)
        return _stack(rows)
    if name == "prefix_lm_causal_mask":
        return _stack([~((j < p) | (j <= i)) for p in args[0]])
    if name == "prefix_lm_document_mask":
        rows = []
        for lens, prefixes in zip(args[0], args[1]):
            doc, start = _doc_ids(lens, seqlen)
            pre = torch.tensor(prefixes)[doc.clamp(min=0)]
            same = (doc.view(-1, 1) == doc.view(1, -1)) & (doc.view(1, -1) >= 0)
            rows.append(~(same & ((j <= i) | (j < (start + pre).view(1, -1)))))
        return _stack(rows)
    if name == "qk_sparse_mask":
        rows = []
        for ks, ke, qs, qe in args[0]:
            dropped_key = (j >= ks) & (j < ke) & (i >= ke)
            dropped_query = (i >= qs) & (i < qe) & (j < qs)
            rows.append(future | dropped_key | dropped_query)
        return _stack(rows)
    raise KeyError(name)


# (builder name, builder args, seqlen, batch, heads, head dim): each type at one of the
# issue's sizes; padding (rows that do not fill seqlen) where the mask can express it.
CASES = [
    ("causal_mask", lambda s: (1, s), 320, 1, 2, 16),
    ("sliding_window_mask", lambda s: (2, s, 37), 200, 2, 2, 32),
    ("causal_document_mask", lambda s: ([[20, 30, 10], [s]], s), 65, 2, 3, 16),
    ("document_mask", lambda s: ([[60, 1, 130, 90, 20]], s), 320, 1, 2, 32),
    ("shared_question_mask", lambda s: ([[[30, 20, 25], [40, 35, 10]], [[50, 60, 70]]], s), 200, 2, 2, 16),
    ("global_sliding_window_mask", lambda s: (2, s, 5, 9), 63, 2, 3, 32),
    ("causal_blockwise_mask", lambda s: ([[50, 50, 100], [13, 87, 60, 40]], s), 200, 2, 2, 16),
    ("prefix_lm_causal_mask", lambda s: ([0, 30], s), 65, 2, 3, 16),
    ("prefix_lm_document_mask", lambda s: ([[60, 90, 30], [s]], [[10, 0, 30], [77]], s), 200, 2, 2, 16),
    ("qk_sparse_mask", lambda s: ([(5, 10, 20, 30), (0, 0, 40, s)], s), 63, 2, 3, 32),
    ("random_eviction_mask", lambda s: (2, s, torch.Generator().manual_seed(5)), 65, 2, 2, 16),
]
MASK_BUILDERS = [name for name, *_ in CASES]  # the builders CASES covers, in kernels.masks' order


def build(name, args):
    return getattr(masks, name)(*args)


def inputs(batch, seqlen, heads, dim, dtype=torch.float32, seed=0, seqlen_k=None):
    g = torch.Generator().manual_seed(seed)
    sk = seqlen if seqlen_k is None else seqlen_k
    q = torch.randn(batch, seqlen, heads, dim, generator=g)
    k, v = (torch.randn(batch, sk, heads, dim, generator=g) for _ in range(2))
    dout = torch.randn(batch, seqlen, heads, dim, generator=g)
    return tuple(x.to(dtype) for x in (q, k, v)), dout.to(dtype)


def run(fn, qkv, dout):
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv)
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), (q.grad, k.grad, v.grad)


def assert_close_all(got, want, rtol=1e-5, atol=1e-5):
    for name, a, b in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (want[0], *want[1])):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------- semantics


def test_to_dense_follows_the_bounds_table():
    s = 6
    # Column j: (LTS, LTE, UTS, UTE) = rows [3, 5) and [0, 2) masked, the rest visible.
    four = torch.tensor([3, 5, 0, 2], dtype=torch.int32).expand(1, 1, s, 4)
    want = torch.tensor([True, True, False, True, True, False]).view(-1, 1).expand(s, s)
    assert torch.equal(masks.to_dense(four, False, s)[0, 0], want)
    # n = 2 bidirectional: (LTS, UTE) -> rows >= LTS and rows < UTE.
    two = torch.tensor([4, 1], dtype=torch.int32).expand(1, 1, s, 2)
    want = torch.tensor([True, False, False, False, True, True]).view(-1, 1).expand(s, s)
    assert torch.equal(masks.to_dense(two, False, s)[0, 0], want)
    # Causal n = 1 and 2: rows i < j as well, then [LTS, seqlen) or [LTS, LTE).
    lts = torch.full((1, 1, s, 1), 4, dtype=torch.int32)
    i, j = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
    assert torch.equal(masks.to_dense(lts, True, s)[0, 0], (i < j) | (i >= 4))
    lts_lte = torch.tensor([2, 4], dtype=torch.int32).expand(1, 1, s, 2)
    assert torch.equal(masks.to_dense(lts_lte, True, s)[0, 0], (i < j) | ((i >= 2) & (i < 4)))


@pytest.mark.parametrize("name,make,seqlen", [(c[0], c[1], c[2]) for c in CASES if c[0] != "random_eviction_mask"])
def test_builders_match_their_definition(name, make, seqlen):
    for s, args in ((seqlen, make(seqlen)), (97, tiny_args(name, 97))):
        spec = build(name, args)
        assert spec.startend_row_indices.dtype == torch.int32 and spec.startend_row_indices.shape[1:3] == (1, s)
        assert torch.equal(masks.to_dense(*spec, s), dense_definition(name, args, s)), f"{name} at seqlen {s}"


def test_random_eviction_evicts_each_key_once_after_it():
    s = 65
    spec = masks.random_eviction_mask(3, s, torch.Generator().manual_seed(1))
    evict = spec.startend_row_indices[..., 0].long()  # [B, 1, S]
    j = torch.arange(s)
    assert spec.causal and bool(((evict > j) & (evict <= s)).all())
    assert evict.unique().numel() > 10  # random, not a constant
    i = torch.arange(s).view(-1, 1)
    assert torch.equal(masks.to_dense(*spec, s), (i < j) | (i >= evict.unsqueeze(-2)))


def test_reference_matches_torch_sdpa_and_zeroes_empty_rows():
    s = 65
    spec = masks.document_mask([[20, 30, 10], [s]], s)  # row 0 has 5 padding rows: fully masked
    (q, k, v), _ = inputs(2, s, 2, 16, dtype=torch.float64, seed=1)
    out = masks.flashmask_reference(q, k, v, *spec)
    mask = masks.to_dense(*spec, s)  # [B, 1, S, S]
    empty = mask.all(-1)  # [B, 1, S]
    assert bool(empty[0, 0, 60:].all()) and not bool(empty[:, :, :60].any())
    sdpa = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=~mask | empty.unsqueeze(-1)
    ).transpose(1, 2)
    visible = ~empty.squeeze(1)  # [B, S]
    torch.testing.assert_close(out[visible], sdpa[visible], rtol=1e-10, atol=1e-10)
    assert bool((out[~visible] == 0).all())


# ------------------------------------------------------------------------- kernel numerics


@pytest.mark.parametrize("name,make,seqlen,batch,heads,dim", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_dense_reference(name, make, seqlen, batch, heads, dim):
    spec = build(name, make(seqlen))
    qkv, dout = inputs(batch, seqlen, heads, dim, seed=seqlen + heads)
    got = run(lambda q, k, v: fm.flashmask_attention(q, k, v, *spec), qkv, dout)
    want = run(lambda q, k, v: masks.flashmask_reference(q, k, v, *spec), qkv, dout)
    assert_close_all(got, want)
    empty = masks.to_dense(*spec, seqlen).all(-1).transpose(1, 2).expand(batch, seqlen, heads)  # [B, S, H]
    assert bool(torch.isfinite(got[0]).all()) and all(bool(torch.isfinite(g).all()) for g in got[1])
    assert bool((got[0][empty] == 0).all()) and bool((got[1][0][empty] == 0).all())


def tiny_args(name, s):
    return {
        "causal_mask": (1, s),
        "sliding_window_mask": (1, s, 5),
        "causal_document_mask": ([[s]], s),
        "document_mask": ([[s]] if s < 3 else [[1, s - 3]], s),
        "shared_question_mask": ([[[1, 1]]] if s < 3 else [[[10, 20], [3, 2, 11]]], s),
        "global_sliding_window_mask": (1, s, 1, 3),
        "causal_blockwise_mask": ([[s]] if s < 3 else [[7, s - 7]], s),
        "prefix_lm_causal_mask": ([s // 2], s),
        "prefix_lm_document_mask": ([[s]], [[s // 3]], s),
        "qk_sparse_mask": ([(0, 0, 0, 0)] if s < 3 else [(3, 9, 30, 40)], s),
        "random_eviction_mask": (1, s, torch.Generator().manual_seed(2)),
    }[name]


@pytest.mark.parametrize("seqlen", [1, 63])
def test_every_mask_at_small_sizes(seqlen):
    for name in MASK_BUILDERS:
        s = 2 if name == "shared_question_mask" and seqlen == 1 else seqlen  # a question and an answer
        spec = build(name, tiny_args(name, s))
        qkv, dout = inputs(1, s, 2, 16, seed=s)
        got = run(lambda q, k, v: fm.flashmask_attention(q, k, v, *spec), qkv, dout)
        want = run(lambda q, k, v: masks.flashmask_reference(q, k, v, *spec), qkv, dout)
        assert_close_all(got, want)


def test_bounds_per_head_and_broadcast():
    s, b, h = 65, 2, 3
    # Per head: a different window for each head (causal, n = 1).
    per_head = torch.cat([masks.sliding_window_mask(b, s, w).startend_row_indices for w in (1, 9, 40)], 1)
    qkv, dout = inputs(b, s, h, 16, seed=3)
    got = run(lambda q, k, v: fm.flashmask_attention(q, k, v, per_head, True), qkv, dout)
    want = run(lambda q, k, v: masks.flashmask_reference(q, k, v, per_head, True), qkv, dout)
    assert_close_all(got, want)
    # Per head with n = 4 on one head and the same bounds repeated: equal to broadcasting them.
    spec = masks.global_sliding_window_mask(b, s, 4, 7)
    repeated = spec.startend_row_indices.expand(b, h, s, 4).contiguous()
    broadcast = run(lambda q, k, v: fm.flashmask_attention(q, k, v, *spec), qkv, dout)
    per = run(lambda q, k, v: fm.flashmask_attention(q, k, v, repeated, False), qkv, dout)
    for a, c in zip((broadcast[0], *broadcast[1]), (per[0], *per[1])):
        assert torch.equal(a, c)


def test_cross_attention_lengths_and_strided_inputs():
    sq, sk, b, h = 40, 70, 2, 2
    g = torch.Generator().manual_seed(4)
    bounds = torch.randint(0, sq + 1, (b, 1, sk, 2), generator=g).to(torch.int32)  # (LTS, UTE)
    (q, k, v), dout = inputs(b, sq, h, 32, seed=4, seqlen_k=sk)
    qkv_strided = (q, torch.cat([k, v], 2)[:, :, :h], torch.cat([k, v], 2)[:, :, h:])  # head-strided views
    got = run(lambda q_, k_, v_: fm.flashmask_attention(q_, k_, v_, bounds), qkv_strided, dout)
    want = run(lambda q_, k_, v_: masks.flashmask_reference(q_, k_, v_, bounds), (q, k, v), dout)
    assert_close_all(got, want)


@pytest.mark.parametrize(
    "dtype,name,seqlen", [(torch.bfloat16, "document_mask", 200), (torch.float16, "causal_blockwise_mask", 65)]
)
def test_low_precision_error_within_twice_pytorch(dtype, name, seqlen):
    args = ([[60, 90, 30], [seqlen]], seqlen) if name == "document_mask" else ([[20, 45], [5, 30, 30]], seqlen)
    spec = build(name, args)
    qkv, dout = inputs(2, seqlen, 2, 32, dtype=dtype, seed=7)
    got = run(lambda q, k, v: fm.flashmask_attention(q, k, v, *spec), qkv, dout)
    pt = run(lambda q, k, v: masks.flashmask_reference(q, k, v, *spec), qkv, dout)
    exact = run(
        lambda q, k, v: masks.flashmask_reference(q, k, v, *spec), tuple(x.double() for x in qkv), dout.double()
    )
    assert got[0].dtype == dtype and all(g.dtype == dtype for g in got[1])
    for what, a, p, e in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (pt[0], *pt[1]), (exact[0], *exact[1])):
        err_kernel = float((a.double() - e).abs().max())
        err_torch = float((p.double() - e).abs().max())
        assert err_kernel <= 2 * err_torch + 1e-6, f"{dtype} {what}: {err_kernel:.3g} > 2 x PyTorch's {err_torch:.3g}"


def test_fully_masked_rows_give_zeros_never_nan():
    s, b, h = 63, 2, 2
    # Rows 10..19 and 50..62 see no key at all (n = 4, both intervals used), other rows some.
    lts = torch.full((s,), 50)
    lte = torch.full((s,), s)
    uts = torch.full((s,), 10)
    ute = torch.full((s,), 20)
    bounds = torch.stack([lts, lte, uts, ute], -1).to(torch.int32).expand(b, 1, s, 4).contiguous()
    for dtype in (torch.float32, torch.bfloat16):
        qkv, dout = inputs(b, s, h, 16, dtype=dtype, seed=8)
        out, grads = run(lambda q, k, v: fm.flashmask_attention(q, k, v, bounds), qkv, dout)
        assert bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
        dead = torch.zeros(s, dtype=torch.bool)
        dead[10:20] = dead[50:] = True
        assert bool((out[:, dead] == 0).all()) and bool((grads[0][:, dead] == 0).all())
        assert bool((out[:, ~dead] != 0).any())
    # Every row masked: all zeros, zero gradients.
    everything = torch.tensor([0, s], dtype=torch.int32).expand(b, 1, s, 2).contiguous()
    qkv, dout = inputs(b, s, h, 16, seed=9)
    out, grads = run(lambda q, k, v: fm.flashmask_attention(q, k, v, everything), qkv, dout)
    assert bool((out == 0).all()) and all(bool((g == 0).all()) for g in grads)


def test_dropout_is_the_varlen_kernels_mask():
    """The packed rows drop exactly what the varlen kernel drops for the same token indices:
    its debug mask, fed to the dense reference, reproduces the output and gradients."""
    from tests.kernels.dropout_masks import varlen_attention_with_dropout_mask

    s, b, h, p = 65, 2, 2, 0.3
    spec = masks.document_mask([[20, 30, 10], [40, 25]], s)
    qkv, dout = inputs(b, s, h, 32, seed=10)
    torch.manual_seed(1234)
    got = run(lambda q, k, v: fm.flashmask_attention(q, k, v, *spec, dropout_p=p), qkv, dout)
    torch.manual_seed(1234)
    flat = [x.reshape(b * s, h, 32) for x in qkv]
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
    _, keep = varlen_attention_with_dropout_mask(*flat, cu, s, p)  # [B, H, S, S]
    want = run(
        lambda q, k, v: masks.flashmask_reference(q, k, v, *spec, dropout_p=p, dropout_keep=keep),
        tuple(x.double() for x in qkv),
        dout.double(),
    )
    assert_close_all((got[0].double(), [g.double() for g in got[1]]), want)
    torch.manual_seed(1234)
    again = fm.flashmask_attention(*qkv, *spec, dropout_p=p)
    torch.manual_seed(4321)
    other = fm.flashmask_attention(*qkv, *spec, dropout_p=p)
    assert torch.equal(again, got[0]) and not torch.equal(other, got[0])


# ---------------------------------------------------------------------------- tile skipping

COUNT_CASES = [(name, make, 130) for name, make, *_ in CASES]


@pytest.mark.parametrize("name,make,seqlen", COUNT_CASES, ids=[c[0] for c in COUNT_CASES])
def test_skipped_tiles_are_exactly_the_fully_masked_ones(name, make, seqlen):
    args = {
        "causal_blockwise_mask": ([[50, 40, 40], [13, 87, 30]], seqlen),
        "document_mask": ([[30, 1, 70, 20], [seqlen]], seqlen),
        "shared_question_mask": ([[[30, 20, 25], [20, 15, 10]], [[50, 40, 40]]], seqlen),
        "prefix_lm_document_mask": ([[60, 40, 30], [seqlen]], [[10, 0, 30], [77]], seqlen),
    }.get(name)
    args = args or make(seqlen)
    spec = build(name, args)
    qkv, _ = inputs(spec.startend_row_indices.shape[0], seqlen, 1, 16, seed=11)
    # Tiles of 16 queries x 32 keys for half the masks, 32 x 16 for the other half.
    block_m, block_n = (16, 32) if MASK_BUILDERS.index(name) % 2 else (32, 16)
    counts = fm.flashmask_tile_counts(*qkv, *spec, block_m=block_m, block_n=block_n, backward=False)
    got, blocks = counts["fwd"]
    want = masks.reference_tile_counts(spec.startend_row_indices, spec.causal, seqlen, 1, *blocks)
    assert got[:3] == want[:3], f"{name} blocks {blocks}: kernel {got}, dense mask {want}"
    assert got.total == want.total > 0
    if name not in ("global_sliding_window_mask", "causal_blockwise_mask", "qk_sparse_mask"):
        # The builders place their bounds so that min/max alone decides (no element check needed).
        assert got.checked == got.partial, f"{name}: the bounds' min/max alone should classify every tile"


def test_tile_counts_of_every_pass_with_heads_and_random_bounds():
    s, b, h = 80, 1, 3
    g = torch.Generator().manual_seed(12)
    # Arbitrary bounds, per head, n = 4: exact skipping does not depend on well-formed masks.
    cuts = torch.randint(0, s + 1, (b, h, s, 4), generator=g).sort(-1).values
    bounds = cuts[..., [2, 3, 0, 1]].to(torch.int32).contiguous()  # (LTS, LTE, UTS, UTE), intervals in order
    bounds[:, :, 32:64] = torch.tensor([0, s, 0, 0], dtype=torch.int32)  # two key blocks fully masked
    spec = masks.document_mask([[30, 40]], s)
    qkv, _ = inputs(b, s, h, 16, seed=12)
    for bounds_, causal in ((bounds, False), (spec.startend_row_indices, spec.causal)):
        counts = fm.flashmask_tile_counts(*qkv, bounds_, causal, block_m=16, block_n=16)
        for name, (got, blocks) in counts.items():
            want = masks.reference_tile_counts(bounds_, causal, s, h, *blocks)
            assert got[:3] == want[:3], f"{name}: kernel {got}, dense mask {want}"
            assert got.total == b * h * 5 * 5
        assert counts["fwd"][0].skipped > 0 and counts["fwd"][0].unmasked + counts["fwd"][0].partial > 0


def test_packed_bert_batches_skip_most_tiles_of_padding_and_other_sequences():
    """A packed batch at the GPU's tile sizes: fully masked tiles (other sequences, padding)
    are skipped, and the dense count confirms every one of them."""
    s = 512
    lens = [[128, 100, 90, 80, 70, 40], [512], [300, 200]]
    spec = masks.document_mask(lens, s)
    qkv, _ = inputs(3, s, 1, 16, seed=13)
    counts = fm.flashmask_tile_counts(*qkv, *spec, block_m=128, block_n=64, backward=False)
    got, _ = counts["fwd"]
    want = masks.reference_tile_counts(spec.startend_row_indices, spec.causal, s, 1, 128, 64)
    assert got[:3] == want[:3] and got.checked == got.partial
    assert got.skipped > 0.3 * got.total


# ---------------------------------------------------------------------- API, errors, backend


def test_bad_arguments_are_named():
    (q, k, v), _ = inputs(1, 8, 2, 16)
    spec = masks.causal_mask(1, 8)
    with pytest.raises(ValueError, match="startend_row_indices: expected an int32"):
        fm.flashmask_attention(q, k, v, spec.startend_row_indices.long(), True)
    with pytest.raises(ValueError, match="n = 1 bounds per column with causal=False"):
        fm.flashmask_attention(q, k, v, spec.startend_row_indices, False)
    with pytest.raises(ValueError, match="3 heads"):
        fm.flashmask_attention(q, k, v, spec.startend_row_indices.expand(1, 3, 8, 1).contiguous(), True)
    with pytest.raises(ValueError, match="causal needs seqlen_q == seqlen_k"):
        fm.flashmask_attention(q[:, :4], k, v, spec.startend_row_indices, True)
    with pytest.raises(ValueError, match="dropout_p"):
        fm.flashmask_attention(q, k, v, *spec, dropout_p=1.0)
    with pytest.raises(ValueError, match="dtype"):
        fm.flashmask_attention(q, k.double(), v, *spec)
    with pytest.raises(ValueError, match="row 0 lengths"):
        masks.document_mask([[5, 6]], 8)
    with pytest.raises(ValueError, match="must sum to"):
        masks.causal_blockwise_mask([[3, 4]], 8)


def test_backend_through_the_registry():
    s, r, h, d = 65, 2, 2, 32
    spec = masks.document_mask([[20, 30, 10], [40, 25]], s)
    layout = PackedLayout(spec.startend_row_indices)
    qkv, dout = inputs(r, s, h, d, seed=14)
    flat = tuple(x.reshape(r * s, h, d) for x in qkv)
    reference = get_backend("reference")
    flashmask = get_backend("flashmask")
    want = run(lambda q, k, v: reference(q, k, v, layout, 0.1, False), flat, dout.reshape(r * s, h, d))
    got = run(lambda q, k, v: flashmask(q, k, v, layout, 0.1, False), flat, dout.reshape(r * s, h, d))
    assert_close_all(got, want)
    with pytest.raises(BackendUnavailable, match="PackedLayout"):
        flashmask(*flat, VarlenLayout(torch.tensor([0, r * s], dtype=torch.int32), r * s), 0.0, False)


def test_torch_compile_traces_through_the_op():
    s = 40
    spec = masks.document_mask([[15, 25], [40]], s)
    qkv, dout = inputs(2, s, 2, 16, seed=15)

    def f(q, k, v):
        return fm.flashmask_attention(q * 1.5, k, v, *spec) * 2.0

    eager = run(f, qkv, dout)
    torch._dynamo.reset()
    compiled = run(torch.compile(f, backend="aot_eager", fullgraph=True), qkv, dout)
    assert_close_all(compiled, eager, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # a subprocess importing torch and Triton
def test_cpu_without_interpreter_is_a_clear_error():
    script = """
import torch
from kernels.interface import BackendUnavailable
from kernels.registry import get_backend
from kernels.flashmask import flashmask_attention
from kernels.masks import causal_mask
q = torch.zeros(1, 8, 1, 16)
try:
    flashmask_attention(q, q, q, *causal_mask(1, 8))
except BackendUnavailable as e:
    print("call:", e)
if not torch.cuda.is_available():
    try:
        get_backend("flashmask")
    except BackendUnavailable as e:
        print("load:", e)
"""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("call: flashmask attention:") and "TRITON_INTERPRET=1" in lines[0], proc.stdout
    if len(lines) > 1:
        assert lines[1].startswith("load: model.attention=flashmask:") and "TRITON_INTERPRET=1" in lines[1]
