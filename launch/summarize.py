"""Turn MLPerf training logs into scores: ``python -m launch.summarize DIR [DIR ...]``.

Per run (``result_*.txt``, else ``mlperf.log``, else ``*/mlperf.log``; anyone's logs): status,
time to train, samples, throughput and the compliance checker's verdict (cached by file
content). Per directory: the olympic score and its RCP normalisation as ``mlperf_logging``
computes them, official or why not: [docs/mlperf.md](../docs/mlperf.md#summarizing-results).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from common.errors import UserError
from common.files import file_digest, publishing, write_text

TOKEN = ":::MLLOG"
DEFAULT_RULESET = "5.0.0"
DEFAULT_RCP_RULESET = "5.0.0"  # BERT's last round: its RCPs score any set, older ones included
OFFICIAL_RUNS = 10


class SummaryError(UserError):
    """Bad input; the message names the file (and line)."""


@dataclass(frozen=True)
class Event:
    key: str
    value: object
    time_ms: float
    metadata: dict
    lineno: int


@dataclass
class RunResult:
    path: Path
    status: str
    seconds: float  # time to train: run_stop - run_start
    samples: int | None
    compliance: str | None = None  # "pass", "fail: <reasons>", or None when not checked
    seed: int | None = None
    batch_size: int | None = None  # global_batch_size
    division: str | None = None  # submission_division

    @property
    def success(self) -> bool:
        """Converged, and not rejected by the compliance checker (when it ran)."""
        return self.status == "success" and (self.compliance is None or self.compliance == "pass")

    @property
    def minutes(self) -> float:
        return self.seconds / 60.0

    @property
    def throughput(self) -> float | None:
        """Samples per second over the time to train."""
        return None if self.samples is None or self.seconds <= 0 else self.samples / self.seconds


@dataclass
class RCPResult:
    verdict: str | None
    passed: bool = False
    factor: float = 1.0  # >= 1; the score is multiplied by it


@dataclass
class DirectorySummary:
    directory: Path
    runs: list[RunResult]
    score_minutes: float | None  # olympic mean x RCP factor, None when there is none
    official: bool  # the conditions: official_problems, and docs/mlperf.md step 6
    note: str
    throughput: float | None  # mean samples/s of the runs in the score
    rcp: RCPResult  # the RCP check's verdict (in words) and the score's normalisation
    raw_score_minutes: float | None  # the olympic mean before normalisation


def read_events(path: Path) -> list[Event]:
    """All ``:::MLLOG`` events of a log, in file order."""
    events = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = list(f)
    except OSError as e:
        raise SummaryError(f"{path}: cannot read ({e.strerror})") from e
    for lineno, line in enumerate(lines, start=1):
        at = line.rfind(TOKEN)  # the checker also keeps what follows the last token
        if at < 0:
            continue
        try:
            record = json.loads(line[at + len(TOKEN) :])
        except json.JSONDecodeError as e:
            raise SummaryError(f"{path}:{lineno}: cannot parse {TOKEN} line ({e.msg})") from e
        if not isinstance(record, dict) or not isinstance(record.get("key"), str):
            raise SummaryError(f"{path}:{lineno}: {TOKEN} record has no 'key'")
        time_ms = record.get("time_ms")
        if isinstance(time_ms, bool) or not isinstance(time_ms, (int, float)):
            raise SummaryError(f"{path}:{lineno}: {TOKEN} record has no numeric 'time_ms'")
        metadata = record.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise SummaryError(f"{path}:{lineno}: {TOKEN} 'metadata' is not an object")
        events.append(Event(record["key"], record.get("value"), float(time_ms), metadata, lineno))
    return events


def first_value(events: list[Event], key: str):
    return next((e.value for e in events if e.key == key), None)


def summarize_run(path: Path) -> RunResult:
    """Status, time to train and samples of one run's log (no compliance check)."""
    events = read_events(path)
    if not events:
        raise SummaryError(f"{path}: no {TOKEN} lines")
    start_i = next((i for i, e in enumerate(events) if e.key == "run_start"), None)
    if start_i is None:
        raise SummaryError(f"{path}: no run_start event")
    start, during = events[start_i], events[start_i:]
    stop = next((e for e in during if e.key == "run_stop"), None)
    if stop is None:
        raise SummaryError(f"{path}: no run_stop event after run_start (line {start.lineno})")
    status = stop.metadata.get("status")
    if not isinstance(status, str):
        raise SummaryError(f"{path}:{stop.lineno}: run_stop has no metadata.status")

    # train_samples where logged (rcp_checker's --rcp-bert-train-samples: some submitters log epoch_num 1 on
    # every eval), else the last eval's epoch_num.
    trained = [e.value for e in during if e.key == "train_samples" and isinstance(e.value, int)]
    evals = [e.metadata.get("epoch_num") for e in during if e.key == "eval_accuracy"]
    samples = (trained or [n for n in evals if isinstance(n, int)] or [None])[-1]
    seed, batch = first_value(events, "seed"), first_value(events, "global_batch_size")
    return RunResult(
        path,
        status,
        (stop.time_ms - start.time_ms) / 1000.0,
        samples,
        seed=seed if isinstance(seed, int) else None,
        batch_size=batch if isinstance(batch, int) else None,
        division=first_value(events, "submission_division"),
    )


