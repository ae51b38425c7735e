"""Grouped dispatch (``triton_grouped``) equals one varlen launch, bitwise, for every arrangement,
with and without a sliding window.

A grouped call launches each length bucket's sequences separately; whatever the order of the
batch (already in bucket order, reversed, interleaved), each sequence must be computed by
the same programs as in one launch, so out, dq, dk and dv are bitwise equal, and the dropout
mask (keyed by token coordinates, not by the launch) is the same. Hypothesis draws lengths
and buckets; the explicit examples are the arrangements that once returned uninitialised
rows (batch already in bucket order: ``plan_groups`` returned no order but several groups).
Runs in Triton's interpreter (tiny heads and head dim keep it fast).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kernels.grouped import plan_groups  # noqa: E402
from kernels.varlen_attention import varlen_attention  # noqa: E402

HEADS, DIM = 1, 16


def _run(lengths, buckets, dropout_p, seed, window=None):
    """out, dq, dk, dv of varlen_attention over these lengths (grouped when buckets)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, HEADS, DIM, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(t, HEADS, DIM, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    torch.manual_seed(seed)  # the dropout seed is drawn from torch's default generator
    out = varlen_attention(q, k, v, cu, max(lengths), dropout_p, buckets=buckets, window=window)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _buckets():
    return st.lists(st.integers(1, 48), min_size=1, max_size=4, unique=True).map(sorted)


@settings(max_examples=10, deadline=None, derandomize=True, database=None)
@given(
    lengths=st.lists(st.integers(1, 48), min_size=1, max_size=5),
    buckets=_buckets(),
    arrangement=st.sampled_from(["as drawn", "ascending", "descending"]),
    dropout_p=st.sampled_from([0.0, 0.3]),
    window=st.sampled_from([None, None, 2, 7, 40]),
)
# issue 13; ascending; one group; one per bucket; beyond the last bucket; one per bucket with a window
@example(lengths=[40, 30, 9, 5], buckets=[8, 16, 32, 64], arrangement="as drawn", dropout_p=0.0, window=None)
@example(lengths=[5, 9, 30, 40], buckets=[8, 16, 32, 64], arrangement="as drawn", dropout_p=0.0, window=None)
@example(lengths=[7, 3, 5], buckets=[8, 16], arrangement="as drawn", dropout_p=0.3, window=None)
@example(lengths=[60, 20, 12, 4], buckets=[4, 16, 32], arrangement="as drawn", dropout_p=0.3, window=None)
@example(lengths=[60, 50, 3], buckets=[8, 16], arrangement="as drawn", dropout_p=0.0, window=None)
@example(lengths=[60, 20, 12, 4], buckets=[4, 16, 32], arrangement="as drawn", dropout_p=0.3, window=9)
def test_grouped_equals_one_launch(lengths, buckets, arrangement, dropout_p, window):
    if arrangement == "ascending":
        lengths = sorted(lengths)
    elif arrangement == "descending":
        lengths = sorted(lengths, reverse=True)
    single = _run(lengths, None, dropout_p, seed=len(lengths), window=window)
    grouped = _run(lengths, buckets, dropout_p, seed=len(lengths), window=window)
    for name, a, b in zip(("out", "dq", "dk", "dv"), single, grouped):
        assert torch.equal(a, b), (
            f"{name}: grouped differs from one launch for lengths {lengths}, buckets {buckets}, window {window}"
        )


def test_examples_cover_the_arrangements():
    """The explicit examples above really are the cases they are named for."""
    sorted_plan = plan_groups([40, 30, 9, 5], [8, 16, 32, 64])
    assert sorted_plan.order is None and len(sorted_plan.groups) == 4  # already in order, 4 launches
    assert plan_groups([5, 9, 30, 40], [8, 16, 32, 64]).order is not None
    assert len(plan_groups([7, 3, 5], [8, 16]).groups) == 1
    per_bucket = plan_groups([60, 20, 12, 4], [4, 16, 32])
    assert [g.count for g in per_bucket.groups] == [1, 1, 1, 1] and per_bucket.order is None
    beyond = plan_groups([60, 50, 3], [8, 16])
    assert beyond.groups[0].count == 2 and beyond.groups[0].max_len == 60
