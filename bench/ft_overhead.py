"""Per-step fault tolerance's cost: dist.fault_tolerance=torchft against plain data parallelism, side by side.

    .venv/bin/python bench/ft_overhead.py --ranks 2 --steps 60 --rounds 3 --out results/ft-overhead

Each round runs the CPU demo config (launch/configs/cpu_demo.yaml, BERT tiny at 128 tokens, global
batch 32) on synthetic data twice, in alternating order: RANKS ranks of one DDP job (gloo), and RANKS
torchft replicas with a Lighthouse. It prints each run's sequences/s after its first step
(metrics.jsonl's windows: time in the steps; a replica's steps include its quorum) and the median ratio plain / torchft
(goal: at most 1.05). Numbers and the estimate at 512 GPUs: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.soak import write_data

REPO = Path(__file__).resolve().parents[1]
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overrides(args, train: str, eval_file: str) -> list[str]:
    return [
        "--config",
        str(REPO / "launch" / "configs" / "cpu_demo.yaml"),
        f"data.train_dir={train}",
        f"data.eval_file={eval_file}",
        "model.overrides.vocab_size=1000",
        f"train.max_steps={args.steps}",
        "eval.interval_samples=100000000",
        "eval.max_samples=64",
        "checkpoint.interval_steps=0",
        "checkpoint.at_end=false",
        "log.plot=false",
        "log.mlperf=false",
        *args.overrides,
    ]


def base_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    return env | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def run(mode: str, args, run_dir: Path, common: list[str]) -> float:
    """One run; its steady sequences/s (replica 0's for torchft)."""
    cmd = [sys.executable, str(REPO / "run_pretraining.py"), "--output-dir", str(run_dir), *common]
    procs, extra = [], []
    port = free_port()
    if mode == "torchft":
        lighthouse = subprocess.Popen(
            [str(LIGHTHOUSE), "--min_replicas", str(args.ranks), "--bind", f"[::]:{port}"]
            + ["--join_timeout_ms", "60000", "--quorum_tick_ms", str(args.quorum_tick_ms)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        extra.append(lighthouse)
        time.sleep(0.5)
    for r in range(args.ranks):
        if mode == "torchft":
            env = base_env() | {"REPLICA_GROUP_ID": str(r), "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
            argv = [*cmd, "dist.fault_tolerance=torchft"]
        else:
            env = base_env() | {"RANK": str(r), "WORLD_SIZE": str(args.ranks), "LOCAL_RANK": str(r)}
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            argv = cmd
        log = open(run_dir.parent / f"{run_dir.name}.rank{r}.log", "w")
        procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    codes = [p.wait() for p in procs]
    for p in extra:
        p.kill()
        p.wait()
    if any(codes):
        raise SystemExit(
            f"error: {mode} run {run_dir} failed (exit {codes}); see {run_dir.parent}/{run_dir.name}.rank*.log"
        )
    where = run_dir / "replica_0" if mode == "torchft" else run_dir
    summary = json.loads((where / "summary.json").read_text())
    if mode == "torchft":
        each = summary["quorum_seconds"] / max(summary["quorums"], 1) * 1e3
        print(f"  torchft: {summary['quorums']} quorums, {each:.1f} ms each (host time inside the steps)", flush=True)
    # Steady state: the windows after step 1, whose record also holds the first quorum's wait for the
    # replicas still starting (plain DDP waits for them in its setup, before the clock).
    with open(where / "metrics.jsonl") as f:
        windows = [r for r in map(json.loads, f) if "loss" in r and r["step"] > 1]
    steps = [b["step"] - a["step"] for a, b in zip([{"step": 1}, *windows], windows)]
    return sum(steps) / sum(n / r["seq_per_s"] for n, r in zip(steps, windows))  # samples / seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks (DDP) = replicas (torchft)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="results/ft-overhead")
    p.add_argument(
        "--quorum-tick-ms", type=int, default=100, help="the Lighthouse's --quorum_tick_ms (its default 100)"
    )
    p.add_argument("overrides", nargs="*", metavar="section.field=value")
    args = p.parse_args(argv)
    if not LIGHTHOUSE.exists():
        print(f"error: {LIGHTHOUSE} not found: install torchft (pip install -e '.[ft]')", file=sys.stderr)
        return 2
    out = Path(args.out)
    train, eval_file = write_data(out / "data", 4 * args.ranks, 256, 128, 1000, 0)
    common = overrides(args, train, eval_file)
    rates: dict[str, list[float]] = {"ddp": [], "torchft": []}
    for k in range(args.rounds):
        order = ("ddp", "torchft") if k % 2 == 0 else ("torchft", "ddp")
        for mode in order:
            rates[mode].append(run(mode, args, out / f"{mode}-{k}", common))
        print(f"round {k}: ddp {rates['ddp'][-1]:.1f} seq/s  torchft {rates['torchft'][-1]:.1f} seq/s", flush=True)
    ratios = [d / f for d, f in zip(rates["ddp"], rates["torchft"])]
    print(
        f"median: ddp {statistics.median(rates['ddp']):.1f} seq/s, torchft {statistics.median(rates['torchft']):.1f} "
        f"seq/s; plain/torchft time ratio {statistics.median(ratios):.3f} (per round: "
        + ", ".join(f"{r:.3f}" for r in ratios)
        + ")"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
