"""Endurance: a long CPU training run whose ranks are watched for growing memory, file
descriptors and threads.

    python bench/soak.py                                   # 4000 steps, 2 ranks, ~15 min on 2 idle cores
    python bench/soak.py --steps 10000 --max-minutes 60    # as many of 10000 steps as an hour allows
    python bench/soak.py --steps 200 --ranks 1 --interval 50 --out results/soak-short

It writes a synthetic dataset (random samples shaped like prepared data, lengths uniform up
to ``--seq-len``, so the 2-rank cross-rank rebalancing has work to do), then starts
``run_pretraining.py`` once per rank (the variables torchrun would set, gloo on the CPU)
with BERT tiny, an eval and a checkpoint every ``--interval`` steps, and samples every
rank's resident memory (VmRSS), open file descriptors (/proc/PID/fd) and threads every
``--sample-every`` seconds, with the step rank 0 last logged.

After the warm-up (``--warmup-steps``; default the larger of 2 intervals and a fifth of the
run, so that the first evals and checkpoints have allocated what they keep), it compares
the median RSS of the first and the last tenth of the remaining samples:

    growth = (median last tenth - median first tenth) / median first tenth    goal <= 5%

and the file descriptors and threads: the fewest seen in the last tenth may not exceed the
fewest in the first tenth (goal: flat; a leaked one stays open, while the most seen would
also count short-lived threads such as the rebalancer's exchange). ``--max-minutes`` stops the ranks with
SIGTERM (they checkpoint and exit cleanly at the same step) and judges the steps done.
Writes ``OUT/soak.json`` (settings, every sample, the report, the median RSS over each tenth
of the run) and prints the report; exit status 0 when every goal is met, 1 when one is
missed or the run fails, 2 for bad arguments.

This is a benchmark; tests/bench/test_soak.py runs a short version (a few hundred steps).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.files import publish, write_text

REPO = Path(__file__).resolve().parents[1]

RSS_GOAL = 0.05  # growth after warm-up, as a fraction


class SoakError(RuntimeError):
    """A run that failed; the message is the one line the CLI prints."""


class SoakArgumentError(SoakError):
    """Bad arguments (exit status 2)."""


@dataclass
class Sample:
    t: float  # seconds since the ranks started
    step: int  # the last step rank 0 logged
    rank: int
    rss_kb: int
    fds: int
    threads: int


@dataclass
class RankReport:
    rank: int
    samples: int
    rss_start_mb: float  # median of the first tenth after warm-up
    rss_end_mb: float  # median of the last tenth
    rss_max_mb: float  # after warm-up
    rss_growth: float  # fraction
    # (fewest in the first tenth, fewest in the last tenth): a leaked handle or thread stays, so
    # the fewest grows; the most would also count the rebalancer's per-step exchange thread.
    fds: tuple[int, int]
    threads: tuple[int, int]
    fds_max: int  # after warm-up
    threads_max: int
    problems: list[str] = field(default_factory=list)


def read_proc(pid: int) -> tuple[int, int, int] | None:
    """(VmRSS in KiB, open fds, threads) of a live process; None once it has gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return int(status["VmRSS"].split()[0]), fds, int(status["Threads"])
    except (FileNotFoundError, ProcessLookupError, KeyError):
        return None


class StepFollower:
    """The last logged step in rank 0's metrics.jsonl, read incrementally."""

    def __init__(self, path: Path):
        self.path, self.offset, self.step, self.partial = path, 0, 0, b""

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.step
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            if line.strip():
                self.step = max(self.step, int(json.loads(line).get("step", 0)))
        return self.step


def write_data(directory: Path, shards: int, per_shard: int, seq_len: int, vocab: int, seed: int) -> tuple[str, str]:
    """Synthetic training shards and an eval file (data.synthetic); returns their paths."""
    from data.synthetic import write_shards

    train, evaldir = directory / "train", directory / "eval"
    train.mkdir(parents=True, exist_ok=True)
    evaldir.mkdir(parents=True, exist_ok=True)
    write_shards(train, [per_shard] * shards, seed, max_seq_length=seq_len, max_predictions=20, vocab_size=vocab)
    (path,) = write_shards(evaldir, [512], seed + 1, max_seq_length=seq_len, max_predictions=20, vocab_size=vocab)
    eval_file = evaldir / "part_eval_10k.hdf5"
    publish(path, eval_file)
    return str(train), str(eval_file)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_overrides(args, train: str, eval_file: str) -> list[str]:
    return [
        "model.preset=tiny",
        "model.attention=padded",
        f"model.overrides.vocab_size={args.vocab}",
        "data.layout=unpadded",
        f"data.max_seq_length={args.seq_len}",
        f"data.rebalance={args.rebalance}",
        f"data.train_dir={train}",
        f"data.eval_file={eval_file}",
        f"train.global_batch_size={args.global_batch}",
        f"train.max_steps={args.steps}",
        "train.max_samples=1000000000",
        "train.device=cpu",
        f"train.log_interval_steps={args.log_every}",
        f"eval.interval_samples={args.interval * args.global_batch}",
        "eval.max_samples=256",
        "eval.batch_size=64",
        "eval.target_accuracy=0.99",
        f"checkpoint.interval_steps={args.interval}",
        "checkpoint.keep=2",
        "optim.clip=adagc",
        "optim.warmup_steps=10",
        "log.plot=false",
        *args.overrides,
    ]


