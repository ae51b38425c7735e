"""launch/distributed.py and the launch scripts: launcher detection on fake environments,
then real 2-rank gloo jobs started by torchrun and by mpirun, and the Slurm script with
fake srun/scontrol."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from launch.distributed import DistInfo, LaunchEnv, LaunchError, destroy, detect_launcher, first_host, init_distributed
from tests.helpers import REPO, clean_env, free_port, is_launch_var, launcher, run_launched

TIMEOUT_S = 60

# A stand-in for run_pretraining.py: same command line, initialises, all-reduces, reports.
WORKER = """
import argparse, json, os
import torch, torch.distributed as dist
from launch.distributed import init_distributed, destroy

p = argparse.ArgumentParser()
p.add_argument("--config")
p.add_argument("--output-dir", required=True)
p.add_argument("overrides", nargs="*")
a = p.parse_args()
info = init_distributed(timeout_s=45)
x = torch.tensor([float(info.rank + 1)])
dist.all_reduce(x)
record = dict(rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
              launcher=info.launcher, backend=info.backend, device=str(info.device),
              sum=x.item(), master_addr=os.environ["MASTER_ADDR"],
              master_port=int(os.environ["MASTER_PORT"]), config=a.config, overrides=a.overrides)
os.makedirs(a.output_dir, exist_ok=True)
with open(os.path.join(a.output_dir, f"rank{info.rank}.json"), "w") as f:
    json.dump(record, f)
