"""2 CPU ranks (gloo) under torchrun and under mpirun train exactly what 1 rank trains."""

import json
import os

import pytest

from tests.bert.train.test_trainer import ROOT, TINY, losses, run_in_process
from tests.helpers import run_launched

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

CONFIG = os.path.join(ROOT, "launch", "configs", "cpu_demo.yaml")
STEPS = ["train.max_steps=5", "train.global_batch_size=8"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from tests.batches import write_dataset

    return write_dataset(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def single_rank(dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    run_in_process(dataset, out, *STEPS)
    return losses(out)


def launch(script, ranks, out, dataset, *extra, timeout=240):
    train, eval_file = dataset
    args = [
        os.path.join(ROOT, "launch", script),
        *(["1"] if script == "run_torchrun.sh" else []),
        str(ranks),
        CONFIG,
        str(out),
        *TINY,
        *STEPS,
        f"data.train_dir={train}",
        f"data.eval_file={eval_file}",
        *extra,
    ]
    # The in-process single-rank run exported RANK/WORLD_SIZE (torchrun's variables, which take
    # precedence over MPI's): the launched ranks must not inherit them (clean_env).
    output = run_launched(args, timeout, what=script)
    return output


@pytest.mark.parametrize(
    "script, strategy",
    [
        ("run_torchrun.sh", "none"),
        ("run_mpirun.sh", "none"),
        ("run_torchrun.sh", "measured"),  # balanced with measured speeds: the same global batch
        ("run_mpirun.sh", "balanced"),
    ],
)
def test_two_ranks_match_one_rank(script, strategy, dataset, single_rank, tmp_path):
    """Rebalancing moves samples between ranks; the global batch and so the loss stay the same."""
    launch(script, 2, tmp_path, dataset, f"data.rebalance={strategy}", "data.rebalance_measured=[2,4,0.5,2]")
    two = losses(tmp_path)
    assert len(two) == len(single_rank) == 5
    assert two == pytest.approx(single_rank, rel=1e-5)
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["world_size"] == 2 and summary["samples"] == 40
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in records if "loss" in r]
    if strategy == "measured":  # speeds and cost fitted from step 3 on (a window of 2 steps)
        assert steps[-1]["rebalance"]["window_steps"] == 2 and 0 < steps[-1]["rebalance"]["speed_min"] <= 1
    if strategy != "none":
        for r in steps:
            rb = r["rebalance"]
            assert rb["imbalance_after"] <= rb["imbalance_before"]
            assert 0.0 <= rb["hidden_fraction"] <= 1.0
        assert any(r["rebalance"]["samples_moved"] > 0 for r in steps)
    else:
        assert all("rebalance" not in r for r in steps)
