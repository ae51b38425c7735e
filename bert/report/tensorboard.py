"""TensorBoard event files for a run (``log.tensorboard: true``): OUTPUT_DIR/tensorboard/.

A sink of ``bert.report.metrics.MetricsWriter`` (rank 0): every ``metrics.jsonl`` record becomes scalars
at its global step; a resumed run purges the steps after its checkpoint and replays the spike counters.
The tags and the resume: [docs/extensions.md](../docs/extensions.md#tensorboard).
"""

from __future__ import annotations

import json
import os

from bert.report.metrics import SpikeCounter
from common.errors import ConfigError

SCALARS = {
    "loss": "loss/total",
    "mlm_loss": "loss/mlm",
    "nsp_loss": "loss/nsp",
    "simreg_loss": "loss/simreg",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "adagc_clipped_share": "adagc/clipped_share",
    "adagc_clip_ratio": "adagc/clip_ratio",
    "seq_per_s": "throughput/seq_per_s",
    "tokens_per_s": "throughput/tokens_per_s",
    "samples": "train/samples",
    "skipped_steps": "train/skipped_steps",
    "corrupt_samples": "data/corrupt_samples",
    "eval_accuracy": "eval/mlm_accuracy",
}


class TensorBoardSink:
    def __init__(self, log_dir: str, config: dict, resume_step: int | None = None, history: list[dict] = ()):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("log.tensorboard: needs the tensorboard package (in requirements.txt)") from None

        self.spikes = {"loss": SpikeCounter(), "grad_norm": SpikeCounter()}
        for record in history:  # the records before the checkpoint, for the running spike scores
            self._count_spikes(record)
        os.makedirs(log_dir, exist_ok=True)
        fresh = resume_step is None or not os.listdir(log_dir)
        self.writer = SummaryWriter(log_dir, purge_step=None if resume_step is None else resume_step + 1, flush_secs=30)
        if fresh:
            text = json.dumps(config, indent=2, sort_keys=True, default=str)
            # Indented: TensorBoard renders text as markdown, and this keeps it verbatim.
            self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)

    def _count_spikes(self, record: dict) -> dict[str, float]:
        return {f"spikes/{k}_score": counter.add(record[k]) for k, counter in self.spikes.items() if k in record}

    def write(self, record: dict) -> None:
        step = record["step"]
        if "eval_accuracy" in record:  # an eval record repeats the step's samples: only the accuracy
            self.writer.add_scalar(SCALARS["eval_accuracy"], record["eval_accuracy"], step)
            return
        scalars = {tag: record[key] for key, tag in SCALARS.items() if key in record}
        scalars |= {f"rebalance/{key}": value for key, value in record.get("rebalance", {}).items()}
        for tag, value in (scalars | self._count_spikes(record)).items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()
