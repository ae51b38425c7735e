"""dist.fault_tolerance=torchft on the CPU (gloo): replicas killed, restarted, stopped, and the
Lighthouse killed. A lost replica costs the step it failed; the survivors redo it on the same
samples and their losses equal the uninterrupted single-process run's (1e-5 relative, every step).

Two runs cover the cases (each replica a process, a real ``torchft_lighthouse`` beside them):
three replicas losing one at a step drawn from a seeded generator, that one restarted and healed
from a peer (its weights and LAMB state then bitwise equal to the others'), then two lost in a row;
and two replicas, one stopped with SIGSTOP (dropped after TORCHFT_TIMEOUT_SEC), then the Lighthouse
killed (each replica ends with one line naming it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from tests.faults.common import PYTHON, ROOT, WORKER, Job, clean_env, free_port, run_args, run_in_process, wait_for
from tests.helpers import run_launched

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
torchft = pytest.importorskip("torchft", reason="dist.fault_tolerance=torchft needs torchft (pip install -e '.[ft]')")

# 12 = 3 x 4 = 2 x 6: the global batch splits evenly over 3, 2 or 1 replicas (balanced rebalancing on).
STEPS = ("train.global_batch_size=12", "train.max_steps=14", "data.rebalance=balanced", "eval.interval_samples=84")
FT = ("dist.fault_tolerance=torchft", "dist.timeout_s=8", "checkpoint.interval_steps=4")
DELAY_S = 0.35  # per step: the window in which a replica is killed or stopped
LIGHTHOUSE = os.path.join(os.path.dirname(PYTHON), "torchft_lighthouse")


@pytest.fixture(scope="module")
def uninterrupted(dataset, tmp_path_factory):
    """The run's losses, step -> loss, from one process without fault tolerance."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run_in_process(dataset, out, *STEPS)
    return losses_by_step(out)


def losses_by_step(out) -> dict[int, float]:
    path = os.path.join(out, "metrics.jsonl")
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def lighthouse_args(port: int) -> list[str]:
    """Quorums wait 1 s for stragglers; a replica silent for 2 s is out (the binary's options)."""
    args = [LIGHTHOUSE, "--min_replicas", "1", "--bind", f"[::]:{port}", "--join_timeout_ms", "1000"]
    return args + ["--quorum_tick_ms", "20", "--heartbeat_timeout_ms", "2000"]


def start_lighthouse(tmp_path) -> tuple[Job, str]:
    port = free_port()
    return Job(lighthouse_args(port), str(tmp_path / "lighthouse.log"), clean_env()), f"http://127.0.0.1:{port}"


def start_replica(i: int, out, dataset, address: str, marks, tmp_path, tag: str = "", hold: bool = True) -> Job:
    env = clean_env(
        REPLICA_GROUP_ID=i,
        TORCHFT_LIGHTHOUSE=address,
        TORCHFT_TIMEOUT_SEC=3,  # a silent replica fails the step after 3 s (dist.timeout_s=8 bounds a quorum)
        FAULT_MARK_DIR=marks,
        FAULT_STEP_DELAY_S=DELAY_S,
        FAULT_STATE_HASH=1,
        **({"FAULT_HOLD_FILE": marks / "hold"} if hold else {}),
    )
    args = [PYTHON, WORKER, "--output-dir", str(out), *run_args(dataset, *STEPS, *FT)]
    return Job(args, str(tmp_path / f"replica{i}{tag}.log"), env)


def trained(out, i: int) -> int:
    """The newest step replica ``i`` logged a loss for (0: none yet)."""
    try:
        return max(losses_by_step(os.path.join(out, f"replica_{i}")), default=0)
    except (OSError, json.JSONDecodeError):
        return 0


def check_losses(out, i: int, uninterrupted: dict[int, float], first: int | None = None, upto: int | None = None):
    """Replica i's losses of steps ``first``..``upto`` (default: its first and last; a replica that
    starts late heals into the run) equal the uninterrupted run's; returns the largest relative difference."""
    got = losses_by_step(os.path.join(out, f"replica_{i}"))
    first = min(got) if first is None else first
    upto = max(got) if upto is None else upto
    steps = [s for s in sorted(uninterrupted) if first <= s <= upto]
    assert [s for s in sorted(got) if first <= s <= upto] == steps, f"replica {i} logged steps {sorted(got)}"
    worst = max(abs(got[s] - uninterrupted[s]) / abs(uninterrupted[s]) for s in steps)
    assert worst <= 1e-5, f"replica {i}: a loss differs by {worst:.2e} (relative) from the uninterrupted run's"
    return worst


def read_mark(marks, name: str) -> str:
    with open(os.path.join(marks, name)) as f:
        return f.read()


