"""bench/gpu_check.sh's own logic, cheaply: a bad STAGE_SCALE is refused before anything
runs, fractional scales are accepted, the stage limits add up to at most 8 minutes, and the
tile picker names the faster preset. (The whole script in CPU mode, every stage for
correctness: ``STAGE_SCALE=2 bash bench/gpu_check.sh /tmp/gpu_check``, documented in
docs/kernels.md; each benchmark's CPU mode has its own test.)"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

from bench.pick_tiles import main as pick_tiles  # noqa: E402
from tests.helpers import REPO as ROOT  # noqa: E402

SCRIPT = ROOT / "bench" / "gpu_check.sh"


@pytest.mark.parametrize("scale", ["0", "-1", "abc", "1/2"])
def test_bad_stage_scale_is_refused_before_any_stage(tmp_path, scale):
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        env={"STAGE_SCALE": scale, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and f"STAGE_SCALE={scale} is not a positive number" in proc.stderr
    assert "== env" not in proc.stdout


def test_stage_limits_fit_in_eight_minutes_and_scale_by_fractions():
    text = SCRIPT.read_text()
    limits = [int(n) for n in re.findall(r"^\s*(?:[A-Z_]+=\S+ )?run_stage \w+ (\d+) ", text, re.M)]
    assert len(limits) == 15 and sum(limits) <= 8 * 60, limits
    body = re.search(r"limit=\$\(awk .*\)$", text, re.M).group(0)
    for scale, want in (("0.5", "30"), ("1", "60"), ("0.01", "5")):
        got = subprocess.run(
            ["bash", "-c", f"limit=60; SCALE={scale}; {body}; echo $limit"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        assert got == want, (scale, got)


def test_pick_tiles_names_the_faster_preset(tmp_path, capsys):
    def report(name, grouped_ms, triton_ms):
        path = tmp_path / name
        path.write_text(
            json.dumps({"results": {"triton_grouped": {"median_ms": grouped_ms}, "triton": {"median_ms": triton_ms}}})
        )
        return str(path)

    out = tmp_path / "tiles.json"
    assert pick_tiles([report("d.json", 2.0, 3.0), report("s.json", 1.6, 3.3), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["triton_grouped"]["faster"] == "small" and result["triton"]["faster"] == "default"
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"results": {"triton": {"status": "ok"}}}))
    assert pick_tiles([str(cpu), str(cpu)]) == 0 and "nothing to pick" in capsys.readouterr().out
    assert pick_tiles([str(tmp_path / "missing.json"), str(cpu)]) == 2


def test_fused_ops_bench_checks_correctness_on_cpu(tmp_path):
    from bench import fused_ops

    out = tmp_path / "fused.json"
    assert fused_ops.main(["--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"bias_gelu", "bias_dropout_add_layer_norm"}
    assert all(r["status"] == "ok" for r in results.values())
