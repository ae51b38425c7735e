"""``bench/throughput.py`` of two revisions of this repository, side by side in one run.

    python bench/compare_revisions.py --base HEAD~1 --data results/demo-data --pairs 5 -- \
        --model small --batch-size 16 --variants unpadded/reference

A change that must not slow training down (a refactor, a new switch that is off by default)
is measured here: the base revision is checked out into a temporary git worktree, and the
two trees' ``bench/throughput.py`` run one after the other, alternating which goes first,
``--pairs`` times, each in a fresh process with the same arguments (everything after
``--``) and ``PYTHONPATH`` set to its own tree. Each variant's ratio is
new seq/s / base seq/s, as the median over the pairs of the ratio within a pair: a pair runs
within a minute, so the machine's drift over the whole run cancels out of it.

``--interleave ROUNDS`` times single rounds back to back, for a machine whose speed drifts
within a minute (a shared VM): a pair is then one long-lived process per tree, each building its
tree's variants once, started one after the other (in alternating order, pair by pair), which
take turns ``ROUNDS`` times, one ``--batches`` round at a time while the other waits idle (the
order alternates round by round), after their ``--warmup-rounds``. A round's ratio is base
seconds / new seconds of two rounds run back to back; a pair's is the median of its rounds'.
A process keeps a speed of its own on such a machine (a tree against itself: pairs 0.86 to
1.22, docs/throughput.md), so many short pairs beat one long one. ``--rounds`` is not used in
that mode.

``--new`` is the working tree by default (uncommitted changes included); ``--base-tree`` takes
an existing checkout instead of ``--base``. Exit status 2 with one line on a bad argument or a
run that fails (its last output line is shown).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class CompareError(RuntimeError):
    pass


@contextlib.contextmanager
def base_tree(rev: str, existing: str | None = None):
    """The tree to compare against: ``existing`` as it is, or ``rev`` checked out into a
    temporary git worktree for the duration (``CompareError`` when git cannot)."""
    if existing:
        yield Path(existing).resolve()
        return
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        add = subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev], capture_output=True, text=True
        )
        if add.returncode:
            raise CompareError(f"--base {rev}: {add.stderr.strip().splitlines()[-1]}")
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)


def run_tree(tree: Path, args: list[str], out: Path) -> dict[str, float]:
    """One ``bench/throughput.py`` run of ``tree``: variant -> seq/s."""
    cmd = [sys.executable, str(tree / "bench" / "throughput.py"), *args, "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise CompareError(f"{tree}: bench/throughput.py exited {done.returncode}: {last}")
    rows = json.loads(out.read_text())["rows"]
    return {r["variant"]: r["seq_per_s"] for r in rows if "seq_per_s" in r}


def pair_orders(new: Path, base: Path, pairs: int):
    """(i, [(label, tree), ...]) for each pair: new first, then base first, and so on."""
    for i in range(pairs):
        yield i, [("new", new), ("base", base)] if i % 2 == 0 else [("base", base), ("new", new)]


def compare(new: Path, base: Path, pairs: int, args: list[str], log=print) -> dict:
    ratios: dict[str, list[float]] = {}
    rates: dict[str, dict[str, list[float]]] = {"new": {}, "base": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i, order in pair_orders(new, base, pairs):
            got = {}
            for label, tree in order:
                got[label] = run_tree(tree, args, Path(tmp) / f"{label}-{i}.json")
                for variant, rate in got[label].items():
                    rates[label].setdefault(variant, []).append(rate)
            for variant in sorted(set(got["new"]) & set(got["base"])):
                ratios.setdefault(variant, []).append(got["new"][variant] / got["base"][variant])
            log(
                f"pair {i + 1}/{pairs} ({order[0][0]} first): "
                + ", ".join(f"{v} {r[-1]:.3f}" for v, r in sorted(ratios.items()))
            )
    return summary(ratios, rates)


def summary(ratios: dict[str, list[float]], rates: dict[str, dict[str, list[float]]]) -> dict:
    if not ratios:
        raise CompareError("the two revisions timed no variant in common")
    return {
        variant: {
            "ratio_median": statistics.median(r),
            "ratios": r,
            "new_seq_per_s_median": statistics.median(rates["new"][variant]),
            "base_seq_per_s_median": statistics.median(rates["base"][variant]),
        }
        for variant, r in ratios.items()
    }


class _Stop(Exception):
    """The coordinator closed the worker's input: no more rounds."""


