"""Online fit of the rebalancer's cost model and a speed per rank, from measured step times.

``fit_online`` fits a window of steps per rank (forward+backward seconds, ``length_features``) under
time = cost(features) / speed[rank]; ``OnlineModel`` keeps the window and the cost and speeds the plans
use, with the safeguards of docs/rebalancing.md. Every sum is ``math.fsum`` of elementwise IEEE
operations and the solve is in Python floats, so ranks with the same numbers get the same fit bit for bit.
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

import numpy as np

from data.rebalance.plan import Cost, check_cost


class Fit(NamedTuple):
    """What ``fit_online`` found."""

    cost: Cost
    speeds: tuple[float, ...]  # per rank
    residual: float  # relative RMS
    fitted: bool  # whether the fit was used (else ``cost`` is the configured one)
    scatter: tuple[float, ...] = ()  # per rank, the relative standard deviation of its steps' speeds


def length_features(lengths, window: int = 0) -> tuple[float, float, float]:
    """(sum L, sum L^2, sum L*min(L, window)) of one rank's samples in one step."""
    L = np.asarray(lengths, dtype=np.int64)
    local = L * np.minimum(L, window) if window else np.zeros_like(L)
    return float(L.sum()), float((L * L).sum()), float(local.sum())


def _costs(cost: Cost, F: np.ndarray) -> np.ndarray:
    """c of each row of features [N, 3]: elementwise IEEE operations, the same bits everywhere."""
    return cost.a * F[:, 0] + cost.b * F[:, 1] + cost.b_local * F[:, 2]


