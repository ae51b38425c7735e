"""Build an MLPerf training submission package for BERT and run MLPerf's own checkers on it.

``python -m launch.package --org ORG --system SYSTEM [--system-desc FILE] --division closed|open
--output OUT INPUTS...``: INPUTS are result logs or directories of them (as ``launch.summarize``
finds them; ``result_N.txt`` in input order). OUT gets MLPerf's tree, published whole; then the
package and RCP checkers run on it (ruleset 5.0.0). Exit status: 0 when both pass, 1 when they report
errors (the package stays), 2 for bad input: docs/mlperf.md, "Reproducing a closed-division result".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import logging.handlers
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from common.errors import UserError
from common.files import publishing_dir
from launch import system_desc
from launch.summarize import SummaryError, find_logs, first_value, read_events

BENCHMARK = "bert"
RULESET = "5.0.0"
USAGE = "training"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_IMPLEMENTATION = "pytorch_unpadded"
# What of this repository goes into the implementation directory when it is not a git checkout.
_SKIP_DIRS = {".git", ".venv", "results", "__pycache__", ".pytest_cache", ".ruff_cache", "node_modules"}


class PackageError(UserError):
    """Bad input; the message names the file or option."""


@dataclass
class Verdict:
    name: str
    passed: bool
    lines: list[str]


def collect_logs(inputs: list[str]) -> list[Path]:
    """The result logs named by INPUTS, in order; each must hold MLPerf lines."""
    logs: list[Path] = []
    try:
        for item in inputs:
            if not Path(item).exists():
                raise PackageError(f"{item}: no such file or directory")
            for log in find_logs(Path(item)):
                events = read_events(log)
                if not events:
                    raise PackageError(f"{log}: no :::MLLOG lines; not an MLPerf result log")
                for key in ("run_start", "run_stop"):
                    if not any(e.key == key for e in events):
                        raise PackageError(f"{log}: no {key} line; an MLPerf result log has one")
                benchmark = first_value(events, "submission_benchmark")
                if benchmark != BENCHMARK:
                    raise PackageError(f"{log}: submission_benchmark is {benchmark!r}, not {BENCHMARK!r}")
                logs.append(log)
    except SummaryError as e:  # find_logs and read_events name the file
        raise PackageError(str(e)) from e
    if not logs:
        raise PackageError("no result logs among the inputs")
    if len(set(map(os.path.realpath, logs))) != len(logs):
        raise PackageError("the same log is given twice among the inputs")
    return logs


def nodes_of(logs: list[Path]) -> str:
    """number_of_nodes from submission_platform (``<nodes>x<system>``), when the logs agree."""
    counts = set()
    for log in logs:
        platform = first_value(read_events(log), "submission_platform")
        match = re.match(r"(\d+)x", platform) if isinstance(platform, str) else None
        counts.add(match.group(1) if match else None)
    return counts.pop() if len(counts) == 1 and None not in counts else "1"


def load_system_desc(path: str, org: str, system: str, division: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            desc = json.load(f)
    except OSError as e:
        raise PackageError(f"{path}: cannot read ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise PackageError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from e
    if not isinstance(desc, dict):
        raise PackageError(f"{path}: expected a JSON object of system-description fields")
    desc.setdefault("submitter", org)
    desc.setdefault("system_name", system)
    desc.setdefault("division", division)
    if desc["division"] != division:
        # The package checker decides from this field whether the closed-division checks run.
        raise PackageError(f"{path}: division is {desc['division']!r}, but --division is {division!r}")
    try:
        system_desc.check(desc)
    except system_desc.SystemDescError as e:
        raise PackageError(f"{path}: {e}") from e
    return desc


def code_files(root: Path) -> list[Path]:
    """The implementation's files, relative to root: git's tracked files in a checkout, else a walk."""
    try:
        proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        proc = None
    if proc is not None and proc.returncode == 0 and proc.stdout:
        files = [Path(p) for p in proc.stdout.decode().split("\0") if p]
        return [p for p in files if (root / p).is_file() and not (root / p).is_symlink()]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        paths = (Path(dirpath) / name for name in filenames)
        files += [p.relative_to(root) for p in paths if not p.is_symlink()]
    return files


def build_tree(
    staging: Path, org: str, system: str, logs: list[Path], desc: dict, code: Path, implementation: str
) -> None:
    """Writes the package under staging/ORG."""
    results = staging / org / "results" / system / BENCHMARK
    results.mkdir(parents=True)
    for i, log in enumerate(logs):
        shutil.copyfile(log, results / f"result_{i}.txt")
    systems = staging / org / "systems"
    systems.mkdir(parents=True)
    system_desc.write(systems / f"{system}.json", desc)
    impl = staging / org / "benchmarks" / BENCHMARK / "implementations" / implementation
    impl.mkdir(parents=True)
    for rel in code_files(code):
        (impl / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(code / rel, impl / rel)
    if not (impl / "README.md").exists():
        raise PackageError(f"--code {code}: no README.md; MLPerf implementations carry one")


@contextlib.contextmanager
def _captured():
    """The INFO and higher records logged inside the block (a list, filled as they come)."""
    root = logging.getLogger()
    handler, level = logging.handlers.BufferingHandler(capacity=1 << 30), root.level  # never flushed
    handler.setLevel(logging.INFO)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield handler.buffer
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _messages(records) -> list[str]:
    """Warnings and errors, each prefixed with the result file the checker was reading."""
    out, current = [], ""
    for r in records:
        text = " ".join(r.getMessage().split())
        if text.startswith("Running compliance on file:"):
            current = os.path.basename(text.split(":", 1)[1].strip()) + ": "
        elif text.startswith(("Running Seed Checker", "Running RCP Checker")):
            current = ""
        if r.levelno >= logging.WARNING and text:
            out.append(f"{r.levelname}: {current}{text}")
    return out


def run_package_checker(package: Path) -> Verdict:
    """mlperf_logging.package_checker's checks on ORG's tree (its CLI always exits 0, so its
    two check functions are called directly and their verdicts combined as its main does)."""
    from mlperf_logging.package_checker import package_checker as pc

    no_bypass = dict.fromkeys(("quiet", "werror", "rcp_bypass", "rcp_bert_train_samples", "seed_checker_bypass"), False)
    cwd = os.getcwd()
    with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="package-check-") as tmp:
        warnings.simplefilter("ignore")
        os.chdir(tmp)  # the compliance checker may write beside itself
        try:
            with _captured() as records:
                systems_ok = pc.check_systems(str(package), USAGE, RULESET)
                results_ok = pc.check_training_result_files(str(package), USAGE, RULESET, **no_bypass)
        finally:
            os.chdir(cwd)
    lines = _messages(records)
    lines += [
        f"INFO: {' '.join(r.getMessage().split())}"
        for r in records
        if r.levelno == logging.INFO and "RCP Test Passed" in r.getMessage()
    ]
    if not systems_ok:
        lines.insert(0, "system description: FAILED")
    return Verdict("package checker", systems_ok and results_ok, lines)


def run_rcp_checker(results: Path, division: str) -> Verdict:
    """The RCP checker on the results directory, as the package checker calls it (pruned RCPs;
    scaling.json written for a closed package that converges faster than the RCP mean). The
    open division needs no RCP: there the verdict is reported but does not fail the package."""
    from mlperf_logging.rcp_checker import rcp_checker

    with _captured() as records:
        passed, message, norm = rcp_checker.check_directory(
            str(results),
            USAGE,
            RULESET,
            verbose=False,
            bert_train_samples=False,
            rcp_pass="pruned_rcps",
            rcp_bypass=False,
            set_scaling=division == "closed",
        )
    lines = [message]
    if message.startswith("Missing RCP"):
        rcps = rcp_checker.RCP_Checker(USAGE, RULESET, BENCHMARK, False).pruned_rcp_data
        known = sorted(r["BS"] for r in rcps.values())
        lines.append(
            f"RCP missing: no reference convergence point covers this batch size in ruleset {RULESET} "
            f"(pruned RCP batch sizes: {', '.join(map(str, known))}); expected for batch sizes "
            "no reference run used"
        )
    elif message == "Insufficient convergence":
        lines.append("more than one run did not converge (run_stop status not success)")
    lines += [m for m in _messages(records) if "infinite" not in m]
    if norm > 1.0 and passed:
        lines.append(f"converges faster than the RCP mean: scores are scaled by {norm:.4f}")
    if division == "open" and not passed:
        lines.append("the open division needs no RCP: reported, not an error")
        passed = True
    return Verdict("RCP checker", passed, lines)


def make_package(args) -> tuple[Path, list[Verdict]]:
    for option, value in (("--org", args.org), ("--system", args.system), ("--implementation", args.implementation)):
        if not value or value in (".", "..") or "/" in value or value != value.strip():
            raise PackageError(f"{option}: {value!r} must be a plain name (it becomes a directory)")
    out = Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PackageError(f"--output {out}: already exists and is not empty; choose a new directory")
    code = Path(args.code) if args.code else REPO
    if not code.is_dir():
        raise PackageError(f"--code {code}: no such directory")
    logs = collect_logs(args.inputs)
    for log in logs:
        division = first_value(read_events(log), "submission_division")
        if division != args.division:
            raise PackageError(f"{log}: submission_division is {division!r}, but --division is {args.division!r}")
    if args.system_desc:
        desc = load_system_desc(args.system_desc, args.org, args.system, args.division)
    else:
        try:
            desc = system_desc.machine_description(
                nodes=int(nodes_of(logs)),
                fields={"submitter": args.org, "division": args.division, "system_name": args.system},
            )
        except system_desc.SystemDescError as e:
            raise PackageError(f"system description: {e}") from e

    with publishing_dir(out) as staging:  # replaces an empty out (checked above)
        build_tree(staging, args.org, args.system, logs, desc, code, args.implementation)
    package = out / args.org
    results = package / "results" / args.system / BENCHMARK
    return package, [run_package_checker(package), run_rcp_checker(results, args.division)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m launch.package",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--org", required=True, help="submitting organisation (the package's top directory)")
    ap.add_argument("--system", required=True, help="system name (results/SYSTEM, systems/SYSTEM.json)")
    ap.add_argument("--system-desc", help="system description JSON; default: made here by launch.system_desc")
    ap.add_argument("--division", required=True, choices=("closed", "open"))
    ap.add_argument("--output", required=True, help="new directory for the package")
    ap.add_argument(
        "--implementation",
        default=DEFAULT_IMPLEMENTATION,
        help=f"benchmarks/bert/implementations/<name> (default {DEFAULT_IMPLEMENTATION})",
    )
    ap.add_argument("--code", help="the implementation's source directory (default: this repository)")
    ap.add_argument("inputs", nargs="+", metavar="INPUT", help="result logs or directories of them")
    args = ap.parse_args(argv)
    try:
        package, verdicts = make_package(args)
    except PackageError as e:
        print(f"package: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"package: {e.filename or args.output}: {e.strerror}", file=sys.stderr)
        return 2
    logs = len(list((package / "results" / args.system / BENCHMARK).glob("result_*.txt")))
    print(f"package: {package} ({logs} result logs, ruleset {RULESET})")
    for v in verdicts:
        print(f"{v.name}: {'PASS' if v.passed else 'FAIL'}")
        for line in v.lines:
            print(f"  {line}")
    return 0 if all(v.passed for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
