"""bench/flashmask.py without a GPU: the kernels' own tile counts on packed batches, checked
against the dense mask, in a subprocess (the script sets TRITON_INTERPRET itself)."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO as ROOT


@pytest.mark.slow  # a benchmark subprocess in the interpreter
def test_cpu_run_reports_the_skipped_fraction(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [
            sys.executable,
            "bench/flashmask.py",
            "--batches",
            "1",
            "--seqs",
            "12",
            "--seq-len",
            "256",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "skipped" in proc.stdout and "counts equal the dense mask's: yes" in proc.stdout
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["exact"]
    fwd = report["summary"]["fwd"]
    assert fwd["tiles"] == [128, 64] and 0.0 <= fwd["skipped_fraction"] <= 1.0
    batch = report["batches"][0]
    assert batch["sequences"] == 12 and 0 < batch["packing_density"] <= 1
    assert set(batch["counts"]) == {"fwd", "dkdv", "dq"}
