"""log.tensorboard: the events a run writes, read back with TensorBoard's own reader,
for a whole run and for one killed after its last checkpoint and resumed."""

import pytest

from bert.config import load_config
from bert.train.trainer import Trainer
from launch.distributed import init_distributed
from tests.bert.train.test_trainer import dataset, overrides, run_in_process  # noqa: F401 (dataset is a fixture)

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

RUN = [
    "log.tensorboard=true",
    "optim.clip=adagc",
    "optim.adagc.warmup_steps=2",
    "loss.simreg_weight=0.1",
    "model.overrides.hidden_dropout_prob=0.1",
]
TAGS = {
    "loss/total",
    "loss/mlm",
    "loss/nsp",
    "loss/simreg",
    "optim/lr",
    "optim/grad_norm",
    "adagc/clipped_share",
    "adagc/clip_ratio",
    "throughput/seq_per_s",
    "throughput/tokens_per_s",
    "train/samples",
    "train/skipped_steps",
    "spikes/loss_score",
    "spikes/grad_norm_score",
    "eval/mlm_accuracy",
}
TIMING = {"throughput/seq_per_s", "throughput/tokens_per_s"}


class Killed(Exception):
    pass


def run_killed_at(dataset, out_dir, step, *extra):  # noqa: F811
    """A run that dies (no clean stop, no summary) while computing ``step``."""
    trainer = Trainer(load_config(None, overrides(dataset, *extra)), str(out_dir), init_distributed(backend="gloo"))
    train_step = trainer.train_step

    def dying(block):
        if trainer.state.step + 1 == step:
            raise Killed
        return train_step(block)

    trainer.train_step = dying
    with pytest.raises(Killed):
        trainer.train()


def read_events(out_dir):
    acc = EventAccumulator(str(out_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return scalars, acc.Tags()["tensors"]


def test_events_are_written_and_a_resumed_run_continues_the_curves(dataset, tmp_path):  # noqa: F811
    whole = tmp_path / "whole"
    run_in_process(dataset, whole, "train.max_steps=6", *RUN)
    scalars, tensors = read_events(whole)
    assert TAGS <= set(scalars), TAGS - set(scalars)
    assert any(t.startswith("config") for t in tensors)
    for tag in TAGS - {"eval/mlm_accuracy"}:
        assert [s for s, _ in scalars[tag]] == [1, 2, 3, 4, 5, 6], tag
    assert [s for s, _ in scalars["eval/mlm_accuracy"]] == [4, 6]  # every 32 samples and at the end
    assert [v for _, v in scalars["train/samples"]] == [8, 16, 24, 32, 40, 48]
    share = [v for _, v in scalars["adagc/clipped_share"]]
    assert all(0 <= v <= 1 for v in share)
    assert all(0 < v <= 1 for _, v in scalars["adagc/clip_ratio"])

    # A run killed after logging step 5 past its step-4 checkpoint, then resumed from it:
    # TensorBoard must show every step once (the first run's step 5 purged), with the whole
    # run's values.
    parts = tmp_path / "parts"
    run_killed_at(dataset, parts, 6, "train.max_steps=6", "checkpoint.interval_steps=2", *RUN)
    first, _ = read_events(parts)
    assert [s for s, _ in first["loss/total"]] == [1, 2, 3, 4, 5]
    run_in_process(dataset, parts, "train.max_steps=6", "checkpoint.interval_steps=2", *RUN)
    resumed, tensors = read_events(parts)
    assert len(list((parts / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert sum(t.startswith("config") for t in tensors) == 1
    assert set(resumed) == set(scalars)
    for tag, events in scalars.items():
        assert [s for s, _ in resumed[tag]] == [s for s, _ in events], tag
        if tag not in TIMING:
            assert [v for _, v in resumed[tag]] == pytest.approx([v for _, v in events], rel=1e-5), tag