def start_ranks(args, run_dir: Path, overrides: list[str], logs: Path) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(args.ranks):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_"))}
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(args.ranks),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(args.ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=str(args.threads),
            PYTHONPATH=str(REPO),
            PYTHONUNBUFFERED="1",
        )
        cmd = [sys.executable, str(REPO / "run_pretraining.py"), "--output-dir", str(run_dir), *overrides]
        with open(logs / f"rank{rank}.log", "w", encoding="utf-8") as log:  # the rank keeps its own copy
            procs.append(
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
            )
    return procs


def watch(procs, follower: StepFollower, every: float, stop_after: float) -> tuple[list[Sample], bool]:
    """Sample every rank until all have exited; returns (samples, stopped early). After
    ``stop_after`` seconds the ranks get SIGTERM (the trainer checkpoints and stops at the
    same step on every rank); 300 s later, SIGKILL."""
    samples: list[Sample] = []
    start = time.monotonic()
    stopped = False
    while any(p.poll() is None for p in procs):
        now = time.monotonic() - start
        if now > stop_after and not stopped:
            stopped = True
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGTERM)
        if now > stop_after + 300:
            raise SoakError(f"the ranks did not stop within 300 s of SIGTERM (--max-minutes {stop_after / 60:g})")
        step = follower.poll()
        for rank, p in enumerate(procs):
            got = read_proc(p.pid) if p.poll() is None else None
            if got is not None:
                samples.append(Sample(round(now, 2), step, rank, *got))
        time.sleep(every)
    return samples, stopped


