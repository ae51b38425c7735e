"""AdaGC and SimReg ablation: training runs on the same data, arms side by side, over seeds.

    python bench/ablation.py                          # CPU demo corpus, prepared on first use
    python bench/ablation.py --seeds 3                # each arm for 3 seeds: mean ± std
    python bench/ablation.py --seeds 3 --jobs 2       # two runs at a time (one CPU thread each)
    python bench/ablation.py --spikes                 # with gradient spikes injected (debug.*)
    python bench/ablation.py --data DIR --steps 400 --out results/abl optim.name=adamw
    python bench/ablation.py --arm "lr2e-3 optim.lr=2e-3" --runs baseline
    python bench/ablation.py --compare results/abl/baseline results/abl/simreg   # finished runs

The arms (each run is ``run_pretraining.py`` called in this process with ``--config`` plus
overrides, or with ``--jobs N`` in one of N worker processes, a fresh one per run; within one
seed every arm shares the data order, initial weights and dropout masks, which the trainer
derives from ``train.seed``; seed k of N is ``--seed`` + k):

    baseline       the config's clipping (the CPU demo's: global norm 1.0, as MLPerf)
    adagc          optim.clip=adagc
    simreg         loss.simreg_weight=W
    adagc+simreg   both
    --arm NAME ... any section.field=value overrides

Every run logs every step (``train.log_interval_steps=1``) so the spike scores of its
``summary.json`` see every loss and gradient norm, and evaluates masked-LM accuracy
``--evals`` times. ``--spikes`` multiplies the gradients of ``--spike-params`` by
``--spike-factor`` at ``--spike-steps`` (the trainer's ``debug.*``; default: every
``--spike-every`` steps after AdaGC's warm-up, so that its per-tensor clipping, not its
warm-up's global clipping, meets them). AdaGC's
warm-up is ``min(100, steps // 5)`` steps unless ``--adagc-warmup-steps`` says otherwise.

Per arm it reports the mean and standard deviation over seeds of: the final training MLM
loss (mean of the last 10% of steps), the final eval accuracy, the samples to reach
``--target-accuracy`` (interpolated between evals; default 0.9 x the baseline's mean final
accuracy) and that against the baseline's, the loss and gradient-norm spike scores, the
loss rise after injected spikes, and sequences/s.

Without ``--data``, the demo corpus is prepared as ``make demo`` does (``python -m
data.prepare.demo_corpus`` then ``python -m data.prepare --train-vocab 8000 --max-seq-length 128
...``) into ``--data-cache`` and reused while its manifest matches.

Writes ``OUT/ablation.json`` (setup, per-arm statistics, every run's summary and curves),
``OUT/ablation.png`` (training MLM loss and eval accuracy against samples: mean over seeds
with a one-std band) and ``OUT/<arm>/seed<S>/`` (each run's own outputs and ``train.log``);
prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bert.config import load_config
from common.errors import ConfigError
from common.files import publishing, write_text

REPO = Path(__file__).resolve().parents[1]

DEFAULT_CONFIG = REPO / "launch" / "configs" / "cpu_demo.yaml"
RUNS = ("baseline", "adagc", "simreg", "adagc+simreg")
# The demo preparation of the Makefile's `demo` target (max_seq_length 128, vocab of 8000).
DEMO_PREPARE = [
    "--input-format",
    "bert",
    "--train-vocab",
    "8000",
    "--max-seq-length",
    "128",
    "--max-predictions",
    "20",
    "--dupe-factor",
    "10",
    "--shards",
    "4",
    "--eval-samples",
    "1000",
    "--workers",
    "2",
]
DEMO_PARAMETERS = {
    "input_format": "bert",
    "train_vocab": 8000,
    "max_seq_length": 128,
    "max_predictions": 20,
    "dupe_factor": 10,
    "eval_samples": 1000,
    "seed": 12345,
}


class AblationError(RuntimeError):
    """Bad input or a failed run; the message is the one line the CLI prints."""


# ---- data -------------------------------------------------------------------------------


def data_paths(data_dir: Path) -> dict[str, str]:
    """The data.* overrides for a prepared directory (train/, eval/part_eval_10k.hdf5, vocab.txt)."""
    train, eval_file, vocab = data_dir / "train", data_dir / "eval" / "part_eval_10k.hdf5", data_dir / "vocab.txt"
    if not train.is_dir() or not any(train.glob("*.hdf5")):
        raise AblationError(f"--data: {train} holds no .hdf5 shards (prepare it with python -m data.prepare)")
    if not eval_file.is_file():
        raise AblationError(f"--data: {eval_file} does not exist")
    paths = {"data.train_dir": str(train), "data.eval_file": str(eval_file)}
    if vocab.is_file():
        paths["data.vocab_file"] = str(vocab)
    return paths


def _demo_prepared(cache: Path) -> bool:
    try:
        manifest = json.loads((cache / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    params = manifest.get("parameters", {})
    # The corpus must be the demo's own corpus.txt there (`make demo TEXT=...` prepares other text
    # with the same parameters); `make demo` records a path relative to the repository.
    inputs = [(REPO / p).resolve() for p in params.get("inputs", [])]
    return (
        inputs == [(cache / "corpus.txt").resolve()]
        and all(params.get(k) == v for k, v in DEMO_PARAMETERS.items())
        and (cache / "vocab.txt").is_file()
        and (cache / "eval" / "part_eval_10k.hdf5").is_file()
    )


def prepare_demo(cache: Path) -> Path:
    """The demo corpus prepared as `make demo` does, into ``cache`` (reused when it matches)."""
    if _demo_prepared(cache):
        print(f"data: reusing the demo corpus prepared in {cache}", flush=True)
        return cache
    print(f"data: preparing the demo corpus into {cache}", flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    corpus = cache / "corpus.txt"
    for cmd in (
        [sys.executable, "-m", "data.prepare.demo_corpus", str(corpus)],
        [sys.executable, "-m", "data.prepare", "--input", str(corpus), "--output-dir", str(cache), *DEMO_PREPARE],
    ):
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0:
            last = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["(no output)"]
            raise AblationError(f"preparing the demo corpus: {' '.join(cmd[1:3])} failed: {last[0]}")
    return cache


# ---- runs -------------------------------------------------------------------------------


def run_overrides(args, data: dict[str, str], global_batch: int) -> tuple[dict[str, list[str]], list[int]]:
    """The override list of every run, and the spike steps (empty without --spikes)."""
    steps = args.steps
    interval = global_batch * max(1, steps // args.evals)
    warmup = args.adagc_warmup_steps if args.adagc_warmup_steps is not None else min(100, steps // 5)
    common = [f"{k}={v}" for k, v in data.items()] + [
        f"train.max_steps={steps}",
        "train.log_interval_steps=1",
        f"eval.interval_samples={interval}",
        f"eval.max_samples={args.eval_samples}",
        "checkpoint.interval_steps=0",
        "checkpoint.at_end=false",
        "log.plot=false",
        f"optim.adagc.warmup_steps={warmup}",
        f"loss.simreg_temperature={args.simreg_temperature}",
        f"loss.simreg_scope={args.simreg_scope}",
    ]
    spike_steps: list[int] = []
    if args.spikes:
        # Default: every --spike-every steps once AdaGC's warm-up is over (steady spikes are what
        # global clipping handles worst: each one shrinks every other tensor's update).
        spike_steps = args.spike_steps or list(range(warmup + 1, steps + 1, args.spike_every))
        if any(s < 1 or s > steps for s in spike_steps):
            raise AblationError(f"--spike-steps: {spike_steps} must lie in [1, --steps={steps}]")
        params = "[" + ",".join(args.spike_params) + "]"
        common += [
            f"debug.spike_steps=[{','.join(map(str, spike_steps))}]",
            f"debug.spike_params={params}",
            f"debug.spike_factor={args.spike_factor}",
        ]
    simreg = f"loss.simreg_weight={args.simreg_weight}"
    per_run = {
        "baseline": [],
        "adagc": ["optim.clip=adagc"],
        "simreg": [simreg],
        "adagc+simreg": ["optim.clip=adagc", simreg],
    }
    per_run.update(dict(args.arm))
    # The user's overrides come last, so they win over the ablation's.
    return {
        name: common + per_run[name] + list(args.overrides) for name in [*args.runs, *(n for n, _ in args.arm)]
    }, spike_steps


def run_one(config: str, out_dir: Path, overrides: list[str]) -> float:
    """``run_pretraining.main`` in this process, its output in out_dir/train.log; returns seconds."""
    import run_pretraining

    if out_dir.exists():  # the trainer would resume from an old checkpoint
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    log = out_dir / "train.log"
    start = time.time()
    with open(log, "w", encoding="utf-8") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        print("overrides: " + " ".join(overrides), flush=True)
        code = run_pretraining.main(["--config", config, "--output-dir", str(out_dir), *overrides])
    if code != 0 or not (out_dir / "summary.json").is_file():
        lines = log.read_text(encoding="utf-8").strip().splitlines()
        last = lines[-1] if lines else "no output"
        raise AblationError(f"run {out_dir.parent.name}/{out_dir.name} failed (exit {code}): {last} (see {log})")
    return time.time() - start


def _report_run(out: Path, name: str, seed: int, seconds: float) -> None:
    s = json.loads((out / name / f"seed{seed}" / "summary.json").read_text())
    acc = "n/a" if s["eval_accuracy"] is None else f"{s['eval_accuracy']:.4f}"
    print(f"  {name:<13} seed {seed}: {s['steps']} steps in {seconds:.0f} s, eval masked-LM accuracy {acc}", flush=True)


def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _run_parallel(args, out: Path, plan: dict, order: list[tuple[str, int]], wall: dict) -> None:
    """The runs on --jobs worker processes (a fresh one per run, --threads threads each), in order."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    with ProcessPoolExecutor(
        max_workers=args.jobs,
        mp_context=multiprocessing.get_context("spawn"),  # no forked torch thread pools
        max_tasks_per_child=1,
        initializer=_worker_init,
        initargs=(args.threads,),
    ) as pool:
        futures = {
            pool.submit(run_one, args.config, out / name / f"seed{seed}", plan[name][seed]): (name, seed)
            for name, seed in order
        }
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)  # a line per run as it ends
            for f in sorted(done, key=lambda f: order.index(futures[f])):
                name, seed = futures[f]
                error = f.exception()
                if error is not None:
                    pool.shutdown(wait=True, cancel_futures=True)
                    if isinstance(error, BrokenProcessPool):
                        log = out / name / f"seed{seed}" / "train.log"
                        raise AblationError(f"run {name} seed {seed}: its worker process died (see {log})")
                    raise error
                wall[name][seed] = f.result()
                _report_run(out, name, seed, wall[name][seed])


