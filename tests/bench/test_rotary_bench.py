"""bench/rotary.py without a GPU: it checks the kernel against the reference in Triton's
interpreter and writes its report."""

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton


def test_rotary_bench_checks_correctness_on_cpu(tmp_path):
    from bench import rotary

    out = tmp_path / "rotary.json"
    assert rotary.main(["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu (interpreter)" and report["max_abs_diff"] <= 1e-5
