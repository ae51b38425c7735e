"""bench/context_parallel.py runs end to end on a tiny document (its memory numbers are not
checked: benchmarks are not timed tests); the CP ranks' losses sum to the one-rank loss."""

import json
import re

import pytest

from bench import context_parallel


@pytest.mark.slow  # a benchmark end to end
@pytest.mark.multiprocess  # 1 + 2 gloo ranks
def test_the_bench_runs_and_its_ranks_add_up_to_one_rank(tmp_path, capsys):
    out = tmp_path / "cp.json"
    argv = ["--tokens", "300", "--ranks", "2", "--layers", "3", "--window", "16", "--hidden", "32", "--heads", "2"]
    assert context_parallel.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"largest CP rank / one rank: \d\.\d{3} \(goal <= 0.35 at 4 ranks\)", printed)
    result = json.loads(out.read_text())
    assert len(result["cp"]) == 2
    assert sum(r["loss"] for r in result["cp"]) == pytest.approx(result["one"]["loss"], rel=1e-5)
    assert result["bytes"]["window_halo_max"] == 8 * 2 * 32 * 4  # 8 tokens (window // 2) of K and V, fp32