def _sum(x: np.ndarray) -> float:
    return math.fsum(x.tolist())  # exactly rounded: no dependence on numpy's summation order


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a small system; None when singular."""
    n = len(v)
    m = [row[:] + [v[i]] for i, row in enumerate(m)]
    scale = max(abs(m[i][i]) for i in range(n)) or 1.0
    for col in range(n):
        piv = max(range(col, n), key=lambda i: abs(m[i][col]))
        if abs(m[piv][col]) <= 1e-12 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for i in range(col + 1, n):
            k = m[i][col] / m[col][col]
            m[i] = [x - k * y for x, y in zip(m[i], m[col])]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - math.fsum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


def fit_online(features, times, configured, *, min_steps: int = 8, bound: float = 4.0, max_residual=0.25) -> Fit:
    """Fit ``Cost`` and per-rank speeds to ``features`` [W][T][3] and ``times`` [W][T] (seconds), each
    coefficient within a factor ``bound`` of the configured one (the method: docs/rebalancing.md). The
    configured cost is kept (``fitted`` False) while the median rank has fewer than ``min_steps`` steps,
    for a singular system or a relative RMS residual above ``max_residual``. Ranks with no steps yet get
    the mean speed of the others (1.0 when none has any)."""
    cfg = check_cost(configured)
    if bound < 1 or not math.isfinite(bound):
        raise ValueError(f"fit_online: bound must be a finite factor >= 1, got {bound}")
    W = len(times)
    if len(features) != W or any(len(features[r]) != len(times[r]) for r in range(W)):
        raise ValueError("fit_online: features and times must have the same ranks and steps")
    F = np.array([f for fr in features for f in fr], np.float64).reshape(-1, 3)  # [N, 3], rank-major
    t = np.array([x for tr in times for x in tr], np.float64)
    bounds = np.cumsum([0] + [len(tr) for tr in times])
    counts, has = np.diff(bounds), np.diff(bounds) > 0
    if len(bad := np.flatnonzero(~(np.isfinite(t) & (t > 0)))):
        r = int(np.searchsorted(bounds, bad[0], side="right") - 1)
        raise ValueError(
            f"fit_online: rank {r} step {bad[0] - bounds[r]}: time must be a positive finite number, got {t[bad[0]]}"
        )

    # Per-rank sums: the features are integers (sums exact in any order), the times fsum'd.
    F_rank = np.zeros((W, 3))
    F_rank[has] = np.add.reduceat(F, bounds[:-1][has], axis=0) if has.any() else 0
    t_rank = [_sum(t[i:j]) for i, j in zip(bounds[:-1], bounds[1:])]

    def speeds_for(cost: Cost) -> tuple[float, ...]:
        c = _costs(cost, F_rank)
        sp = [float(c[r]) / t_rank[r] if has[r] else None for r in range(W)]
        known = [s for s in sp if s is not None]
        fill = math.fsum(known) / len(known) if known else 1.0
        return tuple(fill if s is None else s for s in sp)

    def done(cost: Cost, speeds, residual: float, fitted: bool) -> Fit:
        q = _costs(cost, F) / (t * np.repeat(speeds, counts))  # each step's speed over its rank's
        parts = [q[i : i + k] for i, k in zip(bounds[:-1], counts)]
        scatter = [math.sqrt(_sum((x - _sum(x) / len(x)) ** 2) / (len(x) - 1)) if len(x) > 1 else 0.0 for x in parts]
        return Fit(cost, speeds, residual, fitted, tuple(scatter))

    speeds = speeds_for(cfg)
    steps = sorted(counts)[W // 2] if W else 0  # the median rank's
    base = (cfg.a, cfg.b, cfg.b_local)
    cols = [i for i, c in enumerate(base) if c > 0]
    if steps < min_steps or len(cols) < 2:
        return done(cfg, speeds, math.nan, False)
    # Columns scaled by the configured coefficients: the unknowns are then ratios near 1.
    X, n = F[:, cols] * np.array([base[i] for i in cols]), len(cols)
    m = [[_sum(X[:, i] * X[:, j]) for j in range(n)] for i in range(n)]
    for _ in range(3):
        y = t * np.repeat(speeds, counts)  # each step's time in cost units
        ratios = _solve(m, [_sum(X[:, i] * y) for i in range(n)])
        if ratios is None:
            return done(cfg, speeds_for(cfg), math.nan, False)
        coef = [0.0, 0.0, 0.0]
        for q, i in zip(ratios, cols):
            coef[i] = min(max(q, 1.0 / bound), bound) * base[i]
        norm = _sum(_costs(cfg, F)) / _sum(_costs(Cost(*coef, cfg.window), F))
        fitted = Cost(coef[0] * norm, coef[1] * norm, coef[2] * norm, cfg.window)
        speeds = speeds_for(fitted)
    y = t * np.repeat(speeds, counts)
    residual = math.sqrt(_sum((y - _costs(fitted, F)) ** 2) / len(y)) / (_sum(y) / len(y))
    if residual > max_residual:
        return done(cfg, speeds_for(cfg), residual, False)
    return done(fitted, speeds, residual, True)


NOISE_Z = 5.0  # standard errors that count as a change of speed
RECENT = 6  # the most recent steps tested for a change of speed
SHOWN = 2  # the fewest: two steps in a row, so that one odd step is never a change


class OnlineModel:
    """The window of measured steps per rank, and the cost and speeds the next plan uses.

    ``add`` appends one step (bad numbers are left out); ``refit`` fits the window and moves
    the speeds (mean 1) and coefficients towards the fit by at most a factor 1 +- ``rate``,
    returning the numbers logged. ``state_dict`` / ``load_state_dict``: plain lists."""

    def __init__(self, configured: Cost | tuple, world_size: int, window: int = 32, bound: float = 4.0, rate=0.1):
        if int(window) != window or window < 2 or not 1 <= bound < math.inf or not 0 < rate <= 1:
            got = (window, bound, rate)
            raise ValueError(f"measured: expected window >= 2 steps, bound >= 1, 0 < rate <= 1, got {got}")
        self.configured, self.world_size = check_cost(configured), world_size
        self.window, self.bound, self.rate = int(window), float(bound), float(rate)
        self.steps = [deque(maxlen=self.window) for _ in range(world_size)]  # (sum L, L^2, local, seconds)
        self.speeds, self.cost = (1.0,) * world_size, self.configured
        # ranks that changed speed and have RECENT steps or fewer since: their scatter over the whole window
        self.changed: dict[int, float] = {}

    def add(self, rank: int, features, seconds: float) -> None:
        f = (*(float(x) for x in features), float(seconds))
        if all(math.isfinite(x) and x >= 0 for x in f) and f[0] > 0 and seconds > 0:
            self.steps[rank].append(f)

    def _forget_changed(self) -> dict[int, float]:
        """Drop the earlier steps of each rank whose last SHOWN..RECENT steps' speed differs from its earlier
        ones' by more than NOISE_Z standard errors (docs/rebalancing.md, safeguards); returns {rank: the
        relative scatter of its whole window about the two speeds}."""
        changed = {}
        for r, d in enumerate(self.steps):
            known = self.changed.get(r)
            least = RECENT if known is None else SHOWN  # earlier steps needed
            if len(d) < least + SHOWN:
                continue
            a = np.array(d)
            q = _costs(self.cost, a[:, :3]) / a[:, 3]
            for k in range(SHOWN, min(RECENT, len(d) - least) + 1):
                old, new = q[:-k], q[-k:]
                m_old, m_new = _sum(old) / len(old), _sum(new) / k
                var = (_sum((old - m_old) ** 2) + _sum((new - m_new) ** 2)) / (len(d) - 2)
                if known is not None:
                    var = max(var, (known * m_old) ** 2)
                if abs(m_new - m_old) > NOISE_Z * math.sqrt(var * (1 / len(old) + 1 / k)):
                    for _ in range(len(old)):
                        d.popleft()
                    rel = (_sum((old / m_old - 1) ** 2) + _sum((new / m_new - 1) ** 2)) / (len(q) - 2)
                    changed[r] = max(math.sqrt(rel), known or 0.0)
                    break
        return changed

    def refit(self) -> dict:
        fresh = self._forget_changed()
        self.changed.update(fresh)
        feats, times = [[e[:3] for e in d] for d in self.steps], [[e[3] for e in d] for d in self.steps]
        min_steps = min(8, self.window)
        fit = fit_online(feats, times, self.configured, min_steps=min_steps, bound=self.bound)
        counts = [len(d) for d in self.steps]
        steps = sorted(counts)[self.world_size // 2]
        # Too few steps to fit: the speeds stay as they are (docs/rebalancing.md, safeguards).
        target = list(self.speeds)
        if steps >= min_steps:
            # Noise gives no rank extra work (docs/rebalancing.md, safeguards).
            z = 1.5 + math.sqrt(2 * math.log(max(self.world_size, 2)))
            mid, typical = (sorted(x)[self.world_size // 2] for x in (fit.speeds, fit.scatter))
            # a rank that changed speed: the scatter of its whole window, not of the few steps kept (_forget_changed)
            scatter = [self.changed.get(r, e) for r, e in enumerate(fit.scatter)]
            near = [
                n < 2 or abs(s - mid) <= z * max(e, typical) / math.sqrt(n) * s
                for s, e, n in zip(fit.speeds, scatter, counts)
            ]
            target = [mid if n else s for s, n in zip(fit.speeds, near)]
            mean = math.fsum(target) / self.world_size
            target = [s / mean for s in target]
        lo, hi = 1 - self.rate, 1 + self.rate
        toward = lambda old, new: min(max(new, old * lo), old * hi)  # noqa: E731
        # A rank that has just changed speed takes its new speed at once: the rate limit is for noise.
        self.changed = {r: e for r, e in self.changed.items() if len(self.steps[r]) <= RECENT}
        self.speeds = tuple(n if r in fresh else toward(o, n) for r, (o, n) in enumerate(zip(self.speeds, target)))
        self.cost = Cost(*(toward(o, n) for o, n in zip(self.cost[:3], fit.cost[:3])), self.configured.window)
        c = self.cost
        out = dict(fit_a=c.a, fit_b=c.b, fit_b_local=c.b_local, fitted=int(fit.fitted), window_steps=steps)
        out.update(speed_min=min(self.speeds), speed_max=max(self.speeds))
        return out | ({"fit_residual": fit.residual} if math.isfinite(fit.residual) else {})

    def state_dict(self) -> dict:
        return {
            "window": [[list(e) for e in d] for d in self.steps],
            "speeds": list(self.speeds),
            "cost": list(self.cost),
            "changed": sorted(self.changed.items()),
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["speeds"]) != self.world_size:
            return
        for d, entries in zip(self.steps, state["window"]):
            d.clear()
            d.extend(tuple(float(x) for x in e) for e in entries)
        self.speeds, self.cost = tuple(float(s) for s in state["speeds"]), check_cost(state["cost"])
        self.changed = {int(r): float(e) for r, e in state.get("changed", [])}  # none in checkpoints before issue 46
