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


def test_a_named_backend_that_cannot_run_fails_the_benchmark(monkeypatch, capsys):
    """On a GPU whose torch has no flex_attention: asked for by name, that fails the run; not
    named (the default list) or --optional, it is only reported."""
    import torch

    from bench import flashmask as bench_flashmask

    def gpu_report(args, sampler):
        ok = {"status": "ok", "median_ms": 1.0, "tflops": 1.0, "ratio_vs_flex": None, "max_diff_vs_sdpa_dense": 0.0}
        results = {name: dict(ok) for name in args.backends}
        results["flex_attention"] = {"status": "unavailable", "reason": "torch has no flex_attention (this test)"}
        return {"batches": [], "results": results, "flex_block_mask_ms": [], "tile_counts": {}}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU (this test)")
    monkeypatch.setattr(bench_flashmask, "gpu_report", gpu_report)
    assert bench_flashmask.main(["--backends", "flashmask,flex_attention"]) == 1
    assert "failed: flex_attention" in capsys.readouterr().err
    assert bench_flashmask.main(["--backends", "flashmask", "--optional", "flex_attention"]) == 0
    assert bench_flashmask.main([]) == 0