@pytest.mark.timeout(240)
def test_replicas_lost_one_then_two_in_a_row_and_one_restarted(dataset, uninterrupted, tmp_path):
    rng = random.Random(44)  # the number: the kill's replica and step are drawn, and reproducible
    victim, kill_at = rng.randrange(3), rng.randint(2, 5)
    out, marks = tmp_path / "out", tmp_path / "marks"
    marks.mkdir()
    lighthouse, address = start_lighthouse(tmp_path)
    jobs = [start_replica(i, out, dataset, address, marks, tmp_path) for i in range(3)]
    a, b = [i for i in range(3) if i != victim]
    try:
        # All three in one quorum before the kill (a late starter heals at its first quorum).
        three = lambda: all(trained(out, i) >= kill_at for i in range(3))  # noqa: E731
        wait_for(three, 150, jobs, f"all three replicas at step {kill_at}")
        kill(marks, victim, jobs)
        # The survivors go on without a restart; then the victim comes back and heals from a peer.
        wait_for(lambda: trained(out, a) >= kill_at + 2, 60, [jobs[a], jobs[b]], "two steps without the victim")
        # The survivors wait between two steps while the victim starts (seconds here), then go on.
        (marks / "hold").touch()
        jobs[victim] = start_replica(victim, out, dataset, address, marks, tmp_path, tag="-restarted", hold=False)
        wait_for(lambda: "config:" in jobs[victim].output(), 90, jobs, "the restarted replica's start")
        (marks / "hold").unlink()
        wait_for(lambda: "recovered from a peer" in jobs[victim].output(), 90, jobs, "the restarted replica's heal")
        healed = int(jobs[victim].output().split("recovered from a peer at step ")[1].split()[0])
        wait_for(lambda: trained(out, victim) >= healed + 2, 60, jobs, "two steps with the restarted replica")
        # Two lost in a row, one step apart: the restarted replica goes on alone.
        kill(marks, a, jobs)
        now = trained(out, victim)
        wait_for(lambda: trained(out, victim) > now, 60, [jobs[victim], jobs[b]], "one more step")
        kill(marks, b, jobs)
        assert trained(out, victim) < 14, "the run ended before the second loss: raise DELAY_S"
        assert jobs[victim].wait(120, "the last replica") == 0, jobs[victim].output()[-3000:]
    finally:
        for job in [*jobs, lighthouse]:
            job.kill()
    log = jobs[victim].output()
    assert "Traceback" not in log, log[-3000:]
    # Each loss is one new quorum (a kill inside a step also costs that step: "not committed", redone).
    sizes = [int(line.split(" replica(s)")[0].rsplit(" ", 1)[1]) for line in log.splitlines() if "replica(s)" in line]
    assert sizes[-3:] == [3, 2, 1], log[-3000:]
    # Healed bitwise: after its first steps back, its weights and LAMB state hash as the others' do.
    for step in (healed + 1, healed + 2):
        hashes = {read_mark(marks, f"rank{i}.step{step}") for i in range(3)}
        assert len(hashes) == 1, f"step {step}: the replicas' states differ"
    worst = max(
        check_losses(out, a, uninterrupted, upto=trained(out, a)),
        check_losses(out, victim, uninterrupted, first=healed + 1),
    )
    print(f"largest relative loss difference against the uninterrupted run: {worst:.2e}")
    summary = json.loads((out / f"replica_{victim}" / "summary.json").read_text())
    assert summary["steps"] == 14 and summary["samples"] == 14 * 12
    assert "step_00000012.pt" in os.listdir(out / "checkpoints")  # written by the quorum's rank 0


def kill(marks, i: int, jobs: list[Job]) -> None:
    os.kill(int(read_mark(marks, f"rank{i}.pid")), signal.SIGKILL)
    jobs[i].proc.wait()


@pytest.mark.timeout(200)
def test_a_stopped_replica_is_dropped_then_the_lighthouse_killed_ends_the_run(dataset, uninterrupted, tmp_path):
    out, marks = tmp_path / "out", tmp_path / "marks"
    marks.mkdir()
    lighthouse, address = start_lighthouse(tmp_path)
    jobs = [start_replica(i, out, dataset, address, marks, tmp_path) for i in range(2)]
    stopped = None
    try:
        wait_for(lambda: all(trained(out, i) >= 3 for i in range(2)), 150, jobs, "both replicas at step 3")
        stopped = int(read_mark(marks, "rank1.pid"))
        os.kill(stopped, signal.SIGSTOP)
        at = trained(out, 0)
        start = time.monotonic()
        wait_for(lambda: trained(out, 0) > at + 1, 60, jobs[:1], "replica 0 going on alone")
        dropped_after = time.monotonic() - start
        # TORCHFT_TIMEOUT_SEC=3 fails the step; the Lighthouse drops the silent replica 2 s after its last heartbeat.
        assert dropped_after < 3 + 2 + 8, f"the stopped replica held the run for {dropped_after:.1f} s"
        lighthouse.kill()
        rc = jobs[0].wait(60, "replica 0 after the Lighthouse was killed")
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)
        for job in [*jobs, lighthouse]:
            job.kill()
    log = jobs[0].output()
    assert rc == 1, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and f"no quorum from the Lighthouse at {address}" in errors[0], log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    check_losses(out, 0, uninterrupted)


@pytest.mark.timeout(200)
def test_run_mpirun_starts_the_lighthouse_and_two_replicas(dataset, uninterrupted, tmp_path):
    """FT_REPLICAS=2 launch/run_mpirun.sh 1 ...: one process on the node (MPI rank 0) starts the
    Lighthouse and two replicas that are no ranks of mpirun's world; both train the uninterrupted run."""
    out = tmp_path / "out"
    env = clean_env(FT_REPLICAS=2, FT_LIGHTHOUSE_PORT=free_port(), FT_JOIN_TIMEOUT_MS=2000, TORCHFT_TIMEOUT_SEC=5)
    args = [
        os.path.join(ROOT, "launch", "run_mpirun.sh"),
        "1",
        os.path.join(ROOT, "launch", "configs", "cpu_demo.yaml"),
    ]
    log = run_launched([*args, str(out), *run_args(dataset, *STEPS, *FT[1:])], 180, env=env, what="run_mpirun.sh")
    assert "Traceback" not in log, log[-3000:]
    for i in range(2):
        check_losses(out, i, uninterrupted)  # a replica that joined the second quorum healed into the run
        assert max(losses_by_step(out / f"replica_{i}")) == 14
