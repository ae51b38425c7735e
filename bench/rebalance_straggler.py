"""A real 2-rank CPU run with a straggler: steady-state step time, ``measured`` vs ``balanced``.

Trains BERT tiny on synthetic shards (lengths uniform in [5, --seq-len]), or with ``--data DIR`` on
shards ``python -m data.prepare`` wrote to DIR (``make demo``'s demo corpus: DIR/train,
DIR/eval/part_eval_10k.hdf5, DIR/vocab.txt), under ``launch/run_torchrun.sh`` (2 gloo ranks), rank r
pinned to core r (``taskset``) and capped at ``--quota`` of a CPU by a cgroup the bench
creates for it (v1 cpu controller, cfs quota; removed after the run), as soon as the ranks
start. The straggler: rank 1's cap is ``--quota / --slow`` (default 2x slower). A cap below
what a rank gets anyway makes the ratio hold on a busy shared machine too. Each of the four
runs (balanced / measured, equal ranks / straggler) trains ``--steps`` steps;
the steady-state step time is the median over the last ``--measure`` steps of the global
batch over the logged sequences per second (with ``--repeats`` N, N interleaved runs of each
and the median of theirs). Printed side by side: measured / balanced step
time and the fitted speeds (metrics.jsonl, ``rebalance.speed_min`` / ``speed_max``).

    python -m bench.rebalance_straggler [--data DIR] [--steps 40] [--measure 20] [--quota 0.4] [--slow 2] [--json FILE]

Needs root (the cgroups) and 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common.files import write_text

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "launch" / "configs" / "cpu_demo.yaml"
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")


def prepared_data(directory: Path) -> list[str]:
    """The overrides that train on ``data.prepare``'s output in ``directory``; a one-line error if it is not one."""
    paths = (directory / "train", directory / "eval" / "part_eval_10k.hdf5", directory / "vocab.txt")
    for path in paths:
        if not path.exists():
            raise SystemExit(
                f"rebalance_straggler: --data {directory}: {path} is missing (python -m data.prepare writes it)"
            )
    return [f"data.train_dir={paths[0]}", f"data.eval_file={paths[1]}", f"data.vocab_file={paths[2]}"]


def write_data(directory: Path, seq_len: int) -> list[str]:
    """Synthetic shards (lengths uniform in [5, seq_len]) and an eval file; the overrides that train on them."""
    from data.synthetic import write_shards

    train, evaldir = directory / "train", directory / "eval"
    train.mkdir(parents=True)
    evaldir.mkdir(parents=True)
    write_shards(train, [2048] * 4, 0, max_seq_length=seq_len, max_predictions=20, vocab_size=1000)
    from common.files import publish

    (path,) = write_shards(evaldir, [64], 1, max_seq_length=seq_len, max_predictions=20, vocab_size=1000)
    eval_file = evaldir / "part_eval_10k.hdf5"
    publish(path, eval_file)
    return [f"data.train_dir={train}", f"data.eval_file={eval_file}", "model.overrides.vocab_size=1000"]


def _rank_pids(marker: str) -> dict[int, int]:
    """{rank: pid} of the training processes whose environment holds ``marker`` (RANK, LOCAL_RANK)."""
    found = {}
    for d in Path("/proc").iterdir():
        try:
            env = set((d / "environ").read_bytes().split(b"\0")) if d.name.isdigit() else set()
        except OSError:
            continue
        rank = [e[5:] for e in env if e.startswith(b"RANK=")]
        if marker.encode() in env and rank and b"LOCAL_RANK=" + rank[0] in env:
            found.setdefault(int(rank[0]), int(d.name))
    return found


def _cpu_group(name: str, cpus: float) -> Path:
    """A new cgroup (v1 cpu controller) capped at ``cpus`` of one CPU; removed by the caller."""
    group = CPU_CGROUPS / name
    group.mkdir()
    (group / "cpu.cfs_period_us").write_text("100000")
    (group / "cpu.cfs_quota_us").write_text(str(int(cpus * 100000)))
    return group


