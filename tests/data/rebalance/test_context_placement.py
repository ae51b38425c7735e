"""Context parallelism's placement in the rebalancing plan (data.rebalance.plan.place_context):
only sequences above the threshold are split, a split document costs each rank of its group its
piece, and the predicted time (cost / speed) comes out balanced."""

import numpy as np
import pytest

from data.rebalance.plan import Cost, context_plan_for_rank, piece_costs, place_context, sample_costs

COST = Cost(1.0, 1.0 / 384, 1.0 / 192, 128)  # a tiny ModernBERT's shape: global and window layers


def recomputed(lengths, placement, cp_size, speeds):
    """Each rank's time from the placement, with the float costs."""
    load = np.zeros(len(speeds))
    whole, piece = sample_costs(lengths, COST), piece_costs(lengths, cp_size, COST)
    for i, (g, r) in enumerate(zip(placement.group, placement.rank)):
        if g >= 0:
            load[g * cp_size : (g + 1) * cp_size] += piece[i]
        else:
            load[r] += whole[i]
    return load / np.asarray(speeds)


@pytest.mark.parametrize("speeds", [None, [1, 1, 1, 1, 0.5, 1, 1, 1]])
def test_only_long_sequences_are_split_and_the_time_is_balanced(speeds):
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(64, 2048, 240), rng.integers(4097, 16384, 12)])
    p = place_context(lengths, world=8, cp_size=4, threshold=4096, cost=COST, speeds=speeds)
    assert ((p.group >= 0) == (lengths > 4096)).all() and ((p.rank >= 0) == (lengths <= 4096)).all()
    assert set(p.group[p.group >= 0]) <= {0, 1} and set(p.rank[p.rank >= 0]) <= set(range(8))
    speed = np.ones(8) if speeds is None else np.asarray(speeds, float)
    time = recomputed(lengths, p, 4, speed)
    assert np.allclose(p.predicted / p.predicted.mean(), time / time.mean(), rtol=1e-5)
    # Longest first to the earliest finisher: within one item's time of the mean, so here within
    # 1% (a few documents far longer than the rest, or a slow rank in a group, would leave more);
    # the slow rank gets about half the work of the others.
    assert p.imbalance < 1.01
    if speeds is not None:
        load = time * speed
        assert load[4] < 0.6 * np.delete(load, 4).mean()


def test_a_piece_costs_its_queries_against_the_whole_document():
    c = Cost(2.0, 0.5, 0.25, 4)
    # L = 10 over 4 ranks: 3 queries each (ceil), each seeing 10 keys in global layers, 4 in local ones
    assert piece_costs([10], 4, c)[0] == 2.0 * 3 + 0.5 * 3 * 10 + 0.25 * 3 * 4
    assert piece_costs([10], 1, c)[0] == sample_costs([10], c)[0]


def test_the_placement_is_the_same_given_the_same_lengths_and_refuses_a_bad_group():
    lengths = np.arange(1, 200) * 37 % 5000 + 1
    a = place_context(lengths, 8, 2, 3000, COST)
    b = place_context(lengths.copy(), 8, 2, 3000, COST)
    assert (a.group == b.group).all() and (a.rank == b.rank).all() and (a.predicted == b.predicted).all()
    with pytest.raises(ValueError, match="cp_size: expected a divisor of the world size 8, got 3"):
        place_context(lengths, 8, 3, 3000, COST)


def test_the_exchange_plan_carries_out_the_placement_and_each_sample_arrives_once():
    """context_plan_for_rank (what the Rebalancer runs under dist.context_parallel): every sample ends
    on exactly one rank, a long one on a rank of the group place_context chose (which gathers and
    splits it), a short one on its rank; the predicted imbalance is the placement's, below what CP
    alone (each long sample split by its source's group) leaves on a skewed batch."""
    rng = np.random.default_rng(45)
    W, B, N, T = 8, 12, 2, 4096
    L = rng.integers(64, 2048, (W, B))
    L[:2, :4] = rng.integers(T + 1, 16384, (2, 4))  # the long documents all start in group 0
    plans = [context_plan_for_rank(L, r, N, T, COST) for r in range(W)]
    where = {}
    for p in plans:
        for i in np.setdiff1d(np.arange(B), p.send_index):
            where.setdefault(p.rank * B + int(i), []).append(p.rank)
        for s, i in zip(p.recv_rank, p.recv_index):
            where.setdefault(int(s) * B + int(i), []).append(p.rank)
    assert sorted(where) == list(range(W * B)) and all(len(v) == 1 for v in where.values())
    placement = place_context(L.ravel(), W, N, T, COST)
    for g, (r,) in where.items():
        assert r // N == placement.group[g] if placement.group[g] >= 0 else r == placement.rank[g], g
    assert {p.imbalance_after for p in plans} == {placement.imbalance} and {p.moved for p in plans} == {plans[0].moved}
    assert placement.imbalance < 1.05 < 1.5 < plans[0].imbalance_before


def test_the_exchange_moves_nothing_where_the_placement_would_not_help():
    L = np.full((4, 3), 100)  # equal short samples everywhere: already balanced
    plans = [context_plan_for_rank(L, r, 2, 4096, COST) for r in range(4)]
    assert all(p.send_index.size == 0 and p.recv_rank.size == 0 and p.moved == 0 for p in plans)
    assert plans[0].imbalance_after == plans[0].imbalance_before == 1.0
