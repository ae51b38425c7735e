"""What the multi-process tests share: the repository path, a clean environment for launched
processes, a free port, the launchers, and running a launcher with a hard timeout.

Every launcher (torchrun, mpirun, a launch script) runs in its own session, so that on a
timeout the whole process group (the launcher and every rank it started) is killed and the
test fails with the output's tail: a hang is a failure, never a stuck suite.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# Variables a launcher sets for its ranks. The test process may itself run under a launcher,
# and in-process runs export torchrun's variables: launched processes must inherit none.
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MPI_LOCALRANKID",
)
LAUNCH_PREFIXES = ("OMPI_", "PMI", "PRTE_", "SLURM_", "TORCHELASTIC_")


def compliance_check(log_path, werror: bool = False, timeout: float = 120) -> tuple[int, str, str]:
    """MLPerf's compliance checker on ``log_path`` with ruleset 5.0.0 (BERT's last round; the
    default ruleset no longer knows BERT). Returns (exit status, its report, stdout + stderr)."""
    report = f"{log_path}.checker.txt"
    cmd = [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training", "--ruleset", "5.0.0"]
    cmd += ["--log_output", report, str(log_path)] + (["--werror"] if werror else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    text = Path(report).read_text() if os.path.exists(report) else ""
    return proc.returncode, text, proc.stdout + proc.stderr


def is_launch_var(name: str) -> bool:
    return name in LAUNCH_VARS or name.startswith(LAUNCH_PREFIXES)


def clean_env(**extra) -> dict[str, str]:
    """This process's environment without any launcher's variables, with the repository
    importable, one OpenMP thread per process, unbuffered output, ``PYTHON`` (the launch
    scripts' interpreter) set to this one, plus ``extra`` (values turned into strings)."""
    env = {k: v for k, v in os.environ.items() if not is_launch_var(k)}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHON=PYTHON)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(name: str) -> str | None:
    """``torchrun`` or ``mpirun``: the virtualenv's, else the one on PATH, else None."""
    path = Path(PYTHON).parent / name
    return str(path) if path.exists() else shutil.which(name)


def run_launched(cmd: list[str], timeout: float, env: dict | None = None, cwd=REPO, what: str | None = None) -> str:
    """Run ``cmd`` in a new session with ``clean_env()`` (or ``env``); return its output
    (stdout and stderr together). Fails the test, killing the whole process group, when it
    runs past ``timeout`` seconds; fails with the output's tail when it exits non-zero."""
    what = what or os.path.basename(cmd[0])
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=clean_env() if env is None else env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what} did not finish within {timeout:g} s (killed):\n{out[-4000:]}")
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _descendants(root: int) -> list[int]:
    """The processes below ``root``, found through /proc's parent links (they may be in other sessions)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Job:
    """A process (and its children) in a new session, its output in the file ``log`` (never a
    pipe that could fill up and block it); for tests that watch or kill running ranks."""

    def __init__(self, args: list[str], log: str, env: dict):
        self.args, self.log = args, log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def dump_worker_stacks(self, settle_s: float = 2.0) -> None:
        """Ask the fault workers under this job (tests/faults/fault_worker.py) to write their
        threads' stacks into the log, then give them ``settle_s`` to do it."""
        workers = [pid for pid in [self.proc.pid, *_descendants(self.proc.pid)] if b"fault_worker.py" in _cmdline(pid)]
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        if workers:
            time.sleep(settle_s)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def wait(self, timeout: float, what: str = "the job") -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.dump_worker_stacks()
            self.kill()
            pytest.fail(f"{what} did not finish within {timeout:g} s (killed):\n{self.output()[-12000:]}")
