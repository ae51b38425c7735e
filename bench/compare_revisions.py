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


def compare(new: Path, base: Path, pairs: int, args: list[str], log=print) -> dict:
    ratios: dict[str, list[float]] = {}
    rates: dict[str, dict[str, list[float]]] = {"new": {}, "base": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            order = [("new", new), ("base", base)] if i % 2 == 0 else [("base", base), ("new", new)]
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the revision to compare against (git rev)")
    ap.add_argument("--base-tree", help="an existing checkout to compare against (instead of --base)")
    ap.add_argument("--new", default=str(REPO), help="the tree measured against the base (default: this one)")
    ap.add_argument("--data", required=True, help="passed to bench/throughput.py --data")
    ap.add_argument("--pairs", type=int, default=5, help="alternating pairs of runs (the median ratio is reported)")
    ap.add_argument("--json", help="write the ratios here")
    args = ap.parse_args(own)
    if args.pairs < 1:
        ap.error("--pairs must be >= 1")
    bench_args = ["--data", str(Path(args.data).resolve()), *passthrough]
    new = Path(args.new).resolve()
    try:
        with base_tree(args.base, args.base_tree) as tree:
            result = compare(new, tree, args.pairs, bench_args)
        base_name = args.base_tree or args.base
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"\nnew ({new}) against base ({base_name}), median of {args.pairs} pairs:")
    for variant, r in sorted(result.items()):
        print(
            f"  {variant:<24} {r['new_seq_per_s_median']:8.2f} vs {r['base_seq_per_s_median']:8.2f} seq/s"
            f"  ratio {r['ratio_median']:.3f}  (pairs: {', '.join(f'{x:.3f}' for x in r['ratios'])})"
        )
    if args.json:
        from fileio import write_text

        write_text(Path(args.json), json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