# ---- analysis ---------------------------------------------------------------------------


def read_run(out_dir: Path) -> dict:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out_dir / "summary.json").read_text())
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    return {
        "summary": summary,
        "train": {k: [r[k] for r in train] for k in ("step", "samples", "loss", "mlm_loss", "grad_norm")},
        "eval": {"samples": [r["samples"] for r in evals], "accuracy": [r["eval_accuracy"] for r in evals]},
    }


def loss_rise(losses: list[float], spike_steps: list[int], window: int = 5) -> float | None:
    """Mean over spikes of max(loss in the `window` steps after the spiked update) minus the
    mean loss of the `window` steps up to it (window shortened to the gap between spikes).
    Step s's loss is computed before update s, so the spike shows from step s+1 on. None
    without spikes."""
    gaps = [b - a for a, b in zip(spike_steps, spike_steps[1:])]
    window = max(1, min([window, *gaps]))
    rises = []
    for s in spike_steps:
        before = losses[max(0, s - window) : s]  # steps s-window+1 .. s (1-based)
        after = losses[s : s + window]  # steps s+1 .. s+window
        if before and after:
            rises.append(max(after) - sum(before) / len(before))
    return sum(rises) / len(rises) if rises else None


def samples_to_target(evals: dict, target: float) -> float | None:
    """Samples at which eval accuracy first reaches ``target``, linearly interpolated between
    the eval before and the eval that reaches it (the first eval's samples when that one
    does); None when no eval reaches it."""
    xs, ys = evals["samples"], evals["accuracy"]
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y >= target:
            if i == 0 or ys[i] == ys[i - 1]:
                return float(x)
            x0, y0 = xs[i - 1], ys[i - 1]
            return x0 + (target - y0) * (x - x0) / (y - y0)
    return None


