"""Pure tests of data.rebalance.plan: costs, strategies, assign, plan_for_rank.

Packing and input checks of the exchange are in test_rebalance_packing.py, the
multi-process exchange in test_rebalance_dist.py. Seeds are fixed in each test.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.rebalance_sim import mlperf_like_lengths
from data.rebalance.plan import DEFAULT_COST, STRATEGIES, assign, imbalance, plan_for_rank, sample_costs


def mlperf_batch(W, B=56, seed=0):
    return mlperf_like_lengths(np.random.default_rng(seed), W * B).reshape(W, B)


def check_is_plan(A, L):
    """Every rank holds B samples, together exactly the W*B inputs, rows in (rank, index) order."""
    W, B = L.shape
    assert A.src_rank.shape == A.src_index.shape == A.dest_rank.shape == (W, B)
    gid = A.src_rank.astype(np.int64) * B + A.src_index
    assert np.array_equal(np.sort(gid.ravel()), np.arange(W * B))
    assert (np.diff(gid, axis=1) > 0).all()
    for r in range(W):  # dest_rank is the inverse of (src_rank, src_index)
        assert (A.dest_rank[A.src_rank[r], A.src_index[r]] == r).all()
    costs = sample_costs(L)
    np.testing.assert_allclose(A.costs_after.sum(), A.costs_before.sum(), rtol=1e-9)
    # Plans use integer costs quantised against the longest sequence's: the error of a rank's
    # total is bounded by a step of that scale per sample, not relative to the total.
    tol = dict(rtol=1e-4, atol=1e-4 * costs.max() * B)
    np.testing.assert_allclose(A.costs_before, costs.sum(1), **tol)
    np.testing.assert_allclose(A.costs_after, costs.ravel()[gid].sum(1), **tol)
    assert A.moved == int((A.dest_rank != np.arange(W)[:, None]).sum())


def test_default_cost_is_bert_large_flops_ratio():
    # Written out independently of the module: per layer and token, forward FLOPs.
    h = 1024
    linear = 2 * h * (3 * h) + 2 * h * h + 2 * h * (4 * h) + 2 * (4 * h) * h  # QKV, out, FFN up, down
    attention_per_key = 2 * h + 2 * h  # q.k over h dims, then p*v over h dims, for each of L keys
    assert DEFAULT_COST.b / DEFAULT_COST.a == pytest.approx(attention_per_key / linear)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("W, B", [(1, 1), (1, 5), (2, 1), (3, 7), (7, 5), (16, 56)])
def test_assign_is_a_plan(strategy, W, B):
    rng = np.random.default_rng(W * 100 + B)
    L = rng.integers(1, 513, (W, B))
    A = assign(L, strategy, speeds=rng.uniform(0.5, 1.0, W) if strategy == "measured" else None)
    check_is_plan(A, L)
    if strategy == "none":
        assert A.moved == 0
        assert (A.src_rank == np.arange(W)[:, None]).all() and (A.src_index == np.arange(B)).all()


def test_stripe_is_the_submissions_sort_and_stride():
    L = np.random.default_rng(1).integers(1, 513, (8, 13))
    W, B = L.shape
    order = sorted(range(W * B), key=lambda g: (-L.ravel()[g], g))  # longest first, ties by id
    A = assign(L, "stripe")
    for r in range(W):
        assert sorted(order[r::W]) == list(A.src_rank[r].astype(int) * B + A.src_index[r])


@pytest.mark.parametrize("group_size", [None, 4])
def test_assign_is_deterministic_and_input_form_does_not_matter(group_size):
    L = mlperf_batch(16, 20, seed=3)
    A = assign(L, "balanced", group_size=group_size)
    for other in (
        assign(L, "balanced", group_size=group_size),
        assign([row for row in L.astype(np.int16)], "balanced", group_size=group_size),
    ):
        assert np.array_equal(A.src_rank, other.src_rank) and np.array_equal(A.src_index, other.src_index)


@pytest.mark.parametrize("W", [8, 64, 512])
def test_balanced_meets_the_goal_and_beats_stripe(W):
    for seed in range(2):
        L = mlperf_batch(W, seed=seed)
        stripe, balanced = assign(L, "stripe"), assign(L, "balanced")
        check_is_plan(balanced, L)
        assert balanced.imbalance_after <= 1.01
        assert balanced.imbalance_after < stripe.imbalance_after
        # keep-local: a few samples per rank move, the submissions' stride moves nearly all
        assert balanced.moved < 0.25 * stripe.moved
        if W >= 64:
            hier = assign(L, "balanced", group_size=8)
            check_is_plan(hier, L)
            assert hier.imbalance_after <= 1.01


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_balanced_properties(data):
    W = data.draw(st.integers(1, 12), label="W")
    B = data.draw(st.integers(1, 8), label="B")
    L = np.array(data.draw(st.lists(st.integers(1, 512), min_size=W * B, max_size=W * B), label="L")).reshape(W, B)
    G = data.draw(st.sampled_from([None] + [g for g in range(1, W + 1) if W % g == 0]), label="group_size")
    tol = 1e-3
    A = assign(L, "balanced", tol=tol, group_size=G)
    check_is_plan(A, L)
    assert A.imbalance_after <= A.imbalance_before * (1 + 1e-9)  # never worse
    if A.imbalance_before <= 1 + tol / 2:  # already balanced: nothing moves
        assert A.moved == 0


@pytest.mark.parametrize("W, G", [(16, None), (16, 4), (64, 8)])
def test_plan_for_rank_is_that_ranks_part_of_assign(W, G):
    L = mlperf_batch(W, 24, seed=5)
    B = L.shape[1]
    A = assign(L, "balanced", group_size=G)
    for r in range(W):
        p = plan_for_rank(L, r, "balanced", group_size=G)
        leaving = np.flatnonzero(A.dest_rank[r] != r)
        assert sorted(zip(A.dest_rank[r][leaving], leaving)) == list(zip(p.send_dest, p.send_index))
        incoming = A.src_rank[r] != r
        assert np.array_equal(A.src_rank[r][incoming], p.recv_rank)
        assert np.array_equal(A.src_index[r][incoming], p.recv_index)
        assert p.imbalance_before == pytest.approx(A.imbalance_before)
        assert p.moved == (None if G else A.moved)
        assert len(p.send_index) + B - len(leaving) == B


@pytest.mark.parametrize(
    "args, message",
    [
        (([[5, 6], [7, 8]], "greedy"), "strategy: expected one of none, stripe, balanced"),
        (([[5, 6], [7]], "balanced"), "rank 1 has 1 samples, rank 0 has 2"),
        (([[5, 6], [7, 0]], "balanced"), "rank 1: sample 1 has length 0"),
        (([[5, 6], [-3, 1]], "stripe"), "rank 1: sample 0 has length -3"),
        ((np.ones((2, 2)) * 5.0, "balanced"), "lengths must be integers"),
        ((np.zeros((0, 3), int), "balanced"), "at least one rank and one sample"),
    ],
)
def test_assign_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        assign(*args)


def test_assign_rejects_bad_settings():
    L = np.full((4, 2), 9)
    with pytest.raises(ValueError, match="cost: expected a >= 0, b >= 0"):
        assign(L, "balanced", cost=(-1.0, 0.0))
    with pytest.raises(ValueError, match="group_size: 3 does not divide the world size 4"):
        assign(L, "balanced", group_size=3)
    with pytest.raises(ValueError, match="tol"):
        assign(L, "balanced", tol=1.5)


def test_imbalance():
    assert imbalance([1.0, 1.0, 4.0]) == 2.0
    with pytest.raises(ValueError):
        imbalance([])
    with pytest.raises(ValueError):
        imbalance([0.0, 0.0])


def test_cost_with_local_layers():
    from data.rebalance.plan import Cost, check_cost, sample_costs

    L = np.array([1, 64, 128, 8192])
    c = Cost(1.0, 1e-4, 2e-4, 128)
    assert np.allclose(sample_costs(L, c), L + 1e-4 * L * L + 2e-4 * L * np.minimum(L, 128))
    assert np.allclose(sample_costs(L, (1.0, 1e-4)), L + 1e-4 * L * L)  # (a, b) as before
    assert check_cost((1, 0, 0.5, 64.0)) == Cost(1.0, 0.0, 0.5, 64)
    for bad, want in (
        ((1, 1, 1), "expected \\(a, b\\) or"),
        ((1, 1, 0.5, 0), "window >= 1"),
        ((1, 1, 0.5, 1.5), "window >= 1"),
        ((0, 0, 0, 8), "not all 0"),
        ((1, 1, -1, 8), "b_local >= 0"),
    ):
        with pytest.raises(ValueError, match=want):
            check_cost(bad)


def test_balancing_uses_the_window_term():
    """Balanced under a cost that knows the windows, the ranks' true costs are within tol; a
    plan made with the L^2-only cost of the same model is not, at long context."""
    from data.rebalance.plan import assign, sample_costs

    rng = np.random.default_rng(0)
    L = np.where(rng.random((16, 12)) < 0.3, 8192, rng.integers(64, 4096, (16, 12)))
    windowed = (1.0, 1e-5, 3e-4, 128)
    plan = assign(L, "balanced", windowed, tol=1e-3)
    true = sample_costs(L[plan.src_rank, plan.src_index], windowed).sum(1)
    assert true.max() / true.mean() == pytest.approx(plan.imbalance_after, abs=1e-4)  # the plan's own costs
    assert true.max() / true.mean() < 1.01
    naive = assign(L, "balanced", (1.0, 1e-5 + 3e-4), tol=1e-3)  # every layer priced as global
    true_naive = sample_costs(L[naive.src_rank, naive.src_index], windowed).sum(1)
    assert true_naive.max() / true_naive.mean() > 1.02


@pytest.mark.parametrize("group_size", [None, 4])
def test_measured_with_equal_speeds_is_balanced(group_size):
    L = mlperf_batch(16, 20, seed=5)
    A = assign(L, "balanced", group_size=group_size)
    for speeds in ([1.0] * 16, [3.7] * 16):
        M = assign(L, "measured", group_size=group_size, speeds=speeds)
        for f in ("src_rank", "src_index", "dest_rank", "costs_after"):
            assert np.array_equal(getattr(A, f), getattr(M, f)), f
        assert M.imbalance_after == A.imbalance_after


@pytest.mark.parametrize("group_size", [None, 4])
def test_measured_gives_slow_ranks_less_work(group_size):
    W = 16
    L = mlperf_batch(W, 56, seed=6)
    speeds = np.ones(W)
    speeds[[3, 9]] = 0.7
    A = assign(L, "measured", group_size=group_size, speeds=speeds)
    check_is_plan(A, L)
    time = A.costs_after / speeds
    assert time.max() / (A.costs_after.sum() / speeds.sum()) == pytest.approx(A.imbalance_after, rel=1e-3)
    assert A.imbalance_after < 1.01
    assert imbalance(assign(L, "balanced", group_size=group_size).costs_after, speeds) > 1.3
    assert A.costs_after[[3, 9]].max() < 0.75 * np.delete(A.costs_after, [3, 9]).min()
    for r in (0, 3, 9):
        p = plan_for_rank(L, r, "measured", group_size=group_size, speeds=speeds)
        assert list(p.recv_rank) == list(A.src_rank[r][A.src_rank[r] != r])
