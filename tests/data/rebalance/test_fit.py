"""data.rebalance.fit: the online cost fit and per-rank speeds against known synthetic truth."""

import math

import numpy as np
import pytest

from data.rebalance.fit import OnlineModel, fit_online, length_features
from data.rebalance.plan import DEFAULT_COST, Cost, sample_costs


def _window(true: Cost, speeds, steps, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    feats, times = [], []
    for s in speeds:
        fr, tr = [], []
        for _ in range(steps):
            L = rng.integers(16, 512, size=8)
            fr.append(length_features(L, true.window))
            tr.append(float(sample_costs(L, true).sum()) / s * (1 + noise * rng.uniform(-1, 1)))
        feats.append(fr)
        times.append(tr)
    return feats, times


def _shape_error(fit: Cost, true: Cost) -> float:
    L = np.arange(16, 513)
    got, want = sample_costs(L, fit), sample_costs(L, true)
    return float(np.max(np.abs(got / got.sum() - want / want.sum()) / (want / want.sum())))


def test_recovers_shape_and_speeds():
    true = Cost(1.0, 2.5 / 6144)
    speeds = [1e6, 1e6, 0.5e6, 1e6]
    fit = fit_online(*_window(true, speeds, steps=16), DEFAULT_COST)
    assert fit.fitted and fit.residual < 1e-4
    assert _shape_error(fit.cost, true) < 1e-4
    ratios = [s / fit.speeds[0] for s in fit.speeds]
    assert ratios == pytest.approx([1.0, 1.0, 0.5, 1.0], rel=1e-4)


def test_noisy_times_within_ten_percent():
    true = Cost(1.0, 2.5 / 6144)
    fit = fit_online(*_window(true, [1.0, 0.7, 1.0], steps=50, noise=0.1, seed=3), DEFAULT_COST)
    assert fit.fitted and _shape_error(fit.cost, true) < 0.10
    assert fit.speeds[1] / fit.speeds[0] == pytest.approx(0.7, rel=0.05)


def test_falls_back_and_bounds():
    true = Cost(1.0, 100 / 6144)  # 100x the configured b: clamped to bound x
    few = fit_online(*_window(true, [1.0, 1.0], steps=3), DEFAULT_COST, min_steps=8)
    assert not few.fitted and few.cost == DEFAULT_COST
    bounded = fit_online(*_window(true, [1.0, 1.0], steps=16), DEFAULT_COST, bound=2.0, max_residual=1.0)
    # a and b each within 2x of the configured ones before the common scale: b/a within 4x
    assert (
        DEFAULT_COST.b / DEFAULT_COST.a
        < bounded.cost.b / bounded.cost.a
        <= 4.0 * DEFAULT_COST.b / DEFAULT_COST.a * (1 + 1e-12)
    )
    noisy = fit_online(*_window(true, [1.0, 1.0], steps=16, noise=0.9), DEFAULT_COST, max_residual=0.01)
    assert not noisy.fitted and noisy.cost == DEFAULT_COST
    with pytest.raises(ValueError, match="rank 1 step 0"):
        fit_online([[(1.0, 1.0, 0.0)], [(1.0, 1.0, 0.0)]], [[1.0], [math.nan]], DEFAULT_COST)


def test_deterministic_and_exact_with_configured_cost():
    feats, times = _window(DEFAULT_COST, [1.0, 1.0, 1.0], steps=12, seed=5)
    a = fit_online(feats, times, DEFAULT_COST)
    b = fit_online([list(r) for r in feats], [list(r) for r in times], DEFAULT_COST)
    assert a == b
    assert _shape_error(a.cost, DEFAULT_COST) < 1e-9 and a.speeds[0] == pytest.approx(a.speeds[2], rel=1e-12)


def _feed(model, speeds, rng, noise=0.1, cost=DEFAULT_COST):
    for r, s in enumerate(speeds):
        L = rng.integers(16, 512, size=8)
        model.add(r, length_features(L), float(sample_costs(L, cost).sum()) / s * (1 + noise * rng.uniform(-1, 1)))
    return model.refit()


def test_online_model_noise_rate_change_and_state():
    rng = np.random.default_rng(7)
    model = OnlineModel(DEFAULT_COST, 4, window=16, rate=0.1)
    for _ in range(20):  # equal ranks, noisy times: no rank gets another share
        before = model.speeds
        _feed(model, [1.0] * 4, rng)
        assert all(abs(n / o - 1) <= 0.1 + 1e-12 for n, o in zip(model.speeds, before))  # the rate limit
    assert model.speeds == (1.0,) * 4
    for _ in range(14):  # rank 2 throttled to half speed: it forgets its old steps, its speed follows
        _feed(model, [1.0, 1.0, 0.5, 1.0], rng)
    assert len(model.steps[2]) < 16 and model.speeds[2] / model.speeds[0] == pytest.approx(0.5, rel=0.1)
    again = OnlineModel(DEFAULT_COST, 4, window=16, rate=0.1)
    again.load_state_dict(model.state_dict())
    assert again.state_dict() == model.state_dict() and again.refit() == model.refit()


def test_speeds_stay_while_too_few_steps_are_left_to_fit():
    # Both ranks slow down together (a loaded machine): each forgets its earlier steps, fewer than
    # the fit needs are left, and the speeds learnt stay (they were pulled back to equal before).
    rng = np.random.default_rng(3)
    model = OnlineModel(DEFAULT_COST, 2, window=8, rate=0.25)
    for _ in range(16):
        _feed(model, [1.0, 0.5], rng, noise=0.01)
    assert model.speeds[1] / model.speeds[0] == pytest.approx(0.5, rel=0.1)
    windows = []
    for _ in range(4):
        windows.append(_feed(model, [1 / 3, 1 / 6], rng, noise=0.01)["window_steps"])
        assert model.speeds[1] / model.speeds[0] == pytest.approx(0.5, rel=0.1), windows
    assert min(windows) < 8, windows