def run(strategy: str, straggler: bool, args, data: list[str], out: Path) -> dict:
    overrides = [
        *data,
        "model.preset=tiny",
        "model.attention=padded",
        f"data.max_seq_length={args.seq_len}",
        f"data.rebalance={strategy}",
        f"train.global_batch_size={args.global_batch}",
        f"train.max_steps={args.steps}",
        "train.log_interval_steps=1",
        "eval.interval_samples=100000000",
        "eval.max_samples=64",
        "eval.batch_size=64",
        "checkpoint.at_end=false",
        "checkpoint.interval_steps=0",
        "log.plot=false",
    ]
    marker = f"REBALANCE_STRAGGLER_RUN={os.getpid()}-{out.name}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHON": sys.executable}
    env[marker.split("=")[0]] = marker.split("=")[1]
    cmd = [str(REPO / "launch" / "run_torchrun.sh"), "1", "2", str(CONFIG), str(out), *overrides]
    quotas = (args.quota, args.quota / (args.slow if straggler else 1.0))
    log = open(out.parent / f"{out.name}.log", "w")  # before the cgroups: nothing to remove if it fails
    groups = [_cpu_group(f"rebalance-straggler-{os.getpid()}-{r}", q) for r, q in enumerate(quotas)]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        pinned, t0 = {}, time.time()
        while len(pinned) < 2 and proc.poll() is None and time.time() - t0 < 120:
            for rank, pid in _rank_pids(marker).items():
                if rank not in pinned:
                    subprocess.run(["taskset", "-a", "-p", "-c", str(rank), str(pid)], capture_output=True, check=True)
                    (groups[rank] / "cgroup.procs").write_text(str(pid))  # all its threads, and later ones
                    pinned[rank] = pid
            time.sleep(0.2)
        if len(pinned) < 2 and proc.poll() is None:
            proc.kill()
            raise SystemExit(f"rebalance_straggler: found the processes of ranks {sorted(pinned)} only, not 0 and 1")
        rc = proc.wait(timeout=args.timeout)
    finally:
        log.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for g in groups:
            g.rmdir()  # empty once the ranks have exited
    if rc != 0:
        tail = (out.parent / f"{out.name}.log").read_text()[-3000:]
        raise SystemExit(f"rebalance_straggler: the {strategy} run failed (exit {rc}):\n{tail}")
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in recs if "seq_per_s" in r][-args.measure :]
    step_s = [args.global_batch / r["seq_per_s"] for r in steps]
    last = steps[-1].get("rebalance", {})
    return dict(
        strategy=strategy,
        straggler=straggler,
        step_ms=1e3 * float(np.median(step_s)),
        speed_ratio=last.get("speed_min", 1.0) / last.get("speed_max", 1.0),
        imbalance_before=float(np.median([r["rebalance"]["imbalance_before"] for r in steps])),
        imbalance_after=float(np.median([r["rebalance"]["imbalance_after"] for r in steps])),
        # rank 1's tokens over rank 0's, from rank 0's share of the mean (2 ranks: rank 1 holds 2 - share)
        token_ratio=float(np.median([2 / r["rebalance"]["token_share"] - 1 for r in steps])),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="train on data.prepare's shards in this directory (default: synthetic ones)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--measure", type=int, default=20, help="the last this many steps are the steady state")
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--quota", type=float, default=0.4, help="each rank's CPU cap (a cgroup quota, of one CPU)")
    ap.add_argument("--slow", type=float, default=2.0, help="the straggler: rank 1's cap is --quota / SLOW")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("--only", choices=("equal", "straggler"), help="run only this case")
    ap.add_argument("--keep", help="write the data and the runs here (a new directory), not to a temporary one")
    ap.add_argument("--strategy", choices=("balanced", "measured"), help="run only this strategy")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each, interleaved; the medians are compared")
    ap.add_argument("--json", help="write the records")
    args = ap.parse_args(argv)
    if args.measure < 1 or args.steps <= args.measure or args.repeats < 1:
        ap.error("--measure must be >= 1 and below --steps, --repeats >= 1")
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("rebalance_straggler: needs 2 cores")
    if not os.access(CPU_CGROUPS, os.W_OK):
        raise SystemExit(f"rebalance_straggler: needs a writable cgroup v1 cpu controller at {CPU_CGROUPS} (root)")
    if not 0.01 <= args.quota <= 1 or args.slow < 1:
        ap.error("--quota must be in [0.01, 1] and --slow >= 1")
    cases = [c for c in (False, True) if args.only is None or args.only == ("straggler" if c else "equal")]
    strategies = ("balanced", "measured") if args.strategy is None else (args.strategy,)
    with tempfile.TemporaryDirectory(prefix="straggler-") as tmp:
        tmp = Path(args.keep or tmp)
        if args.keep:
            tmp.mkdir(parents=True)  # a new one: --data writes nothing there before the runs
        data = prepared_data(Path(args.data)) if args.data else write_data(tmp / "data", args.seq_len)
        records = []
        for straggler in cases:
            for i, strategy in [(i, s) for i in range(args.repeats) for s in strategies]:  # interleaved
                r = run(strategy, straggler, args, data, tmp / f"{strategy}-{int(straggler)}-{i}")
                records.append(r)
                print(
                    f"{'straggler' if straggler else 'equal':>9} {strategy:>9}: step {r['step_ms']:7.1f} ms, "
                    f"fitted speed ratio {r['speed_ratio']:.3f}, imbalance_after {r['imbalance_after']:.3f}, "
                    f"rank 1 / rank 0 tokens {r['token_ratio']:.3f}",
                    flush=True,
                )

    def median_ms(straggler, strategy):
        ms = [r["step_ms"] for r in records if (r["straggler"], r["strategy"]) == (straggler, strategy)]
        return float(np.median(ms))

    for straggler in cases if len(strategies) == 2 else ():
        b, m = median_ms(straggler, "balanced"), median_ms(straggler, "measured")
        what = "rank 1 ~2x slower" if straggler else "equal ranks"
        print(f"{what}: balanced {b:.1f} ms / measured {m:.1f} ms per step = {b / m:.3f}x")
    if args.json:
        write_text(args.json, json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
