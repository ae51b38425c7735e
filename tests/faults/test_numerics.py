"""A non-finite gradient (NaN or Inf, injected with debug.nonfinite_steps) skips that update: the
weights, LAMB's moments, the LR schedule and AdaGC's thresholds and step count stay exactly as
they were, and the step is counted. Global-norm clipping and AdaGC (in and after its warm-up)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from bert.config import load_config
from bert.train.trainer import Trainer
from launch.distributed import init_distributed
from tests.faults.common import metrics, run_args

BAD_STEPS = (2, 4)  # with optim.adagc.warmup_steps=3: one in AdaGC's warm-up, one after it


def snapshot(trainer: Trainer) -> dict:
    return copy.deepcopy(
        {
            "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict(),
            "schedule": trainer.schedule.state_dict(),
            "adagc": trainer.adagc.state_dict() if trainer.adagc else None,
        }
    )


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("clip", ["global", "adagc"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_gradient_skips_the_update_and_leaves_the_state(dataset, tmp_path, clip, value):
    cfg = load_config(
        None,
        run_args(
            dataset,
            "train.max_steps=6",
            f"optim.clip={clip}",
            "optim.adagc.warmup_steps=3",
            f"debug.nonfinite_steps={list(BAD_STEPS)}",
            f"debug.nonfinite_value={value}",
        ),
    )
    trainer = Trainer(cfg, str(tmp_path), init_distributed(backend="gloo"))
    seen = {}
    optimizer_step = trainer.optimizer_step

    def watched():
        step = trainer.state.step + 1
        before = snapshot(trainer)
        applied, norm = optimizer_step()
        seen[step] = (applied, norm, same(before, snapshot(trainer)))
        return applied, norm

    trainer.optimizer_step = watched
    summary = trainer.train()
    for step, (applied, norm, unchanged) in seen.items():
        if step in BAD_STEPS:
            assert not applied and not math.isfinite(norm) and unchanged, step
        else:
            assert applied and math.isfinite(norm) and not unchanged, step  # a real step does change the state
    assert summary["skipped_steps"] == len(BAD_STEPS) and summary["steps"] == 6
    counts = {r["step"]: r["skipped_steps"] for r in metrics(tmp_path) if "loss" in r}
    assert counts == {1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 2}
    if clip == "adagc":
        assert trainer.adagc.step == 6 - len(BAD_STEPS)  # skipped steps do not advance AdaGC's warm-up
