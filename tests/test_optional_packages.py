"""Optional packages stay optional (as on the GPU machine, docs/kernels.md "Versions"): training
runs without mlperf_logging when log.mlperf=false, and bench/gpu_check.sh's CPU mode, with
mlperf_logging, torchao, flash_attn and apex blocked from import
(tests/blocked_imports/sitecustomize.py), collects and skips the GPU tests and names each
skipped part. (Without the switch the MLPerf log's error names the package and the switch:
tests/bert/report/test_mlperf_log.py.)"""

import json
import os
import re
import subprocess
import sys

from tests.bert.train.test_trainer import dataset, run_in_process  # noqa: F401 (a fixture)
from tests.helpers import REPO

SCRIPT = REPO / "bench" / "gpu_check.sh"


def test_training_runs_without_mlperf_logging_when_log_mlperf_is_false(dataset, tmp_path, monkeypatch):  # noqa: F811
    for name in ("mlperf_logging", "bert.report.mlperf_log"):  # None in sys.modules: any import of them fails
        monkeypatch.setitem(sys.modules, name, None)
    summary = run_in_process(dataset, tmp_path, "train.max_steps=2", "log.mlperf=false")
    assert summary["steps"] == 2 and not (tmp_path / "mlperf.log").exists()


def test_gpu_check_cpu_mode_without_the_optional_packages_names_each_skipped_part(tmp_path):
    env = {
        **os.environ,
        "BLOCKED_IMPORTS": "mlperf_logging,torchao,flash_attn,apex",
        "PYTHONPATH": f"{REPO / 'tests' / 'blocked_imports'}:{REPO}",
        "OMP_NUM_THREADS": "1",
        "STAGES": "env,bundle,kernel_tests,model_tests,fp8",
        "STAGE_SCALE": "3",  # limits for a loaded 2-core machine (the work is the same)
        "WHEELHOUSE": str(tmp_path / "none"),
        "PYTHON": sys.executable,
    }
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "== bundle: skipped (mlperf-logging torchao missing and no wheelhouse" in proc.stdout, proc.stdout
    assert "== fp8: skipped (torchao is not installed" in proc.stdout, proc.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    stages = re.findall(r"^\s*(?:run|skip)_stage (\w+) ", SCRIPT.read_text(), re.M)
    assert set(summary) - {"date"} == set(stages) and len(stages) >= 15, (summary, stages)
    # the GPU test files import and collect without the packages; without a GPU every test skips
    assert summary["kernel_tests"] == {"exit": 0, "seconds": summary["kernel_tests"]["seconds"]}, summary
    assert summary["model_tests"]["exit"] == 0 and "exit" in summary["env"], summary
    ran = {"env", "kernel_tests", "model_tests"}
    assert all("skipped" in summary[s] for s in stages if s not in ran), summary