def run_metrics(run: dict, target: float, spike_steps: list[int]) -> dict:
    """One run's numbers; the MLM loss, not the total (a SimReg run's total includes the regulariser)."""
    s, mlm = run["summary"], run["train"]["mlm_loss"]
    tail = mlm[-max(1, len(mlm) // 10) :]
    return {
        "final_mlm_loss": sum(tail) / len(tail) if tail else None,
        "eval_accuracy": s["eval_accuracy"],
        "samples_to_target": samples_to_target(run["eval"], target),
        "loss_spike_score": s["loss_spike_score"],
        "grad_norm_spike_score": s["grad_norm_spike_score"],
        "post_spike_loss_rise": loss_rise(mlm, spike_steps) if spike_steps else None,
        "seq_per_s": s["seq_per_s"],
    }


METRICS = (
    "final_mlm_loss",
    "eval_accuracy",
    "samples_to_target",
    "loss_spike_score",
    "grad_norm_spike_score",
    "post_spike_loss_rise",
    "seq_per_s",
)


def mean_std(values: list) -> dict:
    """Mean and sample standard deviation (ddof 1; None for one value) over the values that exist."""
    import numpy as np

    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return {
        "mean": float(x.mean()) if len(x) else None,
        "std": float(x.std(ddof=1)) if len(x) > 1 else None,
        "n": len(x),
    }


def arm_rows(arms: dict[str, list[dict]], target: float, spike_steps: list[int]) -> list[dict]:
    """Per arm: every metric's mean/std over its seeds, and samples-to-target against the baseline's."""
    rows = []
    for name, runs in arms.items():
        per_seed = [run_metrics(r, target, spike_steps) for r in runs]
        row = {
            "arm": name,
            "seeds": len(runs),
            "samples": [r["summary"]["samples"] for r in runs],
            **{k: mean_std([m[k] for m in per_seed]) for k in METRICS},
            "per_seed": per_seed,
        }
        rows.append(row)
    base = next((r for r in rows if r["arm"] == "baseline"), rows[0])
    for row in rows:
        a, b = row["samples_to_target"]["mean"], base["samples_to_target"]["mean"]
        row["samples_to_target_vs_base"] = None if a is None or not b else a / b
    return rows


def markdown_table(rows: list[dict], target: float, spikes: bool) -> str:
    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    def ms(stat, fmt):
        return f(stat["mean"], fmt) + ("" if stat["std"] is None else " ± " + f(stat["std"], fmt))

    head = [
        "arm",
        "seeds",
        "final MLM loss",
        "eval MLM acc",
        f"samples to acc {target:.4f}",
        "vs base",
        "loss spike %",
        "grad-norm spike %",
    ]
    head += ["loss rise after spikes"] if spikes else []
    head += ["seq/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        reached = r["samples_to_target"]["n"]
        cells = [
            r["arm"],
            str(r["seeds"]),
            ms(r["final_mlm_loss"], ".4f"),
            ms(r["eval_accuracy"], ".4f"),
            ms(r["samples_to_target"], ".0f") + f" ({reached}/{r['seeds']} reached)",
            f(r["samples_to_target_vs_base"], ".2f"),
            ms(r["loss_spike_score"], ".2f"),
            ms(r["grad_norm_spike_score"], ".2f"),
        ]
        cells += [ms(r["post_spike_loss_rise"], "+.4f")] if spikes else []
        cells += [ms(r["seq_per_s"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _band(curves: list[tuple[list, list]]):
    """Seeds' (x, y) curves on the shortest one's x grid (clipped to the range all cover) ->
    (x, mean, std)."""
    import numpy as np

    curves = [(np.asarray(x, float), np.asarray(y, float)) for x, y in curves if len(x)]
    if not curves:
        return None
    hi = min(x[-1] for x, _ in curves)
    grid = min((x for x, _ in curves), key=len)
    grid = grid[grid <= hi]
    ys = np.stack([np.interp(grid, x, y) for x, y in curves])
    return grid, ys.mean(0), ys.std(0, ddof=1) if len(ys) > 1 else np.zeros(len(grid))


def plot(arms: dict[str, list[dict]], target: float, spike_samples: list[int], path: Path, title: str) -> None:
    """Training MLM loss and eval accuracy against samples: per arm the mean over seeds and a
    band of one standard deviation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, runs) in enumerate(arms.items()):
        color = f"C{i}"
        for ax, curves, marker in (
            (ax1, [(r["train"]["samples"], r["train"]["mlm_loss"]) for r in runs], None),
            (ax2, [(r["eval"]["samples"], r["eval"]["accuracy"]) for r in runs], "o"),
        ):
            band = _band(curves)
            if band is None:
                continue
            x, mean, std = band
            ax.plot(x, mean, color=color, marker=marker, linewidth=0.9, label=f"{name} (n={len(runs)})")
            ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
    for s in spike_samples:
        ax1.axvline(s, color="grey", linestyle=":", linewidth=0.8)
    ax2.axhline(target, color="grey", linestyle="--", linewidth=0.8, label=f"target {target:.4f}")
    ax1.set_xlabel("samples")
    ax1.set_ylabel("training masked-LM loss (mean ± std over seeds)")
    ax2.set_xlabel("samples")
    ax2.set_ylabel("masked-LM accuracy, eval (mean ± std)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with publishing(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


def default_target(arms: dict[str, list[dict]]) -> float:
    """0.9 x the baseline's (else the first arm's) mean final eval accuracy: a level the
    baseline reaches inside the run, so samples-to-target compares arms where it is defined."""
    runs = arms.get("baseline") or next(iter(arms.values()))
    accs = [r["summary"]["eval_accuracy"] for r in runs if r["summary"]["eval_accuracy"] is not None]
    if not accs:
        raise AblationError("no eval accuracy in the baseline runs: give --target-accuracy")
    return 0.9 * sum(accs) / len(accs)


def report(
    arms: dict[str, list[dict]],
    out: Path,
    setup: dict,
    target: float | None,
    spike_steps: list[int],
    global_batch: int | None,
    title: str,
) -> None:
    """Stats, table, JSON and plot for arms of finished runs."""
    target = default_target(arms) if target is None else target
    rows = arm_rows(arms, target, spike_steps)
    setup = {**setup, "target_accuracy": target}
    write_text(out / "ablation.json", json.dumps({"setup": setup, "table": rows, "arms": arms}, indent=1) + "\n")
    spike_samples = [s * global_batch for s in spike_steps] if global_batch else []
    plot(arms, target, spike_samples, out / "ablation.png", title)
    print()
    print(markdown_table(rows, target, bool(spike_steps)))
    print(
        f"\nsamples to target: linear between evals; 'vs base' = arm mean / baseline mean (SimReg's claim: "
        f"< 0.70). wrote {out / 'ablation.json'}, {out / 'ablation.png'}"
    )


# ---- CLI --------------------------------------------------------------------------------


def _strings(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in _strings(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _names(text: str) -> list[str]:
    names = _strings(text)
    bad = [n for n in names if n not in RUNS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown run(s) {bad or text!r}; choose from {','.join(RUNS)}")
    return names


def _arm(text: str) -> tuple[str, list[str]]:
    name, *overrides = text.split()
    if not overrides or "=" in name or "/" in name or any("=" not in o for o in overrides):
        raise argparse.ArgumentTypeError(f"--arm: expected 'NAME section.field=value ...', got {text!r}")
    return name, overrides


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="run configuration (YAML)")
    ap.add_argument("--data", help="a prepared data directory (train/, eval/, vocab.txt); default: the demo corpus")
    ap.add_argument(
        "--data-cache",
        default=str(REPO / "results" / "demo-data"),
        help="where the demo corpus is prepared when --data is not given",
    )
    ap.add_argument("--out", default=str(REPO / "results" / "ablation"), help="output directory")
    ap.add_argument(
        "--compare",
        nargs="+",
        metavar="[LABEL=]RUN_DIR",
        help="report on finished runs instead of training: a RUN_DIR with summary.json is one run, "
        "else its subdirectories with one are the seeds of one arm (LABEL, default the name)",
    )
    ap.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="seeds per arm: train.seed = --seed + 0..N-1 (data order, weights, dropout)",
    )
    ap.add_argument(
        "--target-accuracy",
        type=float,
        help="eval accuracy for samples-to-target (default: 0.9 x the baseline's mean final accuracy)",
    )
    ap.add_argument("--steps", type=int, default=250, help="optimizer steps per run")
    ap.add_argument("--evals", type=int, default=6, help="evaluations per run (evenly spaced)")
    ap.add_argument("--eval-samples", type=int, default=1000, help="eval samples per evaluation")
    ap.add_argument("--runs", type=_names, default=list(RUNS), help=f"comma-separated, from {','.join(RUNS)}")
    ap.add_argument(
        "--seed",
        type=int,
        default=42,
        help="first seed: seed k of --seeds N trains with train.seed = SEED + k (every arm shares it)",
    )
    ap.add_argument(
        "--arm",
        type=_arm,
        action="append",
        default=[],
        metavar="'NAME section.field=value ...'",
        help="an extra arm: a name and its overrides (repeatable)",
    )
    ap.add_argument("--simreg-weight", type=float, default=0.1)
    ap.add_argument("--simreg-temperature", type=float, default=0.1)
    ap.add_argument("--simreg-scope", default="masked", choices=("masked", "all"))
    ap.add_argument("--adagc-warmup-steps", type=int, help="default: min(100, steps // 5)")
    ap.add_argument("--spikes", action="store_true", help="inject gradient spikes (debug.*)")
    ap.add_argument(
        "--spike-steps",
        type=_ints,
        help="comma-separated 1-based steps (default: every --spike-every steps after AdaGC's warm-up)",
    )
    ap.add_argument("--spike-every", type=int, default=5)
    ap.add_argument(
        "--spike-params",
        type=_strings,
        default=["layers.0."],
        help="comma-separated parameter-name substrings the spikes hit",
    )
    ap.add_argument("--spike-factor", type=float, default=1000.0)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1 keeps OpenMP from spinning on a shared, loaded CPU)",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time, each in its own process with --threads threads (1: one after another, in this process)",
    )
    ap.add_argument("overrides", nargs="*", metavar="section.field=value", help="applied to every run, last")
    args = ap.parse_args(argv)
    for name in ("steps", "evals", "eval_samples", "threads", "jobs", "spike_every", "seeds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.simreg_weight <= 0:
        ap.error("--simreg-weight must be > 0 (the simreg runs need SimReg on)")
    names = [*args.runs, *(n for n, _ in args.arm)]
    if len(set(names)) != len(names):
        ap.error(f"arm names must differ: {names}")
    if any(o.startswith("train.seed=") for o in args.overrides):
        ap.error("train.seed= as an override: the seeds are --seed + 0..N-1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return _compare(args) if args.compare else _main(args)
    except (AblationError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _seed_dirs(path: Path) -> list[Path]:
    if (path / "summary.json").is_file():
        return [path]
    if not path.is_dir():
        raise AblationError(f"--compare: {path} is not a directory")
    found = sorted(p for p in path.iterdir() if (p / "summary.json").is_file())
    if not found:
        raise AblationError(f"--compare: {path} holds no summary.json, nor do its subdirectories")
    return found


def _read_run_checked(path: Path) -> dict:
    try:
        return read_run(path)
    except (OSError, ValueError, KeyError) as e:
        raise AblationError(f"--compare: {path}: cannot read metrics.jsonl/summary.json ({e})") from None


def _compare(args) -> int:
    arms: dict[str, list[dict]] = {}
    for spec in args.compare:
        label, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        path = Path(path)
        label = label or path.resolve().name
        if label in arms:
            raise AblationError(f"--compare: two arms named {label!r} (name them LABEL=RUN_DIR)")
        arms[label] = [_read_run_checked(p) for p in _seed_dirs(path)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "compare": args.compare}
    report(
        arms,
        out,
        setup,
        args.target_accuracy,
        [],
        None,
        "compared runs: " + ", ".join(f"{k} (n={len(v)})" for k, v in arms.items()),
    )
    return 0


def _main(args) -> int:
    if not Path(args.config).is_file():
        raise AblationError(f"--config: {args.config} does not exist")
    data_dir = Path(args.data) if args.data else prepare_demo(Path(args.data_cache))
    data = data_paths(data_dir)
    base_cfg = load_config(args.config, [f"{k}={v}" for k, v in data.items()] + list(args.overrides))
    global_batch = base_cfg.train.global_batch_size
    overrides, spike_steps = run_overrides(args, data, global_batch)
    seeds = [args.seed + i for i in range(args.seeds)]
    plan = {name: {seed: ovr + [f"train.seed={seed}"] for seed in seeds} for name, ovr in overrides.items()}
    for runs in plan.values():  # every run's config is valid before any trains
        for ovr in runs.values():
            load_config(args.config, ovr)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    threads = torch.get_num_threads()
    if args.jobs == 1:
        torch.set_num_threads(args.threads)
    print(
        f"ablation: {len(plan)} arms x {len(seeds)} seed(s) x {args.steps} steps, global batch {global_batch}, "
        f"config {args.config}, data {data_dir}, {args.jobs} job(s) x {args.threads} thread(s)"
        + (f", spikes at steps {spike_steps}" if spike_steps else ""),
        flush=True,
    )
    wall: dict[str, dict[int, float]] = {name: {} for name in plan}
    # Seed-major: a cut-short ablation still has every arm at the first seeds.
    order = [(name, seed) for seed in seeds for name in plan]
    start = time.time()
    if args.jobs == 1:
        try:
            for name, seed in order:
                wall[name][seed] = run_one(args.config, out / name / f"seed{seed}", plan[name][seed])
                _report_run(out, name, seed, wall[name][seed])
        finally:
            torch.set_num_threads(threads)  # main() may run inside a longer-lived process (tests)
    else:
        _run_parallel(args, out, plan, order, wall)
    arms = {name: [read_run(out / name / f"seed{seed}") for seed in seeds] for name in plan}

    cfg = load_config(args.config, plan[next(iter(plan))][seeds[0]])
    setup = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "config": args.config,
        "data": str(data_dir),
        "steps": args.steps,
        "global_batch_size": global_batch,
        "seeds": seeds,
        "model_preset": cfg.model.preset,
        "attention": cfg.model.attention,
        "optimizer": cfg.optim.name,
        "lr": cfg.optim.lr,
        "clip_baseline": cfg.optim.clip,
        "adagc_warmup_steps": cfg.optim.adagc.warmup_steps,
        "simreg_weight": args.simreg_weight,
        "simreg_temperature": args.simreg_temperature,
        "simreg_scope": args.simreg_scope,
        "spike_steps": spike_steps,
        "spike_params": args.spike_params if spike_steps else [],
        "spike_factor": args.spike_factor,
        "overrides": overrides,
        "wall_seconds": wall,
        "total_wall_seconds": time.time() - start,
    }
    title = (
        f"{cfg.model.preset} BERT, {args.steps} steps x {global_batch}, {len(seeds)} seed(s), {cfg.optim.name}; "
        f"SimReg w={args.simreg_weight} T={args.simreg_temperature}; AdaGC warm-up "
        f"{cfg.optim.adagc.warmup_steps}"
        + (
            f"; {len(spike_steps)} spikes x{args.spike_factor:g} on {','.join(args.spike_params)} "
            f"(steps {spike_steps[0]}-{spike_steps[-1]}, dotted)"
            if spike_steps
            else ""
        )
    )
    report(arms, out, setup, args.target_accuracy, spike_steps, global_batch, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
