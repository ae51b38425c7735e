"""The short soak: bench/soak.py for 200 steps on one rank (the long one, with 2 ranks and
rebalancing, is in docs/reliability.md). The run must meet the soak's goals: resident memory
within 5% after the warm-up, file descriptors and threads flat, across 4 evals and 3
checkpoints."""

import json

import pytest

from bench import soak


@pytest.mark.multiprocess
@pytest.mark.slow
def test_short_soak_meets_the_goals(tmp_path, capsys):
    out = tmp_path / "soak"
    code = soak.main(
        [
            "--steps",
            "200",
            "--ranks",
            "1",
            "--interval",
            "50",
            "--global-batch",
            "8",
            "--seq-len",
            "64",
            "--sample-every",
            "0.05",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    assert "all goals met" in printed.out
    result = json.loads((out / "soak.json").read_text())
    (r,) = result["reports"]
    assert r["rss_growth"] <= soak.RSS_GOAL and r["fds"][1] <= r["fds"][0] and r["threads"][1] <= r["threads"][0]
    assert r["samples"] >= 20 and result["steps_done"] == 200
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("eval_accuracy" in m for m in metrics) == 4
    assert sorted(p.name for p in (out / "run" / "checkpoints").iterdir()) == ["step_00000100.pt", "step_00000150.pt"]


def _samples(rss, fds, threads, steps=100):
    return [soak.Sample(t=i, step=i, rank=0, rss_kb=rss(i), fds=fds(i), threads=threads(i)) for i in range(1, steps)]


def test_the_report_catches_growth_and_ignores_warm_up_and_short_lived_threads():
    flat = _samples(lambda i: 400_000 + (100_000 if i > 10 else 0), lambda i: 20, lambda i: 8 + (i % 3 == 0))
    (r,) = soak.report(flat, ranks=1, warmup_steps=20, last_step=100)
    assert r.problems == [] and r.threads == (8, 8) and r.threads_max == 9
    leaky = _samples(lambda i: 400_000 + 1_000 * i, lambda i: 20 + i // 50, lambda i: 8 + i // 60)
    (r,) = soak.report(leaky, ranks=1, warmup_steps=20, last_step=100)
    assert [p.split(" ")[0:2] for p in r.problems] == [["RSS", "grew"], ["open", "file"], ["threads", "grew"]]
    # steps 21..99 after the warm-up; tenths of 7 samples: medians at steps 24 and 96
    assert r.rss_growth == pytest.approx((496_000 - 424_000) / 424_000)
