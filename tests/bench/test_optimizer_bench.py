"""bench/optimizer.py on tiny shapes: it runs every measurement and prints the goals' lines."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import PYTHON, REPO, run_launched

SCRIPT = os.path.join(REPO, "bench", "optimizer.py")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_benchmark_prints_every_goal(tmp_path):
    out = tmp_path / "optimizer.json"
    cmd = [PYTHON, SCRIPT, "--preset", "tiny", "--vocab", "96", "--ranks", "2", "--step-ranks", "2"]
    printed = run_launched([*cmd, "--steps", "1", "--seq", "32", "--json", str(out)], 300, what="bench/optimizer.py")
    for label in ("optimizer step per rank, 2 ranks", "optimizer state per rank (MB), 2 ranks", "whole step, 2 ranks"):
        assert label in printed
    assert "global_norm" in printed and "adagc_norms" in printed
    result = json.loads(out.read_text())
    assert result["ratios"]["state_bytes"] == pytest.approx(0.5, rel=0.02)
    assert set(result["goals"]) == {"optimizer_step", "state_bytes", "whole_step"}


def test_a_bad_argument_is_one_line_and_exit_2(capsys):
    import bench.optimizer

    assert bench.optimizer.main(["--ranks", "0"]) == 2
    assert capsys.readouterr().out.strip() == "error: --ranks: must be >= 1, got 0"
    assert bench.optimizer.main(["--parts", "clipping"]) == 2
