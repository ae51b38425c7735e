"""Paths that are not tame (spaces, ' and ", non-ASCII letters, '#', glob brackets, a '$') go
through run_pretraining.py and every launch script unchanged.

The launch scripts are run from a copy of launch/ under such a path, with TRAIN_SCRIPT (their
documented override of the entry point) pointing at a recorder that writes the argv it got:
the test then compares it with what was asked, argument by argument. slurm.sub runs as a plain
bash script with the variables a job has and stand-ins for ``srun`` (one task per
``--ntasks-per-node``, here) and ``scontrol show hostnames``/``show node`` first on PATH. One real training
run goes through run_and_time.sh and run_pretraining.py with every path odd.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml

from bert.config import load_config
from tests.batches import write_dataset
from tests.helpers import REPO, clean_env, launcher, run_launched

ROOT = str(REPO)
ODD = "runs 'single' \"double\" é ü #3 [1] $HOME"

RECORDER = """import json, os, sys
args = sys.argv[1:]
out = args[args.index("--output-dir") + 1]
os.makedirs(out, exist_ok=True)
rank = os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("SLURM_PROCID") or "0"
with open(os.path.join(out, f"argv.{rank}.json"), "w", encoding="utf-8") as f:
    json.dump({"argv": args, "cwd": os.getcwd()}, f)
with open(os.path.join(out, "mlperf.log"), "w", encoding="utf-8") as f:  # what run_and_time.sh keeps
    f.write(':::MLLOG {"key": "seed", "value": 7}\\n')
