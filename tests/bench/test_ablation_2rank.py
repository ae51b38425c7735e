"""AdaGC and SimReg both on: 2 CPU ranks (gloo, torchrun) train exactly what 1 rank trains.

Both features normalise or clip with global quantities (SimReg divides by the all-reduced
anchor count; AdaGC clips the gradients DDP has already averaged), so a rank-local mistake
shows up as a difference between the runs. fp32, dropout off, 1e-5 relative.
"""

import json

import pytest

import tests.bert.train.test_trainer_distributed as distributed
from tests.bert.train.test_trainer import losses, run_in_process

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

# AdaGC's warm-up ends after step 2, so steps 3-5 clip per tensor; the spike at step 4 makes
# sure some tensor is clipped. SimReg over all tokens: the random tiny vocabulary repeats
# tokens within a sequence, so every step has anchors.
FEATURES = [
    "optim.clip=adagc",
    "optim.adagc.warmup_steps=2",
    "debug.spike_steps=[4]",
    "debug.spike_params=[layers.0.]",
    "debug.spike_factor=1000",
    "loss.simreg_weight=0.5",
    "loss.simreg_scope=all",
]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from tests.batches import write_dataset

    return write_dataset(str(tmp_path_factory.mktemp("data")), seed=7)


def records(out_dir):
    with open(out_dir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def test_two_ranks_with_adagc_and_simreg_match_one_rank(dataset, tmp_path, monkeypatch):
    one, two = tmp_path / "one", tmp_path / "two"
    steps = distributed.STEPS + FEATURES  # 5 steps of 8 sequences, with both features
    run_in_process(dataset, one, *steps)
    # The shared launcher passes its module's STEPS to every rank: extend them for this run.
    monkeypatch.setattr(distributed, "STEPS", steps)
    distributed.launch("run_torchrun.sh", 2, two, dataset, timeout=120)
    a, b = records(one), records(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5]
    assert all(r["simreg_loss"] > 0 for r in a)  # SimReg is on and has anchors
    assert a[3]["grad_norm"] > 10 * a[2]["grad_norm"]  # the spike reached the clipper
    for key in ("loss", "mlm_loss", "nsp_loss", "simreg_loss", "grad_norm"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-5), key
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["samples"] == 40
