"""bench.step_sync and bench.static_shapes run end to end in their CPU modes (their numbers
are not checked: benchmarks are not timed tests); a bad argument is one line, exit 2."""

from __future__ import annotations

import json

from bench import static_shapes, step_sync


def test_step_sync_cpu_smoke_counts_no_read(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert step_sync.main(["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"dynamic:padded", "static:padded"}
    assert all(r["status"] == "ok" and r["device_reads_per_step"] == 0 for r in report["results"].values())
    assert report["results"]["static:padded"]["distinct_shapes"] == 1 and report["eval"]["total"] > 0
    assert "not a measurement" in capsys.readouterr().out


def test_step_sync_bad_variant_is_one_line(capsys):
    assert step_sync.main(["--variants", "nope"]) == 2
    assert "--variants: unknown 'nope'" in capsys.readouterr().err


def test_static_shapes_table(capsys):
    static_shapes.main(["--batch", "8", "--steps", "50", "--ranks", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert "<- auto_token_bucket" in "\n".join(lines) and len(lines) >= 8


def test_shard_gap_runs_both_loaders(capsys):
    from bench import shard_gap

    args = ["--steps", "12", "--shards", "4", "--shard-samples", "40", "--global-batch", "16", "--world-size", "2"]
    assert shard_gap.main([*args, "--step-ms", "1"]) == 0
    out = capsys.readouterr().out
    assert "read-ahead" in out and "no read-ahead" in out
