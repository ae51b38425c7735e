"""What the trainer reports: hyper-parameters to the MLPerf log, a record per logged step,
and the run's summary (summary.json, the table printed at the end, curves.png).

The trainer calls these at initialisation, every ``train.log_interval_steps`` and at the end;
none of them runs on a step that does not log. The files and lines themselves are written
by ``bert.metrics`` and ``bert.mlperf_log``.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from bert import fp8
from bert.clipping import ClipStats
from bert.metrics import MetricsWriter, Progress, plot_curves, spike_score, summary_table
from bert.train_checkpoint import list_checkpoints
from bert.train_config import CheckpointSection, RunConfig
from bert.train_state import TrainState
from fileio import write_text

if TYPE_CHECKING:  # mlperf_logging is optional: imported only where the MLPerf log is written
    from bert.mlperf_log import MLPerfLogger

# The rebalancer's numbers a step record carries (data.rebalance.ExchangeStats fields).
REBALANCE_FIELDS = (
    "imbalance_before",
    "imbalance_after",
    "samples_moved",
    "samples_sent",
    "exchange_ms",
    "wait_ms",
    "hidden_fraction",
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


def step_record(
    cfg: RunConfig,
    state: TrainState,
    parts: list[float],
    lr: float,
    grad_norm: float,
    throughput: tuple[float, float],
    clip_stats: ClipStats | None,
    rebalance,
) -> dict:
    """One metrics.jsonl record: ``parts`` the all-reduced [loss, mlm, nsp, simreg] of the
    step, ``throughput`` (sequences/s, tokens/s) since the last record, ``rebalance`` the
    rebalancer's stats of the step or None. Reads AdaGC's device tensors (a sync)."""
    rec = {
        "step": state.step,
        "samples": state.samples,
        "loss": parts[0],
        "mlm_loss": parts[1],
        "nsp_loss": parts[2],
        **({"simreg_loss": parts[3]} if cfg.loss.simreg_weight else {}),
        "lr": lr,
        "grad_norm": grad_norm,
        "seq_per_s": throughput[0],
        "tokens_per_s": throughput[1],
        "skipped_steps": state.skipped,
        **adagc_record(clip_stats),
        **({"corrupt_samples": state.corrupt_samples} if cfg.data.on_corrupt == "skip" else {}),
    }
    if rebalance is not None:
        rec["rebalance"] = {k: getattr(rebalance, k) for k in REBALANCE_FIELDS}
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


def adagc_record(clip_stats: ClipStats | None) -> dict:
    """The last AdaGC step's share of clipped tensors and mean clip factor (for the logs)."""
    c = clip_stats
    if c is None or not c.num_tensors:
        return {}
    return {"adagc_clipped_share": int(c.num_clipped) / c.num_tensors, "adagc_clip_ratio": float(c.clip_ratio)}


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
    progress.message(
        f"stopping at step {state.step} as asked (SIGTERM); "
        + (
            "checkpoint saved, rerun with the same --output-dir to resume"
            if saved
            else "rerun with the same --output-dir to resume from the latest checkpoint"
        )
    )
    return {
        "status": "interrupted",
        "steps": state.step,
        "samples": state.samples,
        **({"error": error} if error else {}),
    }


def publish_summary(summary: dict, output_dir: str, metrics: MetricsWriter, progress: Progress, plot: bool) -> None:
    """Rank 0: OUTPUT_DIR/summary.json, curves.png (log.plot) and the table on stdout."""
    write_text(os.path.join(output_dir, "summary.json"), json.dumps(summary, indent=2) + "\n")
    if plot:
        plot_curves(metrics.records, os.path.join(output_dir, "curves.png"))
    progress.message("\nsummary\n" + summary_table(summary))