destroy()
"""


def run_job(cmd, env, cwd=REPO):
    return run_launched(cmd, TIMEOUT_S, env, cwd)


def read_ranks(out_dir, n):
    records = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]
    for r, rec in enumerate(records):
        assert (rec["rank"], rec["world_size"], rec["local_rank"]) == (r, n, r)
        assert rec["sum"] == n * (n + 1) / 2  # all-reduce of rank+1 over n ranks
        assert rec["backend"] == "gloo" and rec["device"] == "cpu"
    assert len({(rec["master_addr"], rec["master_port"]) for rec in records}) == 1
    return records


def mpirun_path():
    return launcher("mpirun")


# --- launcher detection (pure) ------------------------------------------------------------

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
OMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "5"}
MPICH = {"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "3"}
SLURM = {
    "SLURM_PROCID": "9",
    "SLURM_NTASKS": "16",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_ID": "12345",
    "SLURM_STEP_NODELIST": "gpu[07-09,12]",
}


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, LaunchEnv("single", 0, 1, 0, None, None)),
        (TORCHRUN, LaunchEnv("torchrun", 1, 4, 1, "n0", 29500)),
        # torchrun wins over the MPI and Slurm variables of an enclosing allocation
        ({**SLURM, **OMPI, **TORCHRUN}, LaunchEnv("torchrun", 1, 4, 1, "n0", 29500)),
        (OMPI, LaunchEnv("openmpi", 5, 16, 5, None, None)),
        ({**SLURM, **MPICH, **OMPI}, LaunchEnv("openmpi", 5, 16, 5, None, None)),
        ({**OMPI, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000"}, LaunchEnv("openmpi", 5, 16, 5, "10.0.0.1", 4000)),
        ({**SLURM, **MPICH}, LaunchEnv("mpich", 3, 8, 3, None, None)),
        ({"PMI_RANK": "1", "PMI_SIZE": "2"}, LaunchEnv("mpich", 1, 2, None, None, None)),
        (SLURM, LaunchEnv("slurm", 9, 16, 1, "gpu07", 20000 + 12345 % 20000)),
        ({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "6000"}, LaunchEnv("slurm", 9, 16, 1, "head", 6000)),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}, LaunchEnv("slurm", 0, 1, 0, None, None)),
    ],
)
def test_detect_launcher(env, expected):
    assert detect_launcher(env) == expected


@pytest.mark.parametrize(
    "env, names",
    [
        ({"RANK": "0"}, ["RANK", "WORLD_SIZE"]),
        ({**TORCHRUN, "RANK": "one"}, ["RANK", "'one'"]),
        ({**TORCHRUN, "RANK": "4"}, ["RANK=4", "WORLD_SIZE=4"]),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, ["MASTER_PORT"]),
        ({k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"}, ["LOCAL_RANK"]),
        ({"OMPI_COMM_WORLD_RANK": "0"}, ["OMPI_COMM_WORLD_SIZE"]),
        ({k: v for k, v in SLURM.items() if k != "SLURM_LOCALID"}, ["SLURM_LOCALID"]),
        ({k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}, ["MASTER_ADDR", "NODELIST"]),
    ],
)
def test_detect_launcher_names_the_bad_variable(env, names):
    with pytest.raises(LaunchError) as e:
        detect_launcher(env)
    for name in names:
        assert name in str(e.value)


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("gpu[03-05,9],login1", "gpu03"),
        ("node7", "node7"),
        ("a1,b2", "a1"),
        ("dgx-[12,4]", "dgx-12"),
        ("[1-2]", "1"),
    ],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


# --- one process, in this process ---------------------------------------------------------


@pytest.fixture
def no_launcher_env():
    saved = dict(os.environ)
    for k in list(os.environ):
        if is_launch_var(k):
            del os.environ[k]
    destroy()  # an earlier in-process test (the trainer's) may have left a group behind
    yield
    destroy()
    os.environ.clear()
    os.environ.update(saved)


def test_single_process_gets_a_working_group(no_launcher_env):
    info = init_distributed(backend="gloo", timeout_s=10)
    assert info == DistInfo(
        0, 1, 0, torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"), "gloo", "single"
    )
    assert dist.is_initialized() and dist.get_world_size() == 1
    x = torch.arange(3.0)
    dist.all_reduce(x)
    assert x.tolist() == [0.0, 1.0, 2.0]
    assert init_distributed(backend="gloo") == info  # a second call reuses the group
    destroy()
    assert not dist.is_initialized()
    destroy()  # harmless twice


def test_bad_backend_is_an_error_not_a_switch(no_launcher_env):
    with pytest.raises(LaunchError, match="'mpi'"):
        init_distributed(backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(LaunchError, match="nccl.*CUDA"):
            init_distributed(backend="nccl")
    assert not dist.is_initialized()


# --- two ranks, real launchers ------------------------------------------------------------


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchrun_two_ranks(tmp_path, worker):
    out = tmp_path / "out"
    run_job(
        ["bash", "launch/run_torchrun.sh", "1", "2", "cfg.yaml", str(out), "train.seed=7"],
        clean_env(TRAIN_SCRIPT=str(worker)),
    )
    for rec in read_ranks(out, 2):
        assert rec["launcher"] == "torchrun"
        assert rec["config"] == "cfg.yaml" and rec["overrides"] == ["train.seed=7"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_mpirun_two_ranks_rank0_broadcasts_rendezvous(tmp_path, worker):
    if mpirun_path() is None:
        pytest.skip("no mpirun in the virtualenv or on PATH")
    out = tmp_path / "out"
    run_job(["bash", "launch/run_mpirun.sh", "2", "cfg.yaml", str(out), "a.b=1"], clean_env(TRAIN_SCRIPT=str(worker)))
    records = read_ranks(out, 2)
    for rec in records:
        assert rec["launcher"] == "openmpi" and rec["overrides"] == ["a.b=1"]
        assert rec["master_addr"] == socket.gethostname()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_mpirun_two_ranks_exported_rendezvous(tmp_path, worker):
    mpirun = mpirun_path()
    if mpirun is None:
        pytest.skip("no mpirun in the virtualenv or on PATH")
    port = free_port()
    out = tmp_path / "out"
    cmd = [mpirun, "-np", "2", "--oversubscribe", "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "PYTHONPATH"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    run_job(
        cmd + [sys.executable, str(worker), "--output-dir", str(out)],
        clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
    )
    for rec in read_ranks(out, 2):
        assert (rec["launcher"], rec["master_addr"], rec["master_port"]) == ("openmpi", "127.0.0.1", port)


# --- the scripts themselves -----------------------------------------------------------------

SCRIPTS = ["launch/run_and_time.sh", "launch/run_torchrun.sh", "launch/run_mpirun.sh", "launch/slurm.sub"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_syntax(script):
    proc = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert os.access(REPO / script, os.X_OK) or script.endswith(".sub")


@pytest.mark.parametrize(
    "args, message",
    [
        (["launch/run_torchrun.sh", "1", "2", "cfg.yaml"], "usage"),
        (["launch/run_torchrun.sh", "0", "2", "cfg.yaml", "out"], "positive integers"),
        (["launch/run_torchrun.sh", "2", "8", "cfg.yaml", "out"], "NODE_RANK"),
        (["launch/run_mpirun.sh", "2", "cfg.yaml"], "usage"),
        (["launch/run_mpirun.sh", "two", "cfg.yaml", "out"], "positive integer"),
    ],
)
def test_script_usage_errors(args, message):
    proc = subprocess.run(["bash"] + args, cwd=REPO, capture_output=True, text=True, env=clean_env(), timeout=30)
    assert proc.returncode != 0 and message in proc.stderr


FAKE_SRUN = """#!/usr/bin/env bash
env_line="ENV MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT RUN_INDEX=$RUN_INDEX"
env_line+=" ${SEED:+SEED=$SEED }OUTPUT_DIR=$OUTPUT_DIR"
{ printf '%s\\n' "$@"; echo "$env_line"; echo ---; } >> "$SRUN_LOG"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2 $3" == "show hostnames node[17-18]" ]] && printf 'node17\\nnode18\\n'
"""


def test_slurm_sub_starts_one_srun_per_run_in_the_container(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log, logdir = tmp_path / "srun.log", tmp_path / "logs"
    env = clean_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SRUN_LOG=str(log),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[17-18]",
        SLURM_NTASKS_PER_NODE="8",
        CONFIG="launch/configs/x.yaml",
        CONT="bert.sqsh",
        CONT_MOUNTS="/lustre/data:/data",
        LOGDIR=str(logdir),
        NEXP="2",
    )
    proc = subprocess.run(
        ["bash", "launch/slurm.sub", "data.train_dir=/data/hdf5"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    calls = [c.strip().splitlines() for c in log.read_text().split("---") if c.strip()]
    assert len(calls) == 2 and logdir.is_dir()
    for i, call in enumerate(calls):
        args, env_line = call[:-1], call[-1]
        assert "--ntasks-per-node=8" in args
        assert "--container-image=bert.sqsh" in args
        assert f"--container-mounts={logdir}:/results,/lustre/data:/data" in args
        assert args[-2:] == ["./launch/run_and_time.sh", "data.train_dir=/data/hdf5"]
        fields = dict(kv.split("=", 1) for kv in env_line.split()[1:])
        assert fields["MASTER_ADDR"] == "node17" and fields["MASTER_PORT"] == str(20000 + 4242 + i)  # a port per run
        assert fields["RUN_INDEX"] == str(i) and fields["OUTPUT_DIR"] == "/results"
        assert "SEED" not in fields  # no SEED: each run's trainer draws its own from the OS
