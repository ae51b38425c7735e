"""Checkpoint save and load of two revisions, side by side: the trainer's path on the demo model.

    python bench/checkpoint_io.py [--base 1ef8b53] [--pairs 30] [--preset tiny] [--vocab 8000]

The base revision (default: the last one with two checkpoint formats, whose one-rank runs
wrote the same single file) is checked out into a temporary git worktree (``--base-tree``
takes an existing checkout instead). One worker process per tree (this script's ``--worker``,
``PYTHONPATH`` set to its tree) builds the model and LAMB state once; then the two are asked
in turn, alternating which goes first, to time one save (``to_checkpoint`` +
``train_checkpoint.save``) and one load (``train_checkpoint.read`` + ``restore``), as the
trainer runs them. A pair's ratio (new / base) is taken within a second, so the machine's
drift cancels out of it; prints the median ratio of ``--pairs`` pairs (issue 33's goal: <= 1.05).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.compare_revisions import CompareError, base_tree

REPO = Path(__file__).resolve().parents[1]


def worker(args) -> None:
    """Serve ``save N`` / ``load N`` lines on stdin with the ``bert`` on ``PYTHONPATH``: each
    answered by the seconds it took."""
    import torch

    try:  # this layout, or the flat bert/ before issue 43 (the base revision's)
        from bert.checkpoint import training as tc
        from bert.model.config import BertConfig
        from bert.model.pretraining import BertForPreTraining
        from bert.optim.optimizers import Lamb, param_groups_for
        from bert.state import TrainState

        home = tc
    except ImportError:
        from bert import train_checkpoint as tc
        from bert import train_state
        from bert.config import BertConfig
        from bert.model import BertForPreTraining
        from bert.optim import Lamb, param_groups_for

        TrainState = train_state.TrainState
        home = tc if hasattr(tc, "restore") else train_state  # where to_checkpoint and restore lived

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset(args.preset, vocab_size=args.vocab))
    optimizer = Lamb(param_groups_for(model, 0.01), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 10)
    parts = {"model": model, "optimizer": optimizer, "schedule": schedule, "adagc": None, "scaler": None}
    with tempfile.TemporaryDirectory() as directory:
        print("ready", flush=True)
        for line in sys.stdin:
            what, step = line.split()
            step = int(step)
            start = time.perf_counter()
            if what == "save":
                state = home.to_checkpoint(TrainState(step=step), parts, {"step": step}, {"run": "bench"})
                tc.save(directory, step, state, keep=2)
            else:
                home.restore(tc.read(tc.checkpoint_path(directory, step)), parts)
            print(time.perf_counter() - start, flush=True)


class Worker:
    """A ``--worker`` process of ``tree``."""

    def __init__(self, tree: Path, args):
        cmd = [sys.executable, __file__, "--worker", "--preset", args.preset, "--vocab", str(args.vocab)]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.tree = tree
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answer()

    def _answer(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"error: {self.tree}: the worker exited {self.proc.wait()}")
        return line

    def time(self, what: str, step: int) -> float:
        self.proc.stdin.write(f"{what} {step}\n")
        self.proc.stdin.flush()
        return float(self._answer())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def compare(new: Path, base: Path, args) -> None:
    workers = {"new": Worker(new, args), "base": Worker(base, args)}
    ratios: dict[str, list[float]] = {"save": [], "load": []}
    seconds = {label: {"save": [], "load": []} for label in workers}
    try:
        for i in range(1, args.pairs + 2):
            order = ["new", "base"] if i % 2 else ["base", "new"]
            for what in ("save", "load"):
                got = {label: workers[label].time(what, i) for label in order}
                if i == 1:
                    continue  # the first of each is a warm-up
                ratios[what].append(got["new"] / got["base"])
                for label, t in got.items():
                    seconds[label][what].append(t)
    finally:
        for w in workers.values():
            w.close()
    print(f"{args.preset} (vocab {args.vocab}), {args.pairs} pairs, medians (new / base; goal <= 1.05):")
    for what, r in ratios.items():
        new_ms, base_ms = (statistics.median(seconds[k][what]) * 1e3 for k in ("new", "base"))
        print(f"  {what}: {new_ms:7.1f} ms vs {base_ms:7.1f} ms  ratio {statistics.median(r):.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="1ef8b53", help="the revision to compare against (git rev)")
    parser.add_argument("--base-tree", help="an existing checkout to compare against (instead of --base)")
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    try:
        with base_tree(args.base, args.base_tree) as tree:
            compare(REPO, tree, args)
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
