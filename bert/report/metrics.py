"""What a run reports: the MLPerf hyper-parameters, a record per logged step, the summary.

Rank 0 writes ``metrics.jsonl`` (``MetricsWriter``; a resumed run drops the records past its
checkpoint's step), the progress lines, ``summary.json``, its table and ``curves.png``: docs/training.md,
"Outputs". ``DeviceCounters`` keeps what the steps leave on the device and reads it in one read per
log interval (docs/step.md); nothing here runs on a step that does not log.
"""

from __future__ import annotations

import json
import os
import sys
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from bert.checkpoint.training import list_checkpoints
from bert.config import CheckpointSection, RunConfig
from bert.model import fp8
from bert.optim.clipping import ClipStats
from bert.state import TrainState
from common.errors import writing
from common.files import publishing, write_text

if TYPE_CHECKING:  # mlperf_logging is optional: imported only where the MLPerf log is written
    from bert.report.mlperf_log import MLPerfLogger


class MetricsWriter:
    def __init__(self, path: str, enabled: bool, resume_step: int | None = None):
        self.path, self.enabled = path, enabled
        self.records: list[dict] = []
        self.sinks: list = []  # more receivers of every record (``write(record)``, ``close()``)
        if not enabled:
            return
        if resume_step is not None and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:  # a line cut by a kill
                        break
                    if rec.get("step", 0) <= resume_step:
                        self.records.append(rec)
            write_text(path, "".join(json.dumps(r) + "\n" for r in self.records))
        elif os.path.exists(path):
            os.remove(path)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        with writing(self.path), open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


class Progress:
    """One line per logged step; a bar (on the same line) when stdout is a terminal."""

    def __init__(self, enabled: bool, total_steps: int):
        self.enabled, self.total, self.tty = enabled, total_steps, sys.stdout.isatty()

    def step(self, rec: dict) -> None:
        if not self.enabled:
            return
        line = (
            f"step {rec['step']:>6}  samples {rec['samples']:>9}  loss {rec['loss']:.4f}  "
            f"lr {rec['lr']:.3e}  {rec['seq_per_s']:8.1f} seq/s  {rec['tokens_per_s']:10.0f} tok/s"
        )
        if self.tty:
            frac = min(rec["step"] / self.total, 1.0)
            line += f"  [{'#' * int(24 * frac):<24}] {100 * frac:5.1f}%"
        print(line, flush=True)

    def message(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)


