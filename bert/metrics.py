"""What a person sees of a run: progress lines, metrics.jsonl, summary.json, curves.png.

Only rank 0 writes. ``MetricsWriter`` appends one JSON object per logged step (and per
evaluation) to ``metrics.jsonl``; on resume it first drops records past the checkpoint's
step, so a resumed run's file equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import sys
import time

from fileio import publishing, write_text


class MetricsWriter:
    def __init__(self, path: str, enabled: bool, resume_step: int | None = None):
        self.path = path
        self.enabled = enabled
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
        with open(self.path, "a", encoding="utf-8") as f:
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
        self.enabled = enabled
        self.total = total_steps
        self.tty = sys.stdout.isatty()
        self.start = time.time()

    def step(self, rec: dict) -> None:
        if not self.enabled:
            return
        line = (
            f"step {rec['step']:>6}  samples {rec['samples']:>9}  loss {rec['loss']:.4f}  "
            f"lr {rec['lr']:.3e}  {rec['seq_per_s']:8.1f} seq/s  {rec['tokens_per_s']:10.0f} tok/s"
        )
        if self.tty:
            frac = min(rec["step"] / self.total, 1.0)
            bar = "#" * int(24 * frac)
            line += f"  [{bar:<24}] {100 * frac:5.1f}%"
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
    for key, label in (
        ("corrupt_samples_skipped", "corrupt samples skipped"),
        ("checkpoint_failures", "checkpoint failures"),
    ):
        if summary.get(key):
            rows.append((label, summary[key]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def plot_curves(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([r["samples"] for r in train], [r["loss"] for r in train])
    ax1.set_xlabel("samples")
    ax1.set_ylabel("training loss (MLM + NSP)")
    ax1.grid(alpha=0.3)
    ax2.plot([r["samples"] for r in evals], [r["eval_accuracy"] for r in evals], marker="o")
    ax2.set_xlabel("samples")
    ax2.set_ylabel("masked-LM accuracy (eval)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    with publishing(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


class SpikeCounter:
    """Running spike score: a value is a spike when it is at least ``sigmas`` standard
    deviations above the mean of the previous ``window`` finite values (a non-finite value
    always is; the first two never are)."""

    def __init__(self, sigmas: float = 7.0, window: int = 1000):
        from collections import deque

        self.sigmas = sigmas
        self.previous: deque = deque(maxlen=window)
        self.count = 0
        self.spikes = 0

    def add(self, value: float) -> bool:
        import numpy as np

        spike = False
        if self.count >= 2:
            prev = np.asarray(self.previous, dtype=np.float64)
            prev = prev[np.isfinite(prev)]
            if len(prev) >= 2:
                mean = prev.mean()
                spike = not np.isfinite(value) or (value > mean and value >= mean + self.sigmas * prev.std())
        self.previous.append(value)
        self.count += 1
        self.spikes += bool(spike)
        return bool(spike)

    @property
    def score(self) -> float:
        """Percentage of the values so far that were spikes."""
        return 100.0 * self.spikes / self.count if self.count else 0.0


def spike_score(values: list[float], sigmas: float = 7.0, window: int = 1000) -> float:
    """Percentage of values at least ``sigmas`` standard deviations above the mean of the
    previous ``window`` values (all previous ones when fewer; the first two are never spikes)."""
    counter = SpikeCounter(sigmas, window)
    for v in values:
        counter.add(v)
    return counter.score
