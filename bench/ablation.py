"""AdaGC and SimReg ablation: four training runs on the same data and seed, side by side.

    python bench/ablation.py                          # CPU demo corpus, prepared on first use
    python bench/ablation.py --spikes                 # with gradient spikes injected (debug.*)
    python bench/ablation.py --data DIR --steps 400 --out results/abl optim.name=adamw

The runs (each is ``run_pretraining.py`` called in this process with ``--config`` plus
overrides; all four share the data order, initial weights and dropout masks, which the
trainer derives from ``train.seed``):

    baseline       the config's clipping (the CPU demo's: global norm 1.0, as MLPerf)
    adagc          optim.clip=adagc
    simreg         loss.simreg_weight=W
    adagc+simreg   both

Every run logs every step (``train.log_interval_steps=1``) so the spike scores of its
``summary.json`` see every loss and gradient norm, and evaluates masked-LM accuracy
``--evals`` times. ``--spikes`` multiplies the gradients of ``--spike-params`` by
``--spike-factor`` at ``--spike-steps`` (the trainer's ``debug.*``; default: every
``--spike-every`` steps after AdaGC's warm-up, so that its per-tensor clipping, not its
warm-up's global clipping, meets them). AdaGC's
warm-up is ``min(100, steps // 5)`` steps unless ``--adagc-warmup-steps`` says otherwise.

Without ``--data``, the demo corpus is prepared as ``make demo`` does (``python -m
data.demo_corpus`` then ``python -m data.prepare --train-vocab 8000 --max-seq-length 128
...``) into ``--data-cache`` and reused while its manifest matches.

Writes ``OUT/ablation.json`` (setup, per-run summary and curves), ``OUT/ablation.png``
(training loss and eval masked-LM accuracy against samples) and ``OUT/<run>/`` (each run's
own outputs and ``train.log``); prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run by path: import the project from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bert.metrics import atomic_write_text  # noqa: E402
from bert.train_config import ConfigError, load_config  # noqa: E402

DEFAULT_CONFIG = REPO / "launch" / "configs" / "cpu_demo.yaml"
RUNS = ("baseline", "adagc", "simreg", "adagc+simreg")
# The demo preparation of the Makefile's `demo` target (max_seq_length 128, vocab of 8000).
DEMO_PREPARE = ["--input-format", "bert", "--train-vocab", "8000", "--max-seq-length", "128",
                "--max-predictions", "20", "--dupe-factor", "10", "--shards", "4", "--eval-samples", "1000",
                "--workers", "2"]
DEMO_PARAMETERS = {"input_format": "bert", "train_vocab": 8000, "max_seq_length": 128, "max_predictions": 20,
                   "dupe_factor": 10, "eval_samples": 1000, "seed": 12345}


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
    return (inputs == [(cache / "corpus.txt").resolve()] and all(params.get(k) == v for k, v in DEMO_PARAMETERS.items())
            and (cache / "vocab.txt").is_file() and (cache / "eval" / "part_eval_10k.hdf5").is_file())


def prepare_demo(cache: Path) -> Path:
    """The demo corpus prepared as `make demo` does, into ``cache`` (reused when it matches)."""
    if _demo_prepared(cache):
        print(f"data: reusing the demo corpus prepared in {cache}", flush=True)
        return cache
    print(f"data: preparing the demo corpus into {cache}", flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    corpus = cache / "corpus.txt"
    for cmd in ([sys.executable, "-m", "data.demo_corpus", str(corpus)],
                [sys.executable, "-m", "data.prepare", "--input", str(corpus), "--output-dir", str(cache),
                 *DEMO_PREPARE]):
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
        f"train.max_steps={steps}", "train.log_interval_steps=1", f"eval.interval_samples={interval}",
        f"eval.max_samples={args.eval_samples}", "checkpoint.interval_steps=0", "log.plot=false",
        f"optim.adagc.warmup_steps={warmup}", f"loss.simreg_temperature={args.simreg_temperature}",
        f"loss.simreg_scope={args.simreg_scope}"]
    spike_steps: list[int] = []
    if args.spikes:
        # Default: every --spike-every steps once AdaGC's warm-up is over (steady spikes are what
        # global clipping handles worst: each one shrinks every other tensor's update).
        spike_steps = args.spike_steps or list(range(warmup + 1, steps + 1, args.spike_every))
        if any(s < 1 or s > steps for s in spike_steps):
            raise AblationError(f"--spike-steps: {spike_steps} must lie in [1, --steps={steps}]")
        params = "[" + ",".join(args.spike_params) + "]"
        common += [f"debug.spike_steps=[{','.join(map(str, spike_steps))}]", f"debug.spike_params={params}",
                   f"debug.spike_factor={args.spike_factor}"]
    simreg = f"loss.simreg_weight={args.simreg_weight}"
    per_run = {"baseline": [], "adagc": ["optim.clip=adagc"], "simreg": [simreg],
               "adagc+simreg": ["optim.clip=adagc", simreg]}
    # The user's overrides come last, so they win over the ablation's.
    return {name: common + per_run[name] + list(args.overrides) for name in args.runs}, spike_steps


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
        raise AblationError(f"run {out_dir.name} failed (exit {code}): {lines[-1] if lines else 'no output'} "
                            f"(see {log})")
    return time.time() - start


# ---- analysis ---------------------------------------------------------------------------


def read_run(out_dir: Path) -> dict:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out_dir / "summary.json").read_text())
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    return {"summary": summary,
            "train": {k: [r[k] for r in train] for k in ("step", "samples", "loss", "mlm_loss", "grad_norm")},
            "eval": {"samples": [r["samples"] for r in evals], "accuracy": [r["eval_accuracy"] for r in evals]}}


def loss_rise(losses: list[float], spike_steps: list[int], window: int = 5) -> float | None:
    """Mean over spikes of max(loss in the `window` steps after the spiked update) minus the
    mean loss of the `window` steps up to it (window shortened to the gap between spikes).
    Step s's loss is computed before update s, so the spike shows from step s+1 on. None
    without spikes."""
    gaps = [b - a for a, b in zip(spike_steps, spike_steps[1:])]
    window = max(1, min([window, *gaps]))
    rises = []
    for s in spike_steps:
        before = losses[max(0, s - window):s]  # steps s-window+1 .. s (1-based)
        after = losses[s:s + window]  # steps s+1 .. s+window
        if before and after:
            rises.append(max(after) - sum(before) / len(before))
    return sum(rises) / len(rises) if rises else None


def table_rows(runs: dict[str, dict], spike_steps: list[int]) -> list[dict]:
    base = runs.get("baseline")
    rows = []
    for name, r in runs.items():
        s, losses = r["summary"], r["train"]["loss"]
        # The MLM loss, not the total: the total of a SimReg run includes the regulariser.
        mlm = r["train"]["mlm_loss"]
        tail = mlm[-max(1, len(mlm) // 10):]
        acc = s["eval_accuracy"]
        rows.append({
            "run": name, "steps": s["steps"], "samples": s["samples"],
            "final_mlm_loss": sum(tail) / len(tail),
            "eval_accuracy": acc,
            "delta_accuracy": None if base is None or acc is None or base["summary"]["eval_accuracy"] is None
            else acc - base["summary"]["eval_accuracy"],
            "best_eval_accuracy": max(r["eval"]["accuracy"]) if r["eval"]["accuracy"] else None,
            "loss_spike_score": s["loss_spike_score"], "grad_norm_spike_score": s["grad_norm_spike_score"],
            "max_grad_norm": max(r["train"]["grad_norm"]) if r["train"]["grad_norm"] else None,
            "post_spike_loss_rise": loss_rise(mlm, spike_steps),
            "skipped_steps": s["skipped_steps"], "train_seconds": s["train_seconds"], "seq_per_s": s["seq_per_s"],
        })
    return rows


def markdown_table(rows: list[dict], spikes: bool) -> str:
    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    head = ["run", "final MLM loss", "eval MLM acc", "vs baseline", "loss spike %", "grad-norm spike %"]
    head += ["loss rise after spikes"] if spikes else []
    head += ["seq/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["run"], f(r["final_mlm_loss"], ".4f"), f(r["eval_accuracy"], ".4f"), f(r["delta_accuracy"], "+.4f"),
                 f(r["loss_spike_score"], ".2f"), f(r["grad_norm_spike_score"], ".2f")]
        cells += [f(r["post_spike_loss_rise"], "+.4f")] if spikes else []
        cells += [f(r["seq_per_s"], ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], spike_steps: list[int], global_batch: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in runs.items():
        ax1.plot(r["train"]["samples"], r["train"]["mlm_loss"], label=name, linewidth=0.9)
        ax2.plot(r["eval"]["samples"], r["eval"]["accuracy"], marker="o", label=name)
    for s in spike_steps:
        ax1.axvline(s * global_batch, color="grey", linestyle=":", linewidth=0.8)
    ax1.set_xlabel("samples")
    ax1.set_ylabel("training masked-LM loss")
    ax2.set_xlabel("samples")
    ax2.set_ylabel("masked-LM accuracy (eval)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="run configuration (YAML)")
    ap.add_argument("--data", help="a prepared data directory (train/, eval/, vocab.txt); default: the demo corpus")
    ap.add_argument("--data-cache", default=str(REPO / "results" / "demo-data"),
                    help="where the demo corpus is prepared when --data is not given")
    ap.add_argument("--out", default=str(REPO / "results" / "ablation"), help="output directory")
    ap.add_argument("--steps", type=int, default=250, help="optimizer steps per run")
    ap.add_argument("--evals", type=int, default=6, help="evaluations per run (evenly spaced)")
    ap.add_argument("--eval-samples", type=int, default=1000, help="eval samples per evaluation")
    ap.add_argument("--runs", type=_names, default=list(RUNS), help=f"comma-separated, from {','.join(RUNS)}")
    ap.add_argument("--simreg-weight", type=float, default=0.1)
    ap.add_argument("--simreg-temperature", type=float, default=0.1)
    ap.add_argument("--simreg-scope", default="masked", choices=("masked", "all"))
    ap.add_argument("--adagc-warmup-steps", type=int, help="default: min(100, steps // 5)")
    ap.add_argument("--spikes", action="store_true", help="inject gradient spikes (debug.*)")
    ap.add_argument("--spike-steps", type=_ints, help="comma-separated 1-based steps (default: every --spike-every "
                    "steps after AdaGC's warm-up)")
    ap.add_argument("--spike-every", type=int, default=5)
    ap.add_argument("--spike-params", type=_strings, default=["layers.0."],
                    help="comma-separated parameter-name substrings the spikes hit")
    ap.add_argument("--spike-factor", type=float, default=1000.0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1 keeps OpenMP from spinning on a shared, loaded CPU)")
    ap.add_argument("overrides", nargs="*", metavar="section.field=value", help="applied to every run, last")
    args = ap.parse_args(argv)
    for name in ("steps", "evals", "eval_samples", "threads", "spike_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.simreg_weight <= 0:
        ap.error("--simreg-weight must be > 0 (the simreg runs need SimReg on)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return _main(args)
    except (AblationError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(args) -> int:
    if not Path(args.config).is_file():
        raise AblationError(f"--config: {args.config} does not exist")
    data_dir = Path(args.data) if args.data else prepare_demo(Path(args.data_cache))
    data = data_paths(data_dir)
    base_cfg = load_config(args.config, [f"{k}={v}" for k, v in data.items()] + list(args.overrides))
    global_batch = base_cfg.train.global_batch_size
    overrides, spike_steps = run_overrides(args, data, global_batch)
    for name, ovr in overrides.items():  # every run's config is valid before any trains
        load_config(args.config, ovr)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    print(f"ablation: {len(overrides)} runs x {args.steps} steps, global batch {global_batch}, "
          f"config {args.config}, data {data_dir}, {args.threads} thread(s)"
          + (f", spikes at steps {spike_steps}" if spike_steps else ""), flush=True)
    runs, wall = {}, {}
    try:
        for name, ovr in overrides.items():
            wall[name] = run_one(args.config, out / name, ovr)
            runs[name] = read_run(out / name)
            s = runs[name]["summary"]
            acc = "n/a" if s["eval_accuracy"] is None else f"{s['eval_accuracy']:.4f}"
            print(f"  {name:<13} {s['steps']} steps in {wall[name]:.0f} s, eval masked-LM accuracy {acc}",
                  flush=True)
    finally:
        torch.set_num_threads(threads)  # main() may run inside a longer-lived process (tests)

    rows = table_rows(runs, spike_steps)
    table = markdown_table(rows, bool(spike_steps))
    cfg = load_config(args.config, overrides[next(iter(overrides))])
    setup = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "config": args.config,
             "data": str(data_dir), "steps": args.steps, "global_batch_size": global_batch,
             "model_preset": cfg.model.preset, "attention": cfg.model.attention, "optimizer": cfg.optim.name,
             "lr": cfg.optim.lr, "clip_baseline": cfg.optim.clip, "adagc_warmup_steps": cfg.optim.adagc.warmup_steps,
             "simreg_weight": args.simreg_weight, "simreg_temperature": args.simreg_temperature,
             "simreg_scope": args.simreg_scope, "spike_steps": spike_steps,
             "spike_params": args.spike_params if spike_steps else [], "spike_factor": args.spike_factor,
             "overrides": overrides, "wall_seconds": wall}
    atomic_write_text(out / "ablation.json", json.dumps({"setup": setup, "table": rows, "runs": runs}, indent=1) + "\n")
    title = (f"{cfg.model.preset} BERT, {args.steps} steps x {global_batch}, {cfg.optim.name}; SimReg w="
             f"{args.simreg_weight} T={args.simreg_temperature}; AdaGC warm-up {cfg.optim.adagc.warmup_steps}"
             + (f"; {len(spike_steps)} spikes x{args.spike_factor:g} on {','.join(args.spike_params)} "
                f"(steps {spike_steps[0]}-{spike_steps[-1]}, dotted)" if spike_steps else ""))
    plot(runs, spike_steps, global_batch, out / "ablation.png", title)
    print()
    print(table)
    print(f"\nwrote {out / 'ablation.json'}, {out / 'ablation.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
