"""A ModernBERT-shaped encoder through the trainer (CPU, the tiny synthetic dataset): masked-LM
only, AdamW with warmup-stable-decay, resume bitwise, and a context-extension phase resumed
from a checkpoint with a new rotary theta and a longer maximum length."""

import json
import os

import pytest

from tests.bert.train.test_trainer import cli, dataset, losses, overrides, run_in_process  # noqa: F401 (dataset is a fixture)

MODERN = [
    "model.preset=modernbert_tiny",
    "model.attention=padded",  # honours the window; sequences of the dataset are longer than 32
    "optim.name=adamw",
    "optim.betas=[0.9,0.98]",
    "optim.weight_decay=1e-5",
    "optim.schedule=wsd",
    "optim.decay_steps=3",
]


def records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_masked_lm_only_with_wsd(dataset, tmp_path):  # noqa: F811
    summary = run_in_process(dataset, tmp_path, *MODERN, "train.max_steps=8")
    assert summary["status"] == "aborted" and summary["steps"] == 8
    steps = [r for r in records(tmp_path) if "loss" in r]
    assert all(r["nsp_loss"] == 0.0 and r["loss"] == r["mlm_loss"] for r in steps)
    # warm-up 2 steps to 1e-3, constant, then one-minus-sqrt over the last 3 updates.
    assert [round(r["lr"], 7) for r in steps] == [0.0, 5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 4.226e-4, 1.835e-4]


def test_resume_is_bitwise_identical(dataset, tmp_path):  # noqa: F811
    dropout = ["model.overrides.hidden_dropout_prob=0.1", "model.overrides.attention_probs_dropout_prob=0.1"]
    run_in_process(dataset, tmp_path / "whole", *MODERN, *dropout, "train.max_steps=6")
    first = run_in_process(dataset, tmp_path / "parts", *MODERN, *dropout, "train.max_steps=6", stop_after=2)
    assert first["status"] == "interrupted" and first["steps"] == 3
    second = run_in_process(dataset, tmp_path / "parts", *MODERN, *dropout, "train.max_steps=6")
    assert second["steps"] == 6
    assert losses(tmp_path / "parts") == losses(tmp_path / "whole")


def test_context_extension_resumes_with_a_new_theta(dataset, tmp_path):  # noqa: F811
    """Phase 2 resumes phase 1's checkpoint with a new global theta and a longer maximum
    length: the weights carry over (the rotary tables follow from the config), and the new
    theta is what the resumed steps use."""
    # Phase 1 stops after 3 steps with a checkpoint (as at a SIGTERM); phase 2 resumes it.
    short = ["data.max_seq_length=64", "train.max_steps=5", "optim.decay_steps=1"]
    for run in ("a", "b"):
        assert run_in_process(dataset, tmp_path / run, *MODERN, *short, stop_after=2)["steps"] == 3
    longer = ["data.max_seq_length=128", "train.max_steps=5", "optim.decay_steps=1"]
    run_in_process(dataset, tmp_path / "a", *MODERN, *longer, "model.overrides.rope_theta_global=160000")
    run_in_process(dataset, tmp_path / "b", *MODERN, *longer)
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == len(b) == 5
    assert a[:3] == b[:3]  # phase 1 is the same run
    assert a[3] != b[3]  # the first resumed step already sees the new theta


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.attention=torch_varlen", "the model has local (sliding-window) layers; model.attention=torch_varlen"),
        ("model.overrides.rope_theta_global=-1", "model.overrides.rope_theta_global: must be a positive number"),
        ("model.preset=modernbert_huge", "model.preset: 'modernbert_huge' is not one of"),
    ],
)
def test_bad_config_is_one_line(dataset, tmp_path, override, message):  # noqa: F811
    r = cli("--output-dir", str(tmp_path / "out"), *overrides(dataset, *MODERN, "train.max_steps=2", override))
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.multiprocess
@pytest.mark.slow  # torchrun, 2 ranks
def test_two_ranks_match_one_rank(dataset, tmp_path):  # noqa: F811
    from tests.bert.train.test_trainer_distributed import STEPS, launch

    run_in_process(dataset, tmp_path / "one", *STEPS, *MODERN)
    launch("run_torchrun.sh", 2, tmp_path / "two", dataset, *MODERN, "data.rebalance=balanced")
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == len(two) == 5
    assert two == pytest.approx(one, rel=1e-5)
