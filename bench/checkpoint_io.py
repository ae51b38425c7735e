"""Checkpoint save and load of two revisions, side by side: the trainer's path on the demo model.

    python bench/checkpoint_io.py [--base 1ef8b53] [--rounds 5] [--preset tiny] [--vocab 8000] [--repeats 8]

The base revision (default: the last one with two checkpoint formats, whose one-rank runs
wrote the same single file) is checked out into a temporary git worktree (``--base-tree``
takes an existing checkout instead). Each round runs this script's ``--worker`` once per tree,
alternating which goes first, each in a fresh process with ``PYTHONPATH`` set to its tree; a
worker builds the model and LAMB state, then times ``--repeats`` saves (``to_checkpoint`` +
``train_checkpoint.save``) and loads (``train_checkpoint.read`` + ``restore``), as the trainer
runs them, and reports their medians. Prints each round's ratios (new / base) and their median
(issue 33's goal: <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args) -> dict:
    """Median seconds of a save and of a load with the ``bert`` on ``PYTHONPATH``."""
    import torch

    from bert import train_checkpoint as tc
    from bert import train_state
    from bert.config import BertConfig
    from bert.model import BertForPreTraining
    from bert.optim import Lamb, param_groups_for

    # This revision's trainer path: the functions live in train_checkpoint now, in train_state before.
    home = tc if hasattr(tc, "restore") else train_state
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset(args.preset, vocab_size=args.vocab))
    optimizer = Lamb(param_groups_for(model, 0.01), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 10)
    parts = {"model": model, "optimizer": optimizer, "schedule": schedule, "adagc": None, "scaler": None}
    times: dict[str, list[float]] = {"save": [], "load": []}
    with tempfile.TemporaryDirectory() as directory:
        for i in range(1, args.repeats + 1):
            start = time.perf_counter()
            state = home.to_checkpoint(train_state.TrainState(step=i), parts, {"step": i}, {"run": "bench"})
            path = tc.save(directory, i, state, keep=2)
            times["save"].append(time.perf_counter() - start)
            start = time.perf_counter()
            home.restore(tc.read(path), parts)
            times["load"].append(time.perf_counter() - start)
    return {k: statistics.median(v[1:] if len(v) > 2 else v) for k, v in times.items()}


def run_worker(tree: Path, args, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--json", str(out), "--preset", args.preset]
    cmd += ["--vocab", str(args.vocab), "--repeats", str(args.repeats)]
    done = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise SystemExit(f"error: {tree}: the worker exited {done.returncode}: {last}")
    return json.loads(out.read_text())


def compare(new: Path, base: Path, args) -> None:
    ratios: dict[str, list[float]] = {"save": [], "load": []}
    seconds: dict[str, dict[str, list[float]]] = {"new": {"save": [], "load": []}, "base": {"save": [], "load": []}}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = [("new", new), ("base", base)] if i % 2 == 0 else [("base", base), ("new", new)]
            got = {label: run_worker(tree, args, Path(tmp) / f"{label}-{i}.json") for label, tree in order}
            for what in ratios:
                ratios[what].append(got["new"][what] / got["base"][what])
                for label in got:
                    seconds[label][what].append(got[label][what])
            print(
                f"round {i + 1}/{args.rounds} ({order[0][0]} first): "
                + ", ".join(
                    f"{w} {got['new'][w] * 1e3:.1f} vs {got['base'][w] * 1e3:.1f} ms ({ratios[w][-1]:.3f})"
                    for w in ratios
                )
            )
    print(f"{args.preset} (vocab {args.vocab}), median of {args.rounds} rounds (new / base; goal <= 1.05):")
    for what, r in ratios.items():
        new_ms, base_ms = (statistics.median(seconds[k][what]) * 1e3 for k in ("new", "base"))
        print(f"  {what}: {new_ms:7.1f} ms vs {base_ms:7.1f} ms  ratio {statistics.median(r):.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="1ef8b53", help="the revision to compare against (git rev)")
    parser.add_argument("--base-tree", help="an existing checkout to compare against (instead of --base)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        Path(args.json).write_text(json.dumps(worker(args)))
        return 0
    if args.base_tree:
        compare(REPO, Path(args.base_tree).resolve(), args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        add = subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.base],
            capture_output=True,
            text=True,
        )
        if add.returncode:
            print(f"error: --base {args.base}: {add.stderr.strip().splitlines()[-1]}", file=sys.stderr)
            return 2
        try:
            compare(REPO, tree, args)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
