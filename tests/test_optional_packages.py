"""Optional packages stay optional: with mlperf_logging, torchao, flash_attn and apex blocked
from import (tests/blocked_imports/sitecustomize.py, as on the GPU machine), training runs
with log.mlperf=false, the MLPerf log is one line naming the package and the switch, and the
GPU test files collect (their tests skip with a reason)."""

import json
import os
import re
import subprocess
import sys

from tests.batches import write_dataset
from tests.bert.test_trainer import TINY
from tests.helpers import REPO

BLOCKED = "mlperf_logging,torchao,flash_attn,apex"
GPU_TEST_FILES = [
    "tests/kernels/test_kernels_gpu.py",
    "tests/kernels/test_flashmask_gpu.py",
    "tests/kernels/test_gemm_epilogue.py",
    "tests/bert/test_fp8.py",
    "tests/bert/test_sharded_optim_gpu.py",
    "tests/bert/test_cuda_graphs.py",
    "tests/bert/test_modernbert_recipe.py",
]


def blocked_env() -> dict:
    path = f"{REPO / 'tests' / 'blocked_imports'}:{REPO}"
    return {**os.environ, "BLOCKED_IMPORTS": BLOCKED, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def test_training_runs_without_mlperf_logging_when_log_mlperf_is_false(tmp_path):
    train, eval_file = write_dataset(str(tmp_path / "data"))
    args = [*TINY, f"data.train_dir={train}", f"data.eval_file={eval_file}", "train.max_steps=2"]
    run = [sys.executable, str(REPO / "run_pretraining.py"), "--output-dir"]
    ok = subprocess.run([*run, str(tmp_path / "a"), *args, "log.mlperf=false"], env=blocked_env(),
                        capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "a" / "summary.json").exists() and not (tmp_path / "a" / "mlperf.log").exists()
    bad = subprocess.run([*run, str(tmp_path / "b"), *args], env=blocked_env(), capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    line = bad.stderr.strip().splitlines()[-1]
    assert "needs mlperf_logging" in line and "log.mlperf=false" in line, line


def test_gpu_test_files_collect_without_the_optional_packages():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
         *GPU_TEST_FILES],
        cwd=REPO, env=blocked_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "error" not in proc.stdout.lower().split("collected")[-1], proc.stdout[-2000:]


def test_gpu_check_cpu_mode_names_each_skipped_part(tmp_path):
    """bench/gpu_check.sh without a GPU and without the optional packages (no wheelhouse):
    exit 0, the bundle and fp8 stages skipped naming the packages, every other stage named."""
    env = {**blocked_env(), "STAGES": "env,bundle,fp8", "WHEELHOUSE": str(tmp_path / "none"), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "== bundle: skipped (mlperf-logging torchao missing and no wheelhouse" in proc.stdout, proc.stdout
    assert "== fp8: skipped (torchao is not installed" in proc.stdout, proc.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    stages = re.findall(r"^\s*(?:run|skip)_stage (\w+) ", (REPO / "bench" / "gpu_check.sh").read_text(), re.M)
    assert set(summary) - {"date"} == set(stages) and len(stages) >= 15, (summary, stages)
    assert "exit" in summary["env"] and all("skipped" in summary[s] for s in stages if s != "env"), summary