def report(samples: list[Sample], ranks: int, warmup_steps: int, last_step: int) -> list[RankReport]:
    out = []
    for rank in range(ranks):
        # Samples at the last step see the process tearing down (threads and files closing).
        after = [s for s in samples if s.rank == rank and warmup_steps < s.step < last_step]
        if len(after) < 20:
            raise SoakError(
                f"rank {rank}: only {len(after)} samples after the warm-up of {warmup_steps} steps; "
                f"run more steps or sample more often (--sample-every)"
            )
        tenth = max(len(after) // 10, 2)
        first, last = after[:tenth], after[-tenth:]
        rss0 = statistics.median(s.rss_kb for s in first)
        rss1 = statistics.median(s.rss_kb for s in last)
        r = RankReport(
            rank=rank,
            samples=len(after),
            rss_start_mb=rss0 / 1024,
            rss_end_mb=rss1 / 1024,
            rss_max_mb=max(s.rss_kb for s in after) / 1024,
            rss_growth=(rss1 - rss0) / rss0,
            fds=(min(s.fds for s in first), min(s.fds for s in last)),
            threads=(min(s.threads for s in first), min(s.threads for s in last)),
            fds_max=max(s.fds for s in after),
            threads_max=max(s.threads for s in after),
        )
        if r.rss_growth > RSS_GOAL:
            r.problems.append(f"RSS grew {100 * r.rss_growth:.1f}% (goal <= {100 * RSS_GOAL:.0f}%)")
        if r.fds[1] > r.fds[0]:
            r.problems.append(f"open file descriptors grew {r.fds[0]} -> {r.fds[1]}")
        if r.threads[1] > r.threads[0]:
            r.problems.append(f"threads grew {r.threads[0]} -> {r.threads[1]}")
        out.append(r)
    return out


def rss_curve(samples: list[Sample], ranks: int, last_step: int, points: int = 10) -> list[dict]:
    """Median RSS (MB) of each rank over each tenth of the run's steps, warm-up included."""
    rows = []
    for i in range(points):
        lo, hi = i * last_step // points, (i + 1) * last_step // points
        row = {"steps": f"{lo + 1}-{hi}"}
        for rank in range(ranks):
            rss = [s.rss_kb for s in samples if s.rank == rank and lo < s.step <= hi and s.step < last_step]
            row[f"rank{rank}_mb"] = round(statistics.median(rss) / 1024, 1) if rss else None
        rows.append(row)
    return rows


def table(reports: list[RankReport]) -> str:
    rows = [
        (
            "| rank | samples | RSS after warm-up (MB) | RSS at end (MB) | growth | max RSS (MB) "
            "| fds: start -> end (max) | threads: start -> end (max) |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        rows.append(
            f"| {r.rank} | {r.samples} | {r.rss_start_mb:.1f} | {r.rss_end_mb:.1f} | "
            f"{100 * r.rss_growth:+.2f}% | {r.rss_max_mb:.1f} | {r.fds[0]} -> {r.fds[1]} ({r.fds_max}) | "
            f"{r.threads[0]} -> {r.threads[1]} ({r.threads_max}) |"
        )
    return "\n".join(rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=4000, help="training steps (default 4000)")
    p.add_argument("--ranks", type=int, default=2, help="ranks on this machine (default 2)")
    p.add_argument("--interval", type=int, default=400, help="an eval and a checkpoint every this many steps")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="steps left out of the comparison (default: max(2 x --interval, --steps / 5))",
    )
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--shards", type=int, default=4, help="training shards per rank x ranks")
    p.add_argument("--per-shard", type=int, default=512, help="samples per training shard")
    p.add_argument("--rebalance", default="balanced", help="data.rebalance (2 ranks and more)")
    p.add_argument("--log-every", type=int, default=10, help="train.log_interval_steps")
    p.add_argument("--sample-every", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=24 * 60,
        help="stop the ranks (SIGTERM: checkpoint, clean exit) after this long and report the steps done",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    p.add_argument("--out", default="results/soak", help="output directory (replaced)")
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="more run_pretraining.py overrides")
    return p.parse_args(argv)


def soak(args) -> tuple[list[RankReport], dict]:
    for name in ("steps", "ranks", "interval", "global_batch", "seq_len", "shards", "per_shard", "log_every"):
        if getattr(args, name) < 1:
            raise SoakArgumentError(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    if args.global_batch % args.ranks:
        raise SoakArgumentError(f"--global-batch {args.global_batch} is not divisible by --ranks {args.ranks}")
    warmup = args.warmup_steps if args.warmup_steps is not None else max(2 * args.interval, args.steps // 5)
    if warmup >= args.steps:
        raise SoakArgumentError(f"--warmup-steps {warmup} leaves no steps to compare (--steps {args.steps})")
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    train, eval_file = write_data(
        out / "data", args.shards * args.ranks, args.per_shard, args.seq_len, args.vocab, args.seed
    )
    run_dir = out / "run"
    overrides = run_overrides(args, train, eval_file)
    procs = start_ranks(args, run_dir, overrides, out)
    started = time.time()
    try:
        samples, stopped = watch(
            procs, StepFollower(run_dir / "metrics.jsonl"), args.sample_every, args.max_minutes * 60
        )
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    wall = time.time() - started
    codes = [p.returncode for p in procs]
    if any(codes):
        bad = codes.index(next(c for c in codes if c))
        lines = (out / f"rank{bad}.log").read_text(encoding="utf-8", errors="replace").strip().splitlines()
        raise SoakError(
            f"rank {bad} exited with {codes[bad]}: {lines[-1] if lines else 'no output'} (see {out / f'rank{bad}.log'})"
        )
    status = json.loads((run_dir / "summary.json").read_text()) if not stopped else None
    last_step = status["steps"] if status else max(s.step for s in samples)
    if not stopped and last_step != args.steps:
        raise SoakError(f"the run stopped at step {last_step} of {args.steps} (status {status['status']})")
    result = {
        "settings": {**vars(args), "warmup_steps": warmup, "overrides": overrides},
        "wall_seconds": wall,
        "steps_done": last_step,
        "stopped_by_time_limit": stopped,
        "train_summary": status,
        "rss_curve": rss_curve(samples, args.ranks, last_step),
        "reports": None,
        "samples": [vars(s) for s in samples],
    }
    try:
        reports = report(samples, args.ranks, warmup, last_step)
        result["reports"] = [vars(r) for r in reports]
    finally:  # the samples are kept even when there are too few to judge
        write_text(out / "soak.json", json.dumps(result) + "\n")
    return reports, result


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        reports, result = soak(args)
    except SoakError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, SoakArgumentError) else 1
    limit = f" (stopped by --max-minutes {args.max_minutes:g})" if result["stopped_by_time_limit"] else ""
    print(
        f"soak: {result['steps_done']} of {args.steps} steps{limit} on {args.ranks} rank(s) in "
        f"{result['wall_seconds']:.0f} s; warm-up {result['settings']['warmup_steps']} steps, then "
        f"{sum(r.samples for r in reports)} samples"
    )
    print(table(reports))
    print("\nmedian RSS (MB) per tenth of the run, warm-up included:")
    ranks = range(args.ranks)
    print("| steps | " + " | ".join(f"rank {r}" for r in ranks) + " |\n|---|" + "---|" * args.ranks)
    for row in result["rss_curve"]:
        print(f"| {row['steps']} | " + " | ".join(str(row[f"rank{r}_mb"]) for r in ranks) + " |")
    problems = [f"rank {r.rank}: {p}" for r in reports for p in r.problems]
    for p in problems:
        print(f"MISSED: {p}")
    if not problems:
        print(f"all goals met: RSS growth <= {100 * RSS_GOAL:.0f}%, file descriptors and threads flat")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
