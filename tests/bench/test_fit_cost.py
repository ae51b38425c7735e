"""bench/fit_cost.py: the least-squares fit recovers known coefficients, the model scaling,
and a tiny measured run prints a config line the config accepts."""

import numpy as np
import pytest

from bench import fit_cost
from bert.config import load_config


def test_fit_recovers_known_coefficients():
    L = np.array([128, 512, 1024, 2048, 4096, 8192])
    a1, b1, l1, w = 3e-6, 2e-10, 5e-11, 128
    tg, tl = a1 * L + b1 * L * L, a1 * L + l1 * L * np.minimum(L, w)
    assert fit_cost.fit(L, tg, tl, w) == pytest.approx((a1, b1, l1), rel=1e-9)


def test_fit_clips_a_negative_term_to_zero():
    L = np.array([16, 32, 64, 128])
    # Local times no larger than the linear part: the unconstrained l1 would be negative.
    tg, tl = 1e-3 * L + 1e-5 * L * L, 1e-3 * L - 1e-7 * L * np.minimum(L, 16)
    a1, b1, l1 = fit_cost.fit(L, tg, tl, 16)
    assert l1 == 0.0 and a1 > 0 and b1 > 0


def test_model_cost_scales_by_the_layer_counts():
    c = fit_cost.model_cost(2.0, 1e-4, 1e-5, layers=22, global_layers=8, window=128)
    assert (c.a, c.window) == (1.0, 128)
    assert c.b == pytest.approx(8 * 1e-4 / 44) and c.b_local == pytest.approx(14 * 1e-5 / 44)
    assert fit_cost.model_cost(2.0, 1e-4, 0.0, 4, 4, 128).window == 0  # no local layers: no window term


def test_a_tiny_run_prints_a_config_line_the_config_accepts(capsys, tmp_path):
    args = ["--hidden", "16", "--heads", "2", "--intermediate", "32", "--gated", "--layers", "3", "--window", "8"]
    args += ["--lengths", "8", "16", "32", "--tokens", "64", "--repeats", "1", "--json", str(tmp_path / "f.json")]
    assert fit_cost.main(args) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("data.rebalance_cost=[")
    section = load_config(None, [line]).data
    assert len(section.rebalance_cost) == 4 and max(section.rebalance_cost[:3]) > 0
    assert (tmp_path / "f.json").stat().st_size > 0


def test_a_backend_that_cannot_run_is_one_line():
    with pytest.raises(SystemExit, match="^fit_cost: --attention nope: model.attention: unknown backend 'nope'"):
        fit_cost.main(["--attention", "nope", "--lengths", "8"])
