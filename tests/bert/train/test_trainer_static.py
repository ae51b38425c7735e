"""train.static_shapes end to end: the same losses as dynamic shapes, few shapes; eval on the device."""

from __future__ import annotations

import json

import pytest
import torch

from bert.config import load_config
from bert.train.trainer import Trainer
from launch.distributed import init_distributed
from tests.bert.train.test_trainer import losses, overrides, run_in_process

LONG = ["train.max_steps=100", "eval.interval_samples=100000", "model.attention=padded", "checkpoint.at_end=false"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from tests.batches import write_dataset

    return write_dataset(str(tmp_path_factory.mktemp("data")))


@pytest.mark.slow  # two 100-step runs
def test_static_shapes_train_the_same_losses_over_100_steps(dataset, tmp_path):
    """fp32, dropout off (TINY): every step's loss within 1e-6 of the dynamic run's; at most 16
    shapes (docs/step.md: about 8 sigma sqrt(B) / bucket + 1, here 4 of 64 tokens)."""
    dynamic = run_in_process(dataset, tmp_path / "dynamic", *LONG)
    static = run_in_process(dataset, tmp_path / "static", *LONG, "train.static_shapes=true")
    a, b = losses(tmp_path / "dynamic"), losses(tmp_path / "static")
    assert len(a) == len(b) == 100
    worst = max(abs(x - y) / max(1.0, abs(x)) for x, y in zip(a, b))
    assert worst <= 1e-6, worst
    assert a[-1] < a[0] - 0.1  # it trained: the comparison covers moving weights
    assert static["distinct_shapes"] <= 16 < dynamic["distinct_shapes"]
    assert static["eval_accuracy"] == pytest.approx(dynamic["eval_accuracy"], abs=1e-9)


@torch.no_grad()
def todays_evaluation(trainer) -> float:
    """The evaluation loop as it was written before bert.train.evaluate: batch by batch from the loader."""
    trainer.model.eval()
    correct = total = 0
    for block in trainer.eval_loader:
        batch = trainer._collate(block)
        out = trainer.model(batch)
        correct += int((out.mlm_logits.argmax(-1) == batch.mlm_labels).sum())
        total += batch.mlm_labels.numel()
    return float(correct) / max(total, 1)


def test_eval_on_the_device_gives_todays_accuracy_bitwise(dataset, tmp_path):
    accuracies = []
    for cached in ("false", "true"):
        extra = ["train.max_steps=3", f"eval.cache_on_device={cached}", "eval.interval_samples=8"]
        trainer = Trainer(
            load_config(None, overrides(dataset, *extra)), str(tmp_path / cached), init_distributed(backend="gloo")
        )
        trainer.train()
        records = [json.loads(line) for line in open(tmp_path / cached / "metrics.jsonl")]
        accuracies.append([r["eval_accuracy"] for r in records if "eval_accuracy" in r])
        if cached == "true":
            assert trainer.eval_batches.cached is not None and trainer.eval_batches.cached.nbytes > 0
            assert trainer.evaluate() == accuracies[-1][-1]  # the cache serves a later evaluation too
            assert todays_evaluation(trainer) == accuracies[-1][-1]
    assert accuracies[0] == accuracies[1] and len(accuracies[0]) == 3
