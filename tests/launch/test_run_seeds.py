"""The launch scripts give each run its own seed and say whether the page cache was dropped."""

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import clean_env
from tests.launch.test_distributed_init import FAKE_SCONTROL, FAKE_SRUN

REPO = Path(__file__).resolve().parents[2]

# Stands in for run_pretraining.py: prints what it was given.
FAKE_TRAINER = """
import os, sys
print("ARGS", *sys.argv[1:])
print("CACHE_CLEARED", os.environ.get("MLPERF_CACHE_CLEARED"))
"""


def test_slurm_sub_gives_run_i_seed_plus_i(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "srun.log"
    env = clean_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SRUN_LOG=str(log),
        SLURM_JOB_ID="7",
        SLURM_JOB_NODELIST="node[17-18]",
        CONFIG="launch/configs/x.yaml",
        LOGDIR=str(tmp_path / "logs"),
        NEXP="3",
        SEED="100",
    )
    proc = subprocess.run(
        ["bash", "launch/slurm.sub"], cwd=REPO, env=env, capture_output=True, text=True, timeout=30, check=False
    )
    assert proc.returncode == 0, proc.stderr
    calls = [c.strip().splitlines()[-1] for c in log.read_text().split("---") if c.strip()]
    assert [dict(kv.split("=", 1) for kv in c.split()[1:])["SEED"] for c in calls] == ["100", "101", "102"]


def test_run_and_time_draws_a_seed_unless_given_and_reports_the_cache(tmp_path):
    trainer = tmp_path / "trainer.py"
    trainer.write_text(FAKE_TRAINER)
    env = {k: v for k, v in clean_env().items() if k not in ("SEED", "RUN_INDEX", "MLPERF_CACHE_CLEARED")}
    env.update(
        CONFIG="launch/configs/cpu_demo.yaml",
        TRAIN_SCRIPT=str(trainer),
        PYTHON=sys.executable,
        OUTPUT_DIR=str(tmp_path / "res"),
        CLEAR_CACHES="0",
    )
    run = subprocess.run(
        ["bash", "launch/run_and_time.sh"], cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=60
    )
    assert "train.seed=null" in run.stdout  # the trainer draws one: each run its own
    assert "CACHE_CLEARED 0" in run.stdout and "page cache not cleared (CLEAR_CACHES=0)" in run.stdout
    # (CLEAR_CACHES=1 is not tried here: as root it would drop the test machine's page cache.)
    env.update(SEED="5")
    run = subprocess.run(
        ["bash", "launch/run_and_time.sh"], cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=60
    )
    assert "train.seed=5" in run.stdout and "train.seed=null" not in run.stdout
