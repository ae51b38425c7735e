"""2 CPU ranks, rank 1 about half as fast, ``data.rebalance=measured`` on demo-corpus lengths.

The ranks' speeds are set by tests/faults/fault_worker.py's ``FAULT_SLEEP_PER_TOKEN``: each rank's
forward+backward sleeps 0.2 ms (rank 0) or 0.4 ms (rank 1) per token, inside the interval the trainer's
``bert.train.step_timer`` measures, so the time hardly depends on the machine's load and the whole path runs
for real: the timer, the fit, the plan, the exchange and micro-batches of another size on each rank.
70% of the lengths are the maximum (the demo corpus's histogram,
tests/data/rebalance/demo_corpus_lengths.json): swaps alone left the slow rank 0.74 of the fast one's
tokens (issue 46); moving samples one way gives it its fitted speed's share. The losses are the
single-rank run's: the same global batch, placed differently.
"""

import json

import numpy as np
import pytest

from tests.batches import write_fixed_file
from tests.bert.train.test_trainer import ROOT, TINY, losses, run_in_process
from tests.data.rebalance.test_plan_real_lengths import demo_corpus_pool
from tests.faults.common import WORKER
from tests.helpers import clean_env, run_launched

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

SEQ = 128
STEPS = 12
SETTINGS = [
    f"data.max_seq_length={SEQ}",
    "train.global_batch_size=32",
    f"train.max_steps={STEPS}",
    "eval.interval_samples=100000000",
    "checkpoint.at_end=false",
]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-lengths")
    rng = np.random.default_rng(46)
    pool = demo_corpus_pool()
    (root / "train").mkdir()
    (root / "eval").mkdir()
    for i in range(4):
        write_fixed_file(root / "train" / f"part_{i:05d}_of_00004.hdf5", rng.choice(pool, 400), 96, SEQ, seed=i)
    eval_file = root / "eval" / "part_eval_10k.hdf5"
    write_fixed_file(eval_file, rng.choice(pool, 16), 96, SEQ, seed=9)
    return str(root / "train"), str(eval_file)


def test_slow_rank_gets_its_share_of_the_tokens(dataset, tmp_path):
    train, eval_file = dataset
    data = [f"data.train_dir={train}", f"data.eval_file={eval_file}"]
    args = [f"{ROOT}/launch/run_torchrun.sh", "1", "2", f"{ROOT}/launch/configs/cpu_demo.yaml", str(tmp_path / "two")]
    measured = ["data.rebalance=measured", "data.rebalance_measured=[6,4,0.25,2]"]
    env = clean_env(TRAIN_SCRIPT=WORKER, FAULT_SLEEP_PER_TOKEN="2e-4,4e-4")
    run_launched([*args, *TINY, *SETTINGS, *data, *measured], 240, env=env, what="run_torchrun.sh")
    records = [json.loads(line) for line in open(tmp_path / "two" / "metrics.jsonl")]
    late = [r["rebalance"] for r in records if "loss" in r][-3:]  # the fit has settled
    # rank 0's tokens over the mean rank's: 2 ranks, rank 1 holds 2 - share
    ratio = float(np.median([2 / r["token_share"] - 1 for r in late]))
    speeds = float(np.median([r["speed_min"] / r["speed_max"] for r in late]))
    assert 0.4 <= speeds <= 0.65, late[-1]
    assert ratio == pytest.approx(speeds, rel=0.10), (ratio, speeds)  # the tokens follow the fitted speeds
    assert float(np.median([r["imbalance_after"] for r in late])) <= 1.05, late[-1]
    # the same global batch, placed differently: the single-rank run's losses
    run_in_process((train, eval_file), tmp_path / "one", *SETTINGS)
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