def summary_table(summary: dict) -> str:
    rows = [
        ("status", summary["status"]),
        ("steps", summary["steps"]),
        ("samples", summary["samples"]),
        ("train seconds", f"{summary['train_seconds']:.1f}"),
        ("sequences/s", f"{summary['seq_per_s']:.1f}"),
        ("tokens/s", f"{summary['tokens_per_s']:.0f}"),
        ("eval accuracy", "n/a" if summary["eval_accuracy"] is None else f"{summary['eval_accuracy']:.4f}"),
        ("time to train", f"{summary['time_to_train_s']:.1f} s"),
        ("skipped steps", summary["skipped_steps"]),
    ]
    rows += [
        (k.replace("_", " "), summary[k]) for k in ("corrupt_samples_skipped", "checkpoint_failures") if summary.get(k)
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def plot_curves(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    curves = (
        ("loss", "training loss (MLM + NSP)", {}),
        ("eval_accuracy", "masked-LM accuracy (eval)", {"marker": "o"}),
    )
    for ax, (key, label, style) in zip(axes, curves):
        kept = [r for r in records if key in r]
        ax.plot([r["samples"] for r in kept], [r[key] for r in kept], **style)
        ax.set_xlabel("samples")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    with writing(path), publishing(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


class SpikeCounter:
    """Running spike score: a value is a spike when it is at least ``sigmas`` standard deviations above the mean of the
    previous ``window`` finite values (a non-finite value always is; the first two never are)."""

    def __init__(self, sigmas: float = 7.0, window: int = 1000):
        self.sigmas = sigmas
        self.previous: deque = deque(maxlen=window)
        self.count = 0
        self.spikes = 0

    def add(self, value: float) -> float:
        """Counts ``value``; returns the score after it."""
        prev = np.asarray(self.previous, dtype=np.float64)
        prev = prev[np.isfinite(prev)]
        if len(prev) >= 2:
            mean = prev.mean()
            self.spikes += bool(not np.isfinite(value) or (value > mean and value >= mean + self.sigmas * prev.std()))
        self.previous.append(value)
        self.count += 1
        return self.score

    @property
    def score(self) -> float:
        """Percentage of the values so far that were spikes."""
        return 100.0 * self.spikes / self.count if self.count else 0.0


def spike_score(values: list[float], sigmas: float = 7.0, window: int = 1000) -> float:
    """``SpikeCounter``'s score (a percentage) of ``values``."""
    counter = SpikeCounter(sigmas, window)
    for v in values:
        counter.add(v)
    return counter.score


class DeviceCounters:
    """``skipped`` and ``in_row`` (consecutive skipped steps) as int64 device tensors."""

    def __init__(self, device: torch.device, skipped: int = 0, in_row: int = 0):
        self.skipped = torch.tensor(skipped, dtype=torch.int64, device=device)
        self.in_row = torch.tensor(in_row, dtype=torch.int64, device=device)
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=device)
        self.clip_stats: ClipStats | None = None

    def update(self, found_inf: Tensor, grad_norm: Tensor, clip_stats: ClipStats | None) -> None:
        """After a step: ``found_inf`` (0-dim bool) counts it as skipped; no host read."""
        skipped = found_inf.to(torch.int64)
        self.skipped = self.skipped + skipped
        self.in_row = (self.in_row + 1) * skipped
        self.grad_norm, self.clip_stats = grad_norm.detach(), clip_stats

    def read(self, **extra: Tensor) -> dict:
        """One read of ``skipped``, ``in_row``, ``grad_norm``, every tensor in ``extra`` (as floats
        or lists) and, as ``adagc``, the last AdaGC step's share of clipped tensors and mean clip factor."""
        names = {"skipped": self.skipped, "in_row": self.in_row, "grad_norm": self.grad_norm, **extra}
        c = self.clip_stats
        if c is not None and c.num_tensors:
            names.update(num_clipped=c.num_clipped, clip_ratio=c.clip_ratio)
        flat = [t.detach().reshape(-1).to(torch.float64) for t in names.values()]
        values = iter(torch.cat(flat).tolist())  # the one read
        out = {name: list(islice(values, t.numel())) if t.dim() else next(values) for name, t in names.items()}
        out["skipped"], out["in_row"] = int(out["skipped"]), int(out["in_row"])
        out["adagc"] = {}
        if "num_clipped" in out:
            share, ratio = int(out.pop("num_clipped")) / c.num_tensors, out.pop("clip_ratio")
            out["adagc"] = {"adagc_clipped_share": share, "adagc_clip_ratio": ratio}
        return out


# The rebalancer's numbers a step record carries (data.rebalance.exchange.ExchangeStats fields).
REBALANCE_FIELDS = tuple(
    "imbalance_before imbalance_after samples_moved samples_sent token_share "
    "exchange_ms wait_ms hidden_fraction".split()
)


def log_hyperparameters(mllog: MLPerfLogger, cfg: RunConfig, seed: int, micro_batch: int) -> None:
    """submission_info and every hyper-parameter MLPerf names, from the run's config."""
    t, o = cfg.train, cfg.optim
    mllog.submission_info()
    mllog.hyperparameters(
        seed=seed,
        global_batch_size=t.global_batch_size,
        local_batch_size=micro_batch,
        gradient_accumulation_steps=t.grad_accum_steps,
        max_sequence_length=cfg.data.max_seq_length,
        max_predictions_per_seq=cfg.data.max_predictions_per_seq,
        optimizer=o.name,
        learning_rate=o.lr,
        betas=o.betas,
        epsilon=o.eps,
        weight_decay=o.weight_decay,
        warmup_steps=o.warmup_steps,
        start_warmup_step=o.start_warmup_step,
        train_steps=t.max_steps,
        poly_power=o.poly_power,
        schedule="poly" if o.schedule == "poly" else "wsd",
        decay_steps=o.decay_steps,
        decay_shape=o.decay_shape,
    )
    mllog.precision(linear=fp8.mlperf_precision(t.fp8, t.precision), attention=fp8.mlperf_precision("off", t.precision))


def step_record(cfg: RunConfig, state: TrainState, got: dict, throughput: tuple[float, float], rebalance) -> dict:
    """One metrics.jsonl record: ``got`` what ``DeviceCounters.read`` read (``parts``: the all-reduced
    [loss, mlm, nsp, simreg] of the step, ``lr``, ``grad_norm``, ``adagc``), ``throughput``
    (sequences/s, tokens/s) since the last record, ``rebalance`` the rebalancer's stats of the step or None."""
    parts = got["parts"]
    rec = {
        "step": state.step,
        "samples": state.samples,
        "loss": parts[0],
        "mlm_loss": parts[1],
        "nsp_loss": parts[2],
        **({"simreg_loss": parts[3]} if cfg.loss.simreg_weight else {}),
        "lr": got["lr"],
        "grad_norm": got["grad_norm"],
        "seq_per_s": throughput[0],
        "tokens_per_s": throughput[1],
        "skipped_steps": state.skipped,
        **got["adagc"],
        **({"corrupt_samples": state.corrupt_samples} if cfg.data.on_corrupt == "skip" else {}),
    }
    if rebalance is not None:
        rec["rebalance"] = {k: getattr(rebalance, k) for k in REBALANCE_FIELDS} | rebalance.fit
    return rec


def nonfinite_abort(progress: Progress, state: TrainState, limit: int) -> str | None:
    """ "aborted" (with the error line) when ``state`` has ``limit`` non-finite steps in a row, else None."""
    if state.nonfinite_in_row < limit:
        return None
    progress.message(
        f"error: {state.nonfinite_in_row} non-finite losses in a row at step {state.step}; stopping (status aborted)"
    )
    return "aborted"


def report_eval(metrics: MetricsWriter, progress: Progress, state: TrainState, target: float) -> None:
    """The evaluation just run (``state.eval_accuracy``): a metrics record and a progress line."""
    acc = state.eval_accuracy
    metrics.write({"step": state.step, "samples": state.samples, "eval_accuracy": acc})
    progress.message(
        f"eval  step {state.step:>6}  samples {state.samples:>9}  masked-LM accuracy {acc:.4f}  (target {target})"
    )


def checkpoint_failed(progress: Progress, step: int, error: str, directory: str, checkpoint: CheckpointSection) -> None:
    """Rank 0: a checkpoint that could not be written, the one kept instead, what happens next."""
    kept = list_checkpoints(directory)
    previous = os.path.basename(kept[-1][1]) if kept else "none"
    action = "continuing" if checkpoint.on_error == "continue" else "stopping"
    progress.message(
        f"error: step {step}: {error}; the previous checkpoint ({previous}) is kept; "
        f"{action} (checkpoint.on_error={checkpoint.on_error})"
    )


def log_run_stop(mllog: MLPerfLogger, samples: int, eval_samples: int, status: str) -> None:
    """The MLPerf log's end: the block and epoch closed, samples trained and evaluated, run_stop."""
    if "block" in mllog._open:
        mllog.block_stop(samples)
    mllog.epoch_stop(samples)
    mllog.train_samples(samples)
    mllog.eval_samples(eval_samples)
    mllog.run_stop(samples, status)
    mllog.close()


def summary(
    state: TrainState, status: str, time_to_train: float, world_size: int, records: list[dict], error: str | None
) -> dict:
    """summary.json's content (docs/training.md, "Outputs")."""
    return {
        "status": status,
        "steps": state.step,
        "samples": state.samples,
        "train_seconds": state.train_seconds,
        "seq_per_s": state.samples / max(state.train_seconds, 1e-9),
        "tokens_per_s": state.tokens / max(state.train_seconds, 1e-9),
        "eval_accuracy": state.eval_accuracy,
        "time_to_train_s": time_to_train,
        "skipped_steps": state.skipped,
        "world_size": world_size,
        "corrupt_samples_skipped": state.corrupt_samples,
        "checkpoint_failures": state.checkpoint_failures,
        "loss_spike_score": spike_score([r["loss"] for r in records if "loss" in r]),
        "grad_norm_spike_score": spike_score([r["grad_norm"] for r in records if "grad_norm" in r]),
        **({"error": error} if error else {}),
    }


def interrupted(state: TrainState, saved: bool, error: str | None, progress: Progress) -> dict:
    """A run stopped by SIGTERM at ``state.step``: the line that says how to resume, and its
    short summary (``saved``: its checkpoint was written)."""
    done = "checkpoint saved, rerun with the same --output-dir to resume"
    todo = "rerun with the same --output-dir to resume from the latest checkpoint"
    progress.message(f"stopping at step {state.step} as asked (SIGTERM); {done if saved else todo}")
    return {
        "status": "interrupted",
        "steps": state.step,
        "samples": state.samples,
        **({"error": error} if error else {}),
    }


def publish_summary(summary: dict, output_dir: str, metrics: MetricsWriter, progress: Progress, plot: bool) -> None:
    """Rank 0: OUTPUT_DIR/summary.json, curves.png (log.plot) and the table on stdout."""
    path = os.path.join(output_dir, "summary.json")
    with writing(path):
        write_text(path, json.dumps(summary, indent=2) + "\n")
    if plot:
        plot_curves(metrics.records, os.path.join(output_dir, "curves.png"))
    progress.message("\nsummary\n" + summary_table(summary))