"""

SRUN = r"""#!/usr/bin/env bash
# Stand-in for srun on one node: the command once per task, with the variables srun sets.
ntasks=${SLURM_NTASKS_PER_NODE:-1} chdir=
while (( $# )) && [[ $1 == --* ]]; do
    case $1 in
        --ntasks-per-node=*) ntasks=${1#*=} ;;
        --chdir=*) chdir=${1#*=} ;;
        --container-*) echo "srun stand-in: no containers" >&2; exit 2 ;;
    esac
    shift
done
if [[ -n $chdir ]]; then cd "$chdir" || exit 2; fi
pids=()
for ((i = 0; i < ntasks; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NTASKS=$ntasks "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
"""

SCONTROL = """#!/usr/bin/env bash
if [[ $1 == show && $2 == hostnames ]]; then echo localhost
elif [[ $1 == show && $2 == node ]]; then echo "NodeName=$3 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=$3"
else echo "scontrol stand-in: only 'show hostnames' and 'show node'" >&2; exit 2; fi
"""


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """An odd directory holding a copy of launch/ (and .venv) as a repository, the recorder,
    the Slurm stand-ins and a config file with an odd name."""
    root = tmp_path_factory.mktemp("paths") / ODD
    repo = root / "repo é"
    shutil.copytree(os.path.join(ROOT, "launch"), repo / "launch")
    if os.path.isdir(os.path.join(ROOT, ".venv")):
        os.symlink(os.path.realpath(os.path.join(ROOT, ".venv")), repo / ".venv")
    (root / "record it's.py").write_text(RECORDER, encoding="utf-8")
    shims = root / "bin"
    shims.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    (root / "config 'é'.yaml").write_text("train:\n  max_steps: 2\n", encoding="utf-8")
    return root


def overrides(root) -> list[str]:
    return [f"data.train_dir={root}/train 'x' \"y\" é", 'log.submitter=it\'s "me" # not a comment']


def script_env(root, **extra) -> dict:
    return clean_env(TRAIN_SCRIPT=root / "record it's.py", CLEAR_CACHES=0, **extra)


def run(args, root, timeout=120, **env) -> str:
    return run_launched([str(a) for a in args], timeout, env=script_env(root, **env), cwd=root / "repo é")


def recorded(out_dir, ranks=1) -> list[list[str]]:
    return [json.loads((out_dir / f"argv.{r}.json").read_text(encoding="utf-8"))["argv"] for r in range(ranks)]


def test_overrides_take_string_values_as_written():
    odd_values = ["/data/run #3/x", '"quoted"', "'a b'/c", "/data/a: b", "2024", "yes", "~", "[1]", 'é ü/it\'s "q"']
    for value in odd_values:
        cfg = load_config(None, [f"data.train_dir={value}", f"checkpoint.init={value}"])
        assert cfg.data.train_dir == value
        assert cfg.checkpoint.init == (None if value == "~" else value)
    assert load_config(None, ["checkpoint.init=null"]).checkpoint.init is None


@pytest.mark.slow
def test_run_torchrun(odd):
    config, out = odd / "config 'é'.yaml", odd / "out t"
    run([odd / "repo é" / "launch" / "run_torchrun.sh", 1, 2, config, out, *overrides(odd)], odd)
    assert recorded(out, 2) == [["--config", str(config), "--output-dir", str(out), *overrides(odd)]] * 2


@pytest.mark.slow
@pytest.mark.skipif(launcher("mpirun") is None, reason="no mpirun")
def test_run_mpirun(odd):
    config, out = odd / "config 'é'.yaml", odd / "out m"
    run([odd / "repo é" / "launch" / "run_mpirun.sh", 2, config, out, *overrides(odd)], odd)
    assert recorded(out, 2) == [["--config", str(config), "--output-dir", str(out), *overrides(odd)]] * 2


def test_run_and_time(odd):
    # (with NPROC_PER_NODE it puts torchrun before the same arguments: test_run_torchrun's path)
    config, results = odd / "config 'é'.yaml", odd / "results 'é'"
    printed = run(
        [odd / "repo é" / "launch" / "run_and_time.sh", *overrides(odd)],
        odd,
        CONFIG=config,
        OUTPUT_DIR=results,
        SEED=11,
    )
    want = ["--config", str(config), "--output-dir", str(results / "run_0"), "train.seed=11", *overrides(odd)]
    assert recorded(results / "run_0") == [want]
    assert (results / "result_0.txt").read_text().startswith(":::MLLOG")
    assert "RESULT,bert,11," in printed


def test_slurm_sub(odd):
    config, logs = odd / "config 'é'.yaml", odd / "slurm logs ü"
    run(
        ["bash", odd / "repo é" / "launch" / "slurm.sub", *overrides(odd)],
        odd,
        CONFIG=config,
        LOGDIR=logs,
        SLURM_JOB_ID=4242,
        SLURM_JOB_NODELIST="node1",
        SLURM_NTASKS_PER_NODE=2,
        SEED=5,
        PATH=f"{odd / 'bin'}{os.pathsep}{os.environ['PATH']}",
    )
    want = ["--config", str(config), "--output-dir", str(logs / "run_0"), "train.seed=5", *overrides(odd)]
    assert recorded(logs / "run_0", 2) == [want] * 2
    assert (logs / "result_0.txt").is_file()


@pytest.mark.slow
def test_a_real_run_with_every_path_odd(odd):
    """run_and_time.sh -> run_pretraining.py: config, data, output directory and checkpoints all
    under the odd path; keep=1 prunes the older checkpoint by listing the odd directory."""
    from tests.bert.train.test_trainer import TINY

    data = odd / "data 'd' \"q\" ü [2]"
    train, eval_file = write_dataset(str(data))
    config = odd / 'tiny é "x".yaml'
    sections: dict = {}
    for item in TINY + [
        f"data.train_dir={train}",
        f"data.eval_file={eval_file}",
        "train.max_steps=3",
        "checkpoint.interval_steps=1",
        "checkpoint.keep=1",
    ]:
        key, value = item.split("=", 1)
        *path, name = key.split(".")  # model.overrides.vocab_size: a mapping inside the section
        node = sections
        for part in path:
            node = node.setdefault(part, {})
        node[name] = value if name.endswith(("_dir", "_file")) else yaml.safe_load(value)
    config.write_text(yaml.safe_dump(sections, allow_unicode=True), encoding="utf-8")
    results = odd / "real 'r' ü"
    run_launched(
        [str(odd / "repo é" / "launch" / "run_and_time.sh"), 'log.submitter=it\'s "me"'],
        300,
        env=clean_env(
            CONFIG=config, OUTPUT_DIR=results, CLEAR_CACHES=0, TRAIN_SCRIPT=os.path.join(ROOT, "run_pretraining.py")
        ),
        cwd=odd / "repo é",
    )
    summary = json.loads((results / "run_0" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["status"] == "aborted"
    assert os.listdir(results / "run_0" / "checkpoints") == ["step_00000002.pt"]
    log = (results / "result_0.txt").read_text(encoding="utf-8")
    assert '"key": "submission_org", "value": "it\'s \\"me\\""' in log


def test_slurm_sub_refuses_a_logdir_container_mounts_cannot_express(odd):
    r = subprocess.run(
        ["bash", str(odd / "repo é" / "launch" / "slurm.sub")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=odd / "repo é",
        env=script_env(
            odd,
            CONFIG=odd / "config 'é'.yaml",
            LOGDIR=odd / "a:b",
            CONT="image.sqsh",
            SLURM_JOB_ID=1,
            SLURM_JOB_NODELIST="node1",
            PATH=f"{odd / 'bin'}{os.pathsep}{os.environ['PATH']}",
        ),
    )
    assert r.returncode == 2 and "which --container-mounts cannot express" in one_line(r.stderr)


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]
