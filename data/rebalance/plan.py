"""Cross-rank rebalancing of sequence lengths, the plan: which rank holds which sample.

Pure (numpy only, no process group): every rank computes the same plan, bit for bit, from the gathered lengths (integer
costs, sorts on unique keys). Each rank keeps B samples (``measured`` with unequal speeds: ``min_samples`` to
``max_samples``) and each sample moves at most once. ``assign`` gives the whole plan (``Assignment``), ``plan_for_rank``
one rank's part (``RankPlan``); the strategies, the hierarchical mode and the cost model: docs/rebalancing.md.

Shapes: W ranks, B samples per rank, N = W * B samples in the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from data.samples import _offsets

# The exchange all-gathers per rank a header of HEADER_WORDS int32 words (MEASURE_WORDS more with ``measured``),
# then one word per sample: the plan's input. Named here so the simulator counts its bytes without importing it.
HEADER_WORDS = 7
MEASURE_WORDS = 9

STRATEGIES = ("none", "stripe", "balanced", "measured")
_SPEED_STEPS = 1 << 10  # measured: speeds as integer weights, so every rank gets the same plan


class Cost(NamedTuple):
    """Per-sample cost c(L) = a*L + b*L^2 + b_local*L*min(L, window) (arbitrary units; only ratios matter).

    a: the per-token work of every layer; b: the global attention layers together (a query sees all L keys); b_local,
    window: the sliding-window layers together (at most ``window`` keys; the band's +1 is in a)."""

    a: float
    b: float
    b_local: float = 0.0
    window: int = 0


# BERT-large's FLOPs (h = 1024): c(L) ~ L + L^2 / (6 h), derived in docs/rebalancing.md.
DEFAULT_COST = Cost(a=1.0, b=1.0 / 6144)

# Integer costs: every rank must compute a bit-identical plan, and float sums may round differently across
# CPUs (SIMD widths); integer sums cannot. A sample of maximal length costs 2**20, so W*B*2**20 stays far inside int64.
_COST_SCALE_MAX = 1 << 20


def sample_costs(lengths, cost: Cost | tuple = DEFAULT_COST) -> np.ndarray:
    """c(L) = a*L + b*L^2 + b_local*L*min(L, window) elementwise, float64: one piece of ``piece_costs``."""
    return piece_costs(lengths, 1, cost)


def imbalance(costs, weights=None) -> float:
    """max / mean of per-rank costs (1.0 is perfect; the step waits for the max); with a
    speed weight per rank, the slowest predicted time max(cost / w) over the ideal sum / sum w."""
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError(f"imbalance: expected a non-empty 1-D array of per-rank costs, got shape {c.shape}")
    if c.mean() <= 0:
        raise ValueError("imbalance: per-rank costs must have a positive mean")
    w = np.ones_like(c) if weights is None else np.asarray(weights, dtype=np.float64)
    return float((c / w).max() / (c.sum() / w.sum()))


@dataclass(frozen=True)
class Assignment:
    """Which samples each rank holds after the exchange.

    src_rank, src_index: [W, C] int32, C the most samples a rank holds (B, except with ``measured``'s
        ``max_samples``); rank r's j-th sample is sample ``src_index[r, j]`` of rank ``src_rank[r, j]``'s
        batch, for j < ``counts[r]``; -1 after. Each row is sorted by (src_rank, src_index).
    dest_rank: [W, B] int32; sample j of rank s goes to rank ``dest_rank[s, j]``.
    costs_before, costs_after: [W] float64 per-rank costs.
    weights: [W] int64 speed weights (``measured``) or None: imbalances are then in time.
    """

    strategy: str
    src_rank: np.ndarray
    src_index: np.ndarray
    dest_rank: np.ndarray
    costs_before: np.ndarray
    costs_after: np.ndarray
    weights: np.ndarray | None = None

    @property
    def counts(self) -> np.ndarray:
        """[W] samples each rank holds after the exchange."""
        return (self.src_rank >= 0).sum(1)

    @property
    def moved(self) -> int:
        """Samples that change rank (each is sent once and received once)."""
        return int((self.dest_rank != np.arange(len(self.dest_rank))[:, None]).sum())

    @property
    def imbalance_before(self) -> float:
        return imbalance(self.costs_before, self.weights)

    @property
    def imbalance_after(self) -> float:
        return imbalance(self.costs_after, self.weights)


def _as_matrix(lengths_per_rank, rank: int | None = None) -> np.ndarray:
    """[W, B] int64 lengths from a [W, B] array or a list of W 1-D arrays; validated, as is ``rank`` if given."""
    if isinstance(lengths_per_rank, np.ndarray) and lengths_per_rank.ndim == 2:
        L = lengths_per_rank
    else:
        rows = [np.asarray(x) for x in lengths_per_rank]
        if not rows:
            raise ValueError("assign: no ranks given")
        for r, x in enumerate(rows):
            if x.ndim != 1:
                raise ValueError(f"assign: rank {r}: expected a 1-D array of lengths, got shape {x.shape}")
            if len(x) != len(rows[0]):
                raise ValueError(
                    f"assign: rank {r} has {len(x)} samples, rank 0 has {len(rows[0])}; "
                    "every rank must hold the same number"
                )
        L = np.stack(rows)
    if L.shape[0] == 0 or L.shape[1] == 0:
        raise ValueError(f"assign: expected at least one rank and one sample per rank, got shape {L.shape}")
    if not np.issubdtype(L.dtype, np.integer):
        raise ValueError(f"assign: lengths must be integers, got dtype {L.dtype}")
    if L.min() < 1:
        r, j = np.argwhere(L < 1)[0]
        raise ValueError(f"assign: rank {r}: sample {j} has length {L[r, j]} (must be >= 1)")
    if rank is not None and not 0 <= rank < L.shape[0]:
        raise ValueError(f"rank: expected 0..{L.shape[0] - 1}, got {rank}")
    return L


def check_cost(cost) -> Cost:
    """``cost`` ((a, b) or (a, b, b_local, window)) as a Cost; ValueError unless a, b, b_local
    >= 0, not all 0, and window a positive integer where b_local > 0."""
    if len(cost) not in (2, 4):
        raise ValueError(f"cost: expected (a, b) or (a, b, b_local, window), got {len(cost)} values")
    a, b = float(cost[0]), float(cost[1])
    b_local, window = (float(cost[2]), cost[3]) if len(cost) == 4 else (0.0, 0)
    if not all(np.isfinite(x) for x in (a, b, b_local)) or min(a, b, b_local) < 0 or a + b + b_local == 0:
        raise ValueError(f"cost: expected a >= 0, b >= 0, b_local >= 0, not all 0, got a={a}, b={b}, b_local={b_local}")
    if float(window) != int(window) or int(window) < 0 or (b_local > 0 and int(window) < 1):
        raise ValueError(f"cost: expected a window >= 1 (an integer) with b_local > 0, got window={window}")
    return Cost(a, b, b_local, int(window))


def _cost_tables(lmax: int, cost) -> tuple[np.ndarray, float]:
    """(int64 quantised c(L) for L = 0..lmax, the caller's cost per quantised unit); lookups beat math."""
    exact = sample_costs(np.arange(lmax + 1), check_cost(cost))
    quantised = np.maximum(np.rint(exact * (_COST_SCALE_MAX / exact[lmax])), 1).astype(np.int64)
    return quantised, exact[lmax] / quantised[lmax]


def _stripe(L: np.ndarray) -> np.ndarray:
    """Global ids [W, B] per rank: sort all by length (longest first), deal round-robin."""
    W, B = L.shape
    # stable: ties keep global-id order (deterministic); int16 keys get numpy's radix sort
    key = -L.ravel()
    order = np.argsort(key.astype(np.int16) if L.max() < 1 << 15 else key, kind="stable")
    return order.reshape(B, W).T


class _Swapper:
    """Pairwise swaps between ranks on integer costs; every sample moves at most once, so a sender knows
    where its samples end up without following them (``plan_for_rank``).

    ``K[x]``, for the tracked ranks (``rows``): one int64 key per sample still at its own rank x (cost in the high bits,
    global id in the low ones), sorted when used; samples that left, or that x received (frozen where they land), are -1
    and sort first. ``extra`` > 0 adds that many empty slots of cost 0 per row (ids from W * B up), so a heavy rank's
    sample swapped with a light rank's empty slot moves one way: a rank then holds ``floor`` to B + extra samples;
    ``extra`` = 0 (``balanced``) keeps B each."""

    def __init__(self, q: np.ndarray, L: np.ndarray, load: np.ndarray, rows: np.ndarray, extra: int, floor: int):
        W, n = L.shape
        B = n + extra  # slots per row
        self.B, self.floor, self.extra = B, floor, extra
        self.shift = max(1, (W * B - 1).bit_length())
        self.big = int(q.max()) + 2  # above every cost: marks "no sample here" for the light rank
        self.K = np.empty((W, B), dtype=np.int64)
        gid = rows[:, None].astype(np.int64) * n + np.arange(n)
        self.K[rows, :n] = (q[L[rows]] << self.shift) | gid  # rows are sorted when first used
        self.K[rows, n:] = W * n + rows[:, None].astype(np.int64) * extra + np.arange(extra)  # empty: cost 0
        self.real = np.full(W, n, dtype=np.int64)  # samples each rank holds
        self.nfz = np.zeros(W, dtype=np.int64)  # frozen (-1) entries per row
        self.load = load.copy()
        self.nf = min(8, B)  # candidates for the fine swap
        self.moved_gid: list[np.ndarray] = [np.zeros(0, np.int64)]
        self.moved_to: list[np.ndarray] = [np.zeros(0, np.int64)]

    def swap(self, over: np.ndarray, under: np.ndarray, t: np.ndarray) -> int:
        """Move about t[p] of cost from rank over[p] to rank under[p] for every pair p; returns the samples moved.

        Whole swaps of the heavy rank's largest samples against the light rank's smallest (fewest moves), then one
        "fine" swap nearest to what is left, among ``nf`` heavy samples spread over the row (equal costs are no choice)
        and, for each, the light rank's nearest one (one vectorised searchsorted)."""
        B, sh, big, P = self.B, self.shift, self.big, len(over)
        rows, cols = np.arange(P), np.arange(B)
        # sort only the rows used in this round (they shrink fast) and keep them sorted
        Ko = self.K[over] = np.sort(self.K[over], axis=1)
        Ku = self.K[under] = np.sort(self.K[under], axis=1)
        empty = lambda K: ((K >= 0) & (K < 1 << sh)).sum(1)  # noqa: E731  (movable empty slots per row)
        n_o = B - self.nfz[over] - empty(Ko)  # movable samples per heavy rank (its empty slots come last in a)
        # the light rank's empty slots beyond what the heavy one may give away (it keeps ``floor``) are skipped
        e_u = empty(Ku)
        skip = e_u - np.minimum(e_u, np.maximum(self.real[over] - self.floor, 0))
        n_u = B - self.nfz[under] - skip
        a = Ko[:, ::-1] >> sh  # [P, B] heavy costs, largest first; frozen (-1) last
        # light costs, smallest first (empty slots: 0); frozen entries (first in the row) and the skipped
        # empty slots shifted out, "big" after
        at_u = cols[None, :] + (self.nfz[under] + skip)[:, None]
        b = Ku.ravel()[np.minimum(at_u, B - 1) + (rows * B)[:, None]] >> sh
        b[at_u >= B] = big
        d = a - b  # non-increasing along each row
        S = np.cumsum(d, axis=1)
        k = ((S <= t[:, None]) & (d > 0)).sum(1)  # whole swaps: a prefix of each row
        r = t - np.where(k > 0, S[rows, np.maximum(k - 1, 0)], 0)  # what is left, >= 0

        # fine swap; light rows are sorted and used positions get key 0, so row-offset keys
        # are globally sorted, and the queries ascend too, which keeps searchsorted fast.
        kc = np.minimum(k, np.maximum(n_o - 1, 0))
        spread = np.arange(self.nf - 1, -1, -1)  # ascending queries need descending a
        ci = kc[:, None] + (np.maximum(n_o - 1 - kc, 0)[:, None] * spread) // max(self.nf - 1, 1)
        ai = a[rows[:, None], ci]  # [P, nf]
        stride = big + 2
        keys = (rows[:, None] * stride + np.where(cols < k[:, None], -1, b) + 1).ravel()
        want = rows[:, None] * stride + np.minimum(np.maximum(ai - r[:, None], 0), big) + 1
        pos = np.searchsorted(keys, want.ravel()).reshape(P, self.nf)
        lo = (rows * B + np.minimum(k, B - 1))[:, None]
        hi = (rows * B + np.maximum(n_u - 1, 0))[:, None]
        j = np.minimum(np.maximum(np.stack([pos - 1, pos]), lo), hi)  # [2, P, nf]: the neighbours below and at
        errs = np.abs(ai - b.ravel()[j] - r[:, None])
        jb = np.where(errs[0] <= errs[1], j[0], j[1]) - (rows * B)[:, None]
        err = errs.min(0)
        best = np.argmin(err, axis=1)
        fine = (err[rows, best] < r) & (k < n_o) & (k < n_u)  # strictly better than not swapping

        pr = np.repeat(rows, k)
        pc = np.arange(len(pr)) - np.repeat(_offsets(k)[:-1], k)  # 0..k-1 per pair
        pf = rows[fine]
        i_o = np.concatenate([pc, ci[pf, best[pf]]])  # index into a (largest first)
        j_u = np.concatenate([pc, jb[pf, best[pf]]])  # index into b (smallest movable first)
        pp = np.concatenate([pr, pf])
        if len(pp) == 0:
            return 0
        ro, ru = over[pp], under[pp]
        co, cu = B - 1 - i_o, j_u + (self.nfz[under] + skip)[pp]
        gid_mask = (1 << sh) - 1
        self.moved_gid += [self.K[ro, co] & gid_mask, self.K[ru, cu] & gid_mask]
        self.moved_to += [ru, ro]
        delta = np.bincount(pp, weights=(a[pp, i_o] - b[pp, j_u]), minlength=P).astype(np.int64)
        one_way = np.bincount(pp, weights=(b[pp, j_u] == 0), minlength=P).astype(np.int64)  # into empty slots
        for state, change in ((self.load, delta), (self.real, one_way)):
            state[over] -= change
            state[under] += change
        self.K[ro, co] = -1
        self.K[ru, cu] = -1
        n = np.bincount(pp, minlength=P)
        self.nfz[over] += n
        self.nfz[under] += n
        return 2 * len(pp)

    def balance_groups(self, groups: np.ndarray, tol: float, max_rounds: int, w: np.ndarray) -> None:
        """Balance the ranks within each row of ``groups`` [ng, G] towards their group's weighted mean,
        a round of ``_pair_up``'s pairs at a time. With empty slots (``extra``) the least loaded rank may
        be full and take no more samples: a round that moves nothing is tried again pairing the i-th most
        loaded with the (i + 1)-th least, and so on."""
        rotate = 0
        for _ in range(max_rounds):
            pairs = _pair_up(self.load, w, groups, tol, rotate)
            if pairs is None:
                return
            if len(pairs[0]) and self.swap(*pairs):
                rotate = 0
                continue
            rotate += 1
            if not self.extra or rotate >= groups.shape[1] // 2:
                return

    def dest(self) -> tuple[np.ndarray, np.ndarray]:
        """(global ids, destination ranks) of every sample moved so far."""
        return np.concatenate(self.moved_gid), np.concatenate(self.moved_to)


def _pair_up(load: np.ndarray, w: np.ndarray, groups: np.ndarray, tol: float, rotate: int = 0):
    """One round's pairs (over, under, t) within each row of ``groups`` [ng, G], or None once every rank is
    within ``tol`` of its group's mean (rank r's share in proportion to ``w[r]``). The i-th most loaded rank
    is paired with the (i + ``rotate``)-th least loaded and moves t = min(excess, half the gap): the pair ends
    equal, or the heavy one at the mean. Ranks within ``tol`` are left alone, which keeps moves low."""
    lg, wg = load[groups], w[groups]
    tot, wt = lg.sum(1)[:, None], wg.sum(1)[:, None]
    e = wt * lg - tot * wg  # excess in units of 1/wt cost; sums to 0 per group
    slack = (tol * tot * wg).astype(np.int64)
    if groups.shape[1] < 2 or (e <= slack).all():
        return None
    gi, half = np.arange(len(groups))[:, None], groups.shape[1] // 2
    order = np.argsort(e, axis=1, kind="stable")
    under, over = np.roll(order[:, :half], -rotate, axis=1), order[:, ::-1][:, :half]
    eo, eu = e[gi, over], e[gi, under]
    t = np.minimum(eo, (eo - eu) // 2) // wt
    act = (eo > slack[gi, over]) & (t > 0)
    return groups[gi, over][act], groups[gi, under][act], t[act]


def _cross_group_pairs(load: np.ndarray, tol: float, rounds: int, w: np.ndarray) -> tuple[list, np.ndarray]:
    """The pairs (over, under, t) of each cross-group round and the loads they predict, from loads alone (as
    if every pair moved exactly t): every rank computes the same pairs in O(W log W) per round, and each
    pair's actual swap depends only on the two ranks' histories (``plan_for_rank``)."""
    p, everyone, out = load.copy(), np.arange(len(load))[None], []
    for _ in range(rounds):
        pairs = _pair_up(p, w, everyone, tol)
        if pairs is None or not len(pairs[0]):
            break
        over, under, t = pairs
        p[over] -= t
        p[under] += t
        out.append(pairs)
    return out, p


def _balanced_moves(L, q, load, w, extra, floor, tol, max_rounds, group_size, cross_rounds, only_group=None):
    """(moved global ids, their destinations, loads after, planned loads after) of ``balanced``.

    ``load``: [W] quantised loads before; ``w``: [W] speed weights or None; ``extra``, ``floor``: ``_Swapper``'s; the
    rest: ``assign``'s. Loads after are exact for the ranks followed (all, unless ``only_group``); planned ones assume
    every cross-group pair hit its target and every group its mean. ``only_group``: only the swaps that group's samples
    depend on (its ranks' partners in the last cross round, theirs in the round before, ...: at most
    group_size * 2**cross_rounds ranks, whatever W is), done exactly as in the full plan."""
    W, B = L.shape
    w = np.ones(W, np.int64) if w is None else w
    G = W if group_size is None or group_size >= W else group_size  # flat: one group, no cross rounds
    if W % G:
        raise ValueError(f"group_size: {G} does not divide the world size {W}")
    pairs, planned = _cross_group_pairs(load, tol, cross_rounds if G < W else 0, w)
    # needed[r]: ranks whose state after round r is needed; walk the rounds backwards
    need = np.ones(W, bool) if only_group is None else np.arange(W) // G == only_group
    needed = [need]
    for over, under, _ in reversed(pairs):
        partner = np.full(W, -1)
        partner[over], partner[under] = under, over
        need = need.copy()
        need[partner[need & (partner >= 0)]] = True
        needed.insert(0, need)
    sw = _Swapper(q, L, load, np.flatnonzero(needed[0]), extra=extra, floor=floor)
    for r, (over, under, t) in enumerate(pairs):
        keep = needed[r + 1][over] | needed[r + 1][under]
        if keep.any():
            sw.swap(over[keep], under[keep], t[keep])
    groups = np.arange(W).reshape(W // G, G)
    if only_group is not None:
        groups = groups[only_group : only_group + 1]
    sw.balance_groups(groups, tol, max_rounds, w)
    gid, to = sw.dest()
    real = gid < W * B  # the empty slots' moves are no samples'
    gid, to = gid[real], to[real]
    wg = w.reshape(W // G, G)  # each group's total, shared in proportion to the weights
    planned = (planned.reshape(W // G, G).sum(1)[:, None] * wg / wg.sum(1)[:, None]).ravel()
    return gid, to, sw.load, planned


def assign(
    lengths_per_rank,
    strategy: str = "balanced",
    cost: Cost | tuple = DEFAULT_COST,
    tol: float = 1e-3,
    max_rounds: int = 32,
    group_size: int | None = None,
    cross_rounds: int = 3,
    speeds=None,
    max_samples: int | None = None,
    min_samples: int = 1,
) -> Assignment:
    """The plan every rank computes identically from the all-gathered lengths.

    lengths_per_rank: [W, B] integer array (or a list of W arrays of B lengths), all >= 1.
    strategy: one of ``STRATEGIES``; ``measured`` is ``balanced`` with ``speeds``, W positive numbers:
        rank r's share of the cost in proportion to speeds[r]. cost: a ``Cost`` or its tuple.
    tol: ``balanced`` stops moving samples once max/mean cost <= 1 + tol; assignments within tol count
        as equally balanced and the one with fewer moves is preferred.
    group_size, cross_rounds: ``balanced`` only. None: one flat balancing over all ranks. A number G
        (e.g. the GPUs of a node): ``cross_rounds`` rounds of pairs across the job, then balancing
        within groups of G consecutive ranks, so each rank can compute just its part (``plan_for_rank``).
    max_samples, min_samples: ``measured`` only: a rank may hold from min_samples to max_samples samples
        (default B each; why: docs/rebalancing.md). Equal speeds keep B each: ``balanced``'s plan.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if not (0 <= tol < 1):
        raise ValueError(f"tol: expected 0 <= tol < 1, got {tol}")
    if group_size is not None and group_size < 1:
        raise ValueError(f"group_size: expected >= 1 or None, got {group_size}")
    L = _as_matrix(lengths_per_rank)
    W, B = L.shape
    w = _weights_for(strategy, speeds, W)
    extra, floor = _count_bounds(w, B, max_samples, min_samples)
    q, unit = _cost_tables(int(L.max()), cost)  # costs are reported in the caller's units
    load = q[L].sum(1)  # [W]
    ranks = np.repeat(np.arange(W, dtype=np.int32), B)  # [N]: each sample's own rank
    dest, after = ranks.copy(), None
    if strategy == "stripe":
        dest[_stripe(L).ravel()] = ranks
    elif strategy != "none":
        gid, to, after, _ = _balanced_moves(L, q, load, w, extra, floor, tol, max_rounds, group_size, cross_rounds)
        dest[gid] = to
    # stable: within a rank, by global id = (source rank, source index); int16 sorts in O(N)
    order = np.argsort(dest.astype(np.int16) if W < 1 << 15 else dest, kind="stable")
    counts = np.bincount(dest, minlength=W)
    G = np.full((W, int(counts.max())), -1, dtype=np.int64)
    at = dest[order]
    G[at, np.arange(W * B) - _offsets(counts)[:-1][at]] = order
    if after is None:  # none, stripe: every rank holds B samples
        after = q[L].ravel()[G].sum(1)
    src_rank, src_index = np.divmod(G.astype(np.int32), np.int32(B))
    src_rank[G < 0], src_index[G < 0] = -1, -1
    return Assignment(
        strategy,
        src_rank=src_rank,
        src_index=src_index,
        dest_rank=dest.reshape(W, B),
        costs_before=load * unit,
        costs_after=after * unit,
        weights=w,
    )


def _count_bounds(w, B: int, max_samples, min_samples: int) -> tuple[int, int]:
    """(empty slots per rank, the fewest samples a rank keeps) for ``_Swapper``; no empty slots unless
    ``measured``'s weights differ (equal speeds: exactly ``balanced``)."""
    if max_samples is None:
        return 0, 1
    if w is None:
        raise ValueError("max_samples: only strategy 'measured' moves samples one way")
    if not (B <= max_samples and 1 <= min_samples <= B):
        raise ValueError(
            f"max_samples, min_samples: expected 1 <= min_samples <= {B} <= max_samples, got "
            f"{min_samples}, {max_samples}"
        )
    return (int(max_samples) - B if w.min() < w.max() else 0), int(min_samples)


def _weights_for(strategy: str, speeds, W: int) -> np.ndarray | None:
    """``measured``'s integer weights [W] (1/1024 steps of the fastest speed); equal speeds give all
    ones, so ``measured`` then plans exactly as ``balanced``. None otherwise."""
    if (strategy == "measured") != (speeds is not None):
        raise ValueError(f"speeds: needed by strategy 'measured' and only by it (strategy {strategy!r})")
    if speeds is None:
        return None
    s = np.asarray(speeds, dtype=np.float64)
    if s.shape != (W,) or not np.isfinite(s).all() or s.min() <= 0:
        raise ValueError(f"speeds: expected {W} positive finite numbers, got {s.tolist()[:8]}")
    w = np.maximum(np.rint(s / s.max() * _SPEED_STEPS), 1).astype(np.int64)
    return w // np.gcd.reduce(w)


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of the plan: what it sends and what it receives.

    send_index, send_dest: [S] the samples of this rank's batch that leave, and where to; ordered by
        (destination, index), the order they are packed for the all-to-all.
    recv_rank, recv_index: [R] the samples that arrive, ordered by (source rank, index).
    imbalance_before: exact. imbalance_after: exact, except with ``group_size`` where each rank follows
        only its own group: then it is planned (cross-group pairs hit their targets, groups their means).
    moved: samples that change rank, over all ranks; None where only planned."""

    rank: int
    send_index: np.ndarray
    send_dest: np.ndarray
    recv_rank: np.ndarray
    recv_index: np.ndarray
    imbalance_before: float
    imbalance_after: float
    moved: int | None


def plan_for_rank(
    lengths_per_rank,
    rank: int,
    strategy: str = "balanced",
    cost: Cost | tuple = DEFAULT_COST,
    tol: float = 1e-3,
    max_rounds: int = 32,
    group_size: int | None = None,
    cross_rounds: int = 3,
    speeds=None,
    max_samples: int | None = None,
    min_samples: int = 1,
) -> RankPlan:
    """This rank's part of ``assign(...)``, identical to it, computed in O(W*B) adds plus
    O(group_size * 2**cross_rounds * B) with ``group_size`` (instead of the whole plan)."""
    L = _as_matrix(lengths_per_rank, rank)
    W, B = L.shape
    if strategy not in ("balanced", "measured") or group_size is None or group_size >= W:
        A = assign(L, strategy, cost, tol, max_rounds, group_size, cross_rounds, speeds, max_samples, min_samples)
        dest = A.dest_rank.ravel().astype(np.int64)
        gid = np.flatnonzero(dest != np.arange(W * B) // B)  # the samples that change rank
        to, before, after, moved = dest[gid], A.imbalance_before, A.imbalance_after, A.moved
    else:
        if not 0 <= tol < 1:
            raise ValueError(f"tol: expected 0 <= tol < 1, got {tol}")
        w = _weights_for(strategy, speeds, W)
        extra, floor = _count_bounds(w, B, max_samples, min_samples)
        q, _ = _cost_tables(int(L.max()), cost)
        load = q[L].sum(1)  # one pass over W*B; everything else is O(group_size * 2**cross_rounds * B)
        args = (L, q, load, w, extra, floor, tol, max_rounds, group_size, cross_rounds, rank // group_size)
        gid, to, _, planned = _balanced_moves(*args)
        before, after, moved = imbalance(load, w), imbalance(planned, w), None
    return _rank_plan(rank, B, gid, to, before, after, moved)


def _rank_plan(rank: int, B: int, gid: np.ndarray, to: np.ndarray, before, after, moved) -> RankPlan:
    """``rank``'s RankPlan, given the global ids ``gid`` of the samples that move and their destinations ``to``."""
    out = (gid // B == rank) & (to != rank)
    send_dest, send_index = to[out], gid[out] % B
    order = np.lexsort((send_index, send_dest))
    recv = np.sort(gid[to == rank])  # by global id: (source rank, source index)
    return RankPlan(rank, send_index[order], send_dest[order], recv // B, recv % B, before, after, moved)


@dataclass(frozen=True)
class ContextPlacement:
    """Where context parallelism puts a global batch (``place_context``)."""

    group: np.ndarray  # [N] the CP group that splits each sample (-1: it stays whole)
    rank: np.ndarray  # [N] the rank a whole sample goes to (-1: split)
    predicted: np.ndarray  # [W] each rank's predicted time (cost / speed, the caller's cost units)
    imbalance: float  # max / mean of predicted


def piece_costs(lengths, cp_size: int, cost: Cost | tuple = DEFAULT_COST) -> np.ndarray:
    """The cost one rank of a CP group of ``cp_size`` pays for its piece of a document of length L:
    its ceil(L / cp_size) queries against all L keys (global layers), against at most ``window``
    keys (local ones), and its share of the per-token work: a*l + b*l*L + b_local*l*min(L, window)."""
    c = check_cost(cost)
    L = np.asarray(lengths, dtype=np.float64)
    piece = np.ceil(L / cp_size)
    return c.a * piece + c.b * piece * L + c.b_local * piece * np.minimum(L, c.window)


def place_context(
    lengths, world: int, cp_size: int, threshold: int, cost: Cost | tuple = DEFAULT_COST, speeds=None
) -> ContextPlacement:
    """Context parallelism's placement: every sample longer than ``threshold`` is split across one CP group
    (``world // cp_size`` groups of ``cp_size`` consecutive ranks), every other goes whole to one rank, longest
    first to whoever would finish first by predicted time = cost / speed (``speeds``: ``measured``'s, default
    equal); the same on every rank. docs/context_parallel.md, "The rebalancer"."""
    L = np.asarray(lengths, dtype=np.int64).ravel()
    if world < 1 or cp_size < 1 or world % cp_size:
        raise ValueError(f"cp_size: expected a divisor of the world size {world}, got {cp_size}")
    if threshold < 1 or (L < 1).any():
        raise ValueError("threshold and lengths: expected >= 1")
    w = np.ones(world, dtype=np.int64) if speeds is None else _weights_for("measured", speeds, world)
    whole, piece = sample_costs(L, cost), piece_costs(L, cp_size, cost)
    scale = _COST_SCALE_MAX / max(float(whole.max()), 1e-300)
    whole_i, piece_i = (np.maximum(np.rint(x * scale), 1).astype(np.int64) for x in (whole, piece))
    # Integer loads, times as load / speed weight: one correctly rounded division of the same
    # integers on every rank (no float sums), so the comparisons agree everywhere.
    load = np.zeros(world, dtype=np.int64)
    group, rank = np.full((2, L.size), -1, dtype=np.int64)  # -1: split (rank), whole (group)
    long = np.flatnonzero(L > threshold)
    for i in long[np.lexsort((long, -piece_i[long]))]:  # by decreasing cost, then index
        after = ((load + piece_i[i]) / w).reshape(-1, cp_size).max(1)  # each group's slowest rank
        g = int(np.argmin(after))  # ties: the lowest group
        group[i] = g
        load[g * cp_size : (g + 1) * cp_size] += piece_i[i]
    short = np.flatnonzero(L <= threshold)
    for i in short[np.lexsort((short, -whole_i[short]))]:
        r = int(np.argmin((load + whole_i[i]) / w))
        rank[i] = r
        load[r] += whole_i[i]
    predicted = load / w / scale
    return ContextPlacement(group, rank, predicted, float(predicted.max() / predicted.mean()))


def context_plan_for_rank(
    lengths_per_rank, rank: int, cp_size: int, threshold: int, cost: Cost | tuple = DEFAULT_COST
) -> RankPlan:
    """This rank's part of the exchange that carries out ``place_context`` (docs/context_parallel.md).
    imbalance_before: CP without the exchange (long samples split by their source's group, short ones
    where they are); imbalance_after: the placement's, unless that is no better: then nothing moves."""
    L = _as_matrix(lengths_per_rank, rank)
    W, B = L.shape
    p = place_context(L.ravel(), W, cp_size, threshold, cost)
    src = np.arange(W * B) // B
    dest = np.where(p.rank >= 0, p.rank, src)
    turn = np.zeros(W // cp_size, dtype=np.int64)
    for i in np.flatnonzero(p.group >= 0):  # in global order: the same choice on every rank
        g = int(p.group[i])
        if src[i] // cp_size != g:
            dest[i] = g * cp_size + turn[g] % cp_size
            turn[g] += 1
    whole, piece = sample_costs(L.ravel(), cost), piece_costs(L.ravel(), cp_size, cost)
    load = np.zeros(W)
    long = L.ravel() > threshold
    np.add.at(load, src[~long], whole[~long])
    np.add.at(load, (src[long] // cp_size)[:, None] * cp_size + np.arange(cp_size), piece[long][:, None])
    before, after = imbalance(load), p.imbalance
    if after >= before:  # the greedy placement is no better than where the samples are: move nothing
        dest, after = src, before
    gid = np.flatnonzero(dest != src)
    return _rank_plan(rank, B, gid, dest[gid], before, after, gid.size)