def _natural_key(path: Path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def find_logs(directory: Path) -> list[Path]:
    """The run logs of a results directory (or the file itself)."""
    if directory.is_file():
        return [directory]
    if not directory.is_dir():
        raise SummaryError(f"{directory}: no such directory")
    if results := sorted(directory.glob("result_*.txt"), key=_natural_key):
        return results
    if (directory / "mlperf.log").is_file():
        return [directory / "mlperf.log"]
    if nested := sorted(directory.glob("*/mlperf.log"), key=lambda p: _natural_key(p.parent)):
        return nested
    raise SummaryError(f"{directory}: no result_*.txt, mlperf.log or */mlperf.log")


def olympic_score(runs: list[RunResult]) -> tuple[float | None, bool, str, list[RunResult]]:
    """(olympic mean in minutes or None, official?, note, runs in the mean)."""
    n = len(runs)
    if n < 3:
        return None, False, f"{n} run(s): an olympic mean needs at least 3 ({OFFICIAL_RUNS} for an official score)", []
    kept = sorted(runs, key=lambda r: r.minutes if r.success else math.inf)[1:-1]
    failed = sum(not r.success for r in runs)
    if not kept[-1].success:
        return None, False, f"{failed} of {n} runs did not succeed: no score (at most 1 may fail)", []
    score = sum(r.minutes for r in kept) / len(kept)
    what = f"mean of {len(kept)} runs after dropping the fastest and the slowest of {n}"
    if failed:
        what += f"; {failed} run did not succeed and counts as the slowest"
    if n != OFFICIAL_RUNS:
        return (score, False, f"{what}; not an official score: MLPerf BERT needs {OFFICIAL_RUNS} runs", kept)
    return score, True, what, kept


def rcp_check(runs: list[RunResult], ruleset: str) -> RCPResult:
    """The RCP checker's verdict and normalisation factor for a set of runs (as
    ``rcp_checker.check_directory`` decides them, on these runs' logs)."""
    try:
        from mlperf_logging.rcp_checker import rcp_checker as rc
    except ImportError:
        return RCPResult("RCP check not run: mlperf-logging is not installed")
    sizes = {r.batch_size for r in runs}
    if len(sizes) != 1 or None in sizes:
        shared = ", ".join(str(b) for b in sorted(sizes, key=str))
        return RCPResult(f"RCP check failed: the runs do not share one global_batch_size ({shared})")
    (bs,) = sizes
    # A run that did not converge, or that the compliance checker rejects, counts as 1e9 samples.
    samples = [float(r.samples) if r.success and r.samples is not None else 1e9 for r in runs]
    if sum(x == 1e9 for x in samples) > 1:
        return RCPResult("RCP check failed: insufficient convergence (more than one run failed)")
    try:
        checker = rc.RCP_Checker("training", ruleset, "bert", False)
    except Exception as e:  # noqa: BLE001 - the checker raises a bare Exception for rulesets without RCPs
        return RCPResult(f"RCP check not run: {e}")
    record = checker._find_rcp(bs, "pruned_rcps")
    how = "found"
    if record is None:
        low, high = checker._find_top_min_rcp(bs, "pruned_rcps"), checker._find_bottom_max_rcp(bs, "pruned_rcps")
        if low is not None and high is not None:
            _, record = checker._create_interp_rcp(bs, low, high)
            how = f"interpolated between batch sizes {low['BS']} and {high['BS']}"
        elif low is None and high is not None:
            record = checker._find_min_rcp("pruned_rcps")
            how = f"the smallest batch size's ({record['BS']})"
        else:
            return RCPResult(f"RCP missing for global batch size {bs} (ruleset {ruleset})")
    passed, factor = checker._eval_submission_record(record, samples, "")
    mean = float(np.mean(sorted(samples)[1:-1]))
    where = f"RCP {how}: mean {record['RCP Mean']:,.0f} samples, runs' mean {mean:,.0f}"
    if not passed:
        allowed = record["RCP Mean"] / record["Max Speedup"]
        return RCPResult(f"RCP check failed ({where}: faster than the allowed {allowed:,.0f})")
    if factor > 1.0:
        return RCPResult(f"{where}: score scaled by {factor:.4f}", True, float(factor))
    return RCPResult(where, True)


def official_problems(runs: list[RunResult]) -> list[str]:
    """Why a set of runs cannot be an official score (empty: it can)."""
    problems = []
    if len(runs) != OFFICIAL_RUNS:
        problems.append(f"MLPerf BERT needs {OFFICIAL_RUNS} runs")
    if any(r.compliance is None for r in runs):
        problems.append("the compliance checker was not run")
    elif sum(r.compliance != "pass" for r in runs) > 1:
        problems.append(f"{sum(r.compliance != 'pass' for r in runs)} runs fail the compliance check (at most 1)")
    if any(r.division != "closed" for r in runs):
        problems.append("not every run is in the closed division")
    seeds = [r.seed for r in runs]
    if None in seeds or len(set(seeds)) != len(seeds):
        problems.append("the seeds are not unique")
    if len({r.batch_size for r in runs}) != 1:
        problems.append("the runs do not share one global batch size")
    return problems


def _checker_reasons(log_text: str) -> str:
    """The checker's complaints, from its log output, as one line."""
    lines = (line.strip() for line in log_text.splitlines())
    skip = ("INFO", "ERROR - FAILED", "---", "**")
    reasons = [re.sub(r"^(WARNING|ERROR) -\s*", "", line) for line in lines if line and not line.startswith(skip)]
    return "; ".join(reasons) or "failed (no reason given)"


def run_compliance_checker(path: Path, ruleset: str) -> str:
    """'pass' or 'fail: <reasons>' from the official checker, run as a subprocess."""
    with tempfile.TemporaryDirectory(prefix="mlperf-check-") as tmp:
        out = Path(tmp) / "checker.log"
        cmd = [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training", "--ruleset", ruleset]
        cmd += ["--log_output", str(out), str(path.resolve())]  # the log last: main names it on a timeout
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=600)  # it writes into its cwd
        if proc.returncode == 0:
            return "pass"
        text = out.read_text(errors="replace") if out.exists() else ""
        if proc.returncode != 1 or not text:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise SummaryError(f"{path}: the compliance checker crashed (exit {proc.returncode}): {last}")
        return "fail: " + _checker_reasons(text)


def default_cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "unpadded-bert" / "compliance.json"


def check_runs(runs: list[RunResult], ruleset: str, cache_file: Path | None, workers: int) -> None:
    """Fill in each run's compliance verdict, from ``cache_file`` (verdicts by ruleset, checker version
    and file content, in JSON; None: no cache) or by running the checker."""
    cache: dict[str, str] = {}
    if cache_file is not None and cache_file.is_file():
        with contextlib.suppress(OSError, json.JSONDecodeError):  # a damaged cache is only a cache: start over
            cache = json.loads(cache_file.read_text())
    try:
        checker = version("mlperf-logging")
    except PackageNotFoundError:
        raise SummaryError(
            "mlperf-logging is not installed: install it (requirements.txt) or pass --no-check"
        ) from None
    keys = [f"{ruleset}/{checker}/{file_digest(r.path, 'sha256')}" for r in runs]
    todo = [(r, k) for r, k in zip(runs, keys) if k not in cache]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        verdicts = list(pool.map(lambda rk: run_compliance_checker(rk[0].path, ruleset), todo))
    cache.update((k, verdict) for (_, k), verdict in zip(todo, verdicts))
    for r, k in zip(runs, keys):
        r.compliance = cache[k]
    if todo and cache_file is not None:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            write_text(cache_file, json.dumps(cache, indent=0, sort_keys=True))
        except OSError as e:
            print(f"note: compliance cache not saved to {cache_file} ({e.strerror})", file=sys.stderr)


def summarize_directory(directory: Path, runs: list[RunResult], rcp_ruleset: str) -> DirectorySummary:
    """The score of a directory's runs, their compliance verdicts filled in (or not checked)."""
    raw, complete, note, kept = olympic_score(runs)
    rates = [r.throughput for r in kept]
    throughput = sum(rates) / len(rates) if rates and None not in rates else None
    rcp = rcp_check(runs, rcp_ruleset) if len(runs) >= 3 else RCPResult(None, True)  # no RCP check
    problems = official_problems(runs)
    if not rcp.passed:
        problems.append(rcp.verdict)
    if complete and problems:
        note += "; not an official score: " + "; ".join(problems)
    score = raw * rcp.factor if raw is not None else None
    return DirectorySummary(directory, runs, score, complete and not problems, note, throughput, rcp, raw)


def format_table(summaries: list[DirectorySummary], ruleset: str) -> str:
    header = f"  {'run':<16} {'status':<9} {'minutes':>8} {'samples':>11} {'samples/s':>10}  compliance ({ruleset})"
    out = []
    for s in summaries:
        out += [f"{s.directory}", header]
        for r in s.runs:
            samples = f"{r.samples:,}" if r.samples is not None else "-"
            tput = f"{r.throughput:.1f}" if r.throughput is not None else "-"
            verdict = r.compliance if r.compliance is not None else "not checked"
            if len(verdict) > 90:
                verdict = verdict[:87] + "..."
            name = r.path.name if r.path.name != "mlperf.log" else f"{r.path.parent.name}/mlperf.log"
            out.append(f"  {name:<16} {r.status:<9} {r.minutes:>8.2f} {samples:>11} {tput:>10}  {verdict}")
        score = f"{s.score_minutes:.2f} min" if s.score_minutes is not None else "none"
        out.append(f"  olympic score: {score} ({s.note})")
        if s.rcp.verdict:
            out.append(f"  {s.rcp.verdict}")
        if s.throughput is not None:
            out.append(f"  throughput of the scored runs: {s.throughput:.1f} samples/s")
        out.append("")
    if len(summaries) > 1:
        width = max(len(s.directory.name) for s in summaries)
        out.append("olympic time to train")
        for s in summaries:
            score = f"{s.score_minutes:8.2f} min" if s.score_minutes is not None else "    none"
            flag = "" if s.official else "  (not official)"
            out.append(f"  {s.directory.name:<{width}}  {score}{flag}")
    return "\n".join(out).rstrip() + "\n"


def _finite(x: float | None) -> float | None:
    return None if x is None or math.isinf(x) else x


def to_json(summaries: list[DirectorySummary], ruleset: str | None) -> dict:
    return {
        "ruleset": ruleset,
        "directories": [
            {
                "directory": str(s.directory),
                "olympic_score_minutes": _finite(s.score_minutes),
                "raw_olympic_score_minutes": _finite(s.raw_score_minutes),
                "rcp": s.rcp.verdict,
                "rcp_factor": s.rcp.factor,
                "official": s.official,
                "note": s.note,
                "throughput_samples_per_s": s.throughput,
                "runs": [
                    {
                        "file": str(r.path),
                        "status": r.status,
                        "time_to_train_s": r.seconds,
                        "time_to_train_min": r.minutes,
                        "samples": r.samples,
                        "samples_per_s": r.throughput,
                        "seed": r.seed,
                        "global_batch_size": r.batch_size,
                        "compliance": r.compliance,
                    }
                    for r in s.runs
                ],
            }
            for s in summaries
        ],
    }


def write_png(path: Path, summaries: list[DirectorySummary]) -> None:
    """Bar chart of olympic scores, with every successful run as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(summaries) + 2), 4))
    scores = [s.score_minutes or 0.0 for s in summaries]
    bars = ax.bar(range(len(summaries)), scores, width=0.6, color="#4c72b0", alpha=0.8, label="olympic score")
    labels = []
    for i, s in enumerate(summaries):
        times = [r.minutes for r in s.runs if r.success]
        label = "successful runs" if i == 0 else None
        ax.scatter([i + 0.38] * len(times), times, color="black", s=10, zorder=3, label=label)
        labels.append("no score" if s.score_minutes is None else f"{s.score_minutes:.2f}" + ("" if s.official else "*"))
    ax.bar_label(bars, labels, padding=3)
    ax.set_xticks(range(len(summaries)), [s.directory.name for s in summaries], rotation=15, ha="right")
    ax.set_ylabel("time to train (minutes)")
    flag = " (* not official)" if any(not s.official for s in summaries) else ""
    ax.set_title("MLPerf BERT olympic time to train" + flag)
    ax.legend(loc="best")
    fig.tight_layout()
    with publishing(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.summarize",
        description="Scores of MLPerf BERT runs: time to train, samples, throughput, "
        "compliance, and the olympic score per directory.",
    )
    parser.add_argument(
        "dirs", nargs="+", type=Path, metavar="DIR", help="directory of result_*.txt or mlperf.log (or one log file)"
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the summary as JSON")
    parser.add_argument("--png", type=Path, metavar="FILE", help="also draw a bar chart")
    parser.add_argument(
        "--no-check", action="store_true", help="skip the compliance checker (it takes about a second per log)"
    )
    parser.add_argument("--ruleset", default=DEFAULT_RULESET, help="compliance checker ruleset (default %(default)s)")
    parser.add_argument(
        "--rcp-ruleset",
        default=DEFAULT_RCP_RULESET,
        help="ruleset whose reference convergence points normalise the scores (default "
        "%(default)s, BERT's last; older sets are checked with their own --ruleset)",
    )
    parser.add_argument("--cache", type=Path, metavar="FILE", help=f"verdict cache (default {default_cache_file()})")
    parser.add_argument("--no-cache", action="store_true", help="always run the checker")
    parser.add_argument(
        "--jobs", type=int, default=min(4, os.cpu_count() or 1), help="checker processes at once (default %(default)s)"
    )
    args = parser.parse_args(argv)

    try:
        runs = [[summarize_run(p) for p in find_logs(d)] for d in args.dirs]
        if not args.no_check:
            cache_file = None if args.no_cache else (args.cache or default_cache_file())
            check_runs([r for rs in runs for r in rs], args.ruleset, cache_file, args.jobs)
        summaries = [summarize_directory(d, rs, args.rcp_ruleset) for d, rs in zip(args.dirs, runs)]
        ruleset = None if args.no_check else args.ruleset
        print(format_table(summaries, ruleset or "not checked"), end="")
        if args.json:
            write_text(args.json, json.dumps(to_json(summaries, ruleset), indent=2) + "\n")
            print(f"wrote {args.json}")
        if args.png:
            write_png(args.png, summaries)
            print(f"wrote {args.png}")
    except SummaryError as e:
        print(f"summarize: {e}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired as e:
        print(f"summarize: the compliance checker timed out on {e.cmd[-1]}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"summarize: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