def worker(argv: list[str], commands=None, replies=None) -> int:
    """One tree's side of ``--interleave``, run as ``compare_revisions.py --worker -- ARGS`` with
    ``PYTHONPATH`` set to that tree: the tree's own ``bench/throughput.py`` builds and checks its
    variants as it always does, then, instead of timing its rounds, waits for a line on
    ``commands`` and answers each with one round's seconds per variant (a JSON line on
    ``replies``); the first reply says it is ready and how many sequences a round trains on.
    The tree's own output goes to stderr."""
    from bench import throughput

    commands = sys.stdin if commands is None else commands
    replies = sys.stdout if replies is None else replies
    sequences = []
    build_variants = throughput.build_variants

    def capture_blocks(names, explicit, config, blocks, *rest):
        sequences.append(sum(len(b) for b in blocks))
        return build_variants(names, explicit, config, blocks, *rest)

    def answer(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    def serve(variants, rounds, warmup_rounds, device, precision, log):
        active = [v for v in variants if not v.skipped]

        def one_round() -> dict[str, float]:
            seconds = {}
            for v in active:
                throughput.sync(device)
                t = time.perf_counter()
                for inp in v.inputs:
                    throughput.train_step(v, inp, device, precision)
                throughput.sync(device)
                seconds[v.name] = time.perf_counter() - t
            return seconds

        for _ in range(warmup_rounds):
            one_round()
        answer({"ready": str(Path(throughput.__file__).resolve().parents[1]), "sequences": sequences[0]})
        while commands.readline():
            answer({"seconds": one_round()})
        raise _Stop

    throughput.build_variants, throughput.measure = capture_blocks, serve
    stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        return throughput.main(argv)
    except _Stop:
        return 0
    finally:
        sys.stdout = stdout


class Worker:
    """A ``worker`` process of one tree, driven one round at a time."""

    def __init__(self, tree: Path, args: list[str], log_dir: Path, label: str):
        self.tree, self.log = tree, log_dir / f"{label}.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--", *args]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
            )
        ready = self._reply()
        if Path(ready["ready"]) != tree:
            self.close()
            raise CompareError(f"{tree}: its worker imported bench/throughput.py from {ready['ready']}")
        self.sequences = ready["sequences"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            lines = self.log.read_text().strip().splitlines() or ["no output"]
            raise CompareError(f"{self.tree}: bench/throughput.py exited {self.proc.returncode}: {lines[-1]}")
        return json.loads(line)

    def round(self) -> dict[str, float]:
        try:
            self.proc.stdin.write("round\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it exited: _reply names why
        return self._reply()["seconds"]

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def interleave(new: Path, base: Path, pairs: int, args: list[str], rounds: int, log=print, start=Worker) -> dict:
    """``--interleave ROUNDS``: ``pairs`` pairs of workers, one per tree, each pair taking turns
    a round at a time ``rounds`` times; a pair's ratio is the median of its rounds' ratios."""
    ratios: dict[str, list[float]] = {}
    rates: dict[str, dict[str, list[float]]] = {"new": {}, "base": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i, order in pair_orders(new, base, pairs):
            workers = {}
            per_round: dict[str, list[float]] = {}
            try:
                for label, tree in order:  # one at a time: their warm-up rounds do not overlap
                    workers[label] = start(tree, args, Path(tmp), label)
                for r in range(rounds):
                    turn = order if r % 2 == 0 else order[::-1]
                    got = {label: workers[label].round() for label, _ in turn}
                    for label, seconds in got.items():
                        for variant, sec in seconds.items():
                            rates[label].setdefault(variant, []).append(workers[label].sequences / sec)
                    for variant in set(got["new"]) & set(got["base"]):
                        per_round.setdefault(variant, []).append(got["base"][variant] / got["new"][variant])
            finally:
                for w in workers.values():
                    w.close()
            for variant, r in per_round.items():
                ratios.setdefault(variant, []).append(statistics.median(r))
            log(
                f"pair {i + 1}/{pairs} ({order[0][0]} first, {rounds} rounds each): "
                + ", ".join(
                    f"{v} {r[-1]:.3f} (rounds {min(per_round[v]):.3f} to {max(per_round[v]):.3f})"
                    for v, r in sorted(ratios.items())
                )
            )
    return summary(ratios, rates)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    if own == ["--worker"]:
        return worker(passthrough)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the revision to compare against (git rev)")
    ap.add_argument("--base-tree", help="an existing checkout to compare against (instead of --base)")
    ap.add_argument("--new", default=str(REPO), help="the tree measured against the base (default: this one)")
    ap.add_argument("--data", required=True, help="passed to bench/throughput.py --data")
    ap.add_argument("--pairs", type=int, default=5, help="alternating pairs of runs (the median ratio is reported)")
    ap.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="each pair: one process per tree, taking turns ROUNDS single rounds (see above)",
    )
    ap.add_argument("--json", help="write the ratios here")
    args = ap.parse_args(own)
    if args.pairs < 1:
        ap.error("--pairs must be >= 1")
    if args.interleave < 0:
        ap.error("--interleave must be >= 1 round (0, the default, times whole runs)")
    bench_args = ["--data", str(Path(args.data).resolve()), *passthrough]
    new = Path(args.new).resolve()
    try:
        with base_tree(args.base, args.base_tree) as tree:
            if args.interleave:
                result = interleave(new, tree, args.pairs, bench_args, args.interleave)
            else:
                result = compare(new, tree, args.pairs, bench_args)
        base_name = args.base_tree or args.base
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = f"pairs of processes, {args.interleave} rounds each" if args.interleave else "pairs"
    print(f"\nnew ({new}) against base ({base_name}), median of {args.pairs} {what}:")
    for variant, r in sorted(result.items()):
        print(
            f"  {variant:<24} {r['new_seq_per_s_median']:8.2f} vs {r['base_seq_per_s_median']:8.2f} seq/s"
            f"  ratio {r['ratio_median']:.3f}  (pairs: {', '.join(f'{x:.3f}' for x in r['ratios'])})"
        )
    if args.json:
        from common.files import write_text

        write_text(Path(args.json), json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
