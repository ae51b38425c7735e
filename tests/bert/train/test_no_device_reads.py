"""A steady-state training step reads nothing back from the device (tools.device_reads).

Counted from the start of ``train_step`` to the end of ``optimizer_step`` on the CPU: every
``.item()``/``float()``/``int()``/``bool()`` of any tensor, every ``.tolist()``/``.cpu()``/
``.numpy()`` of a device tensor, and every op sized by a device tensor's values
(``tests/tools/test_device_reads.py`` shows each is caught). The code before the no-read step
read 7 times per step here (its counts' ``.cpu()`` and six ``int()``, the gradient norm's
``float()``): docs/step.md gives the command that counts it.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from bert.config import load_config
from bert.train.trainer import Trainer
from launch.distributed import init_distributed
from tests.bert.train.device_reads_worker import instrument
from tests.bert.train.test_trainer import ROOT, overrides, tiny_triton_dropout
from tests.helpers import free_port, run_launched

# Steady state: steps 3..6 log nothing (only step 1 does) and evaluate nothing.
STEADY = [
    "train.max_steps=6",
    "train.log_interval_steps=100",
    "eval.interval_samples=1000000",
    "train.grad_accum_steps=2",
    "model.attention=padded",
    "checkpoint.at_end=false",
]
FIRST = 3


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from tests.batches import write_dataset

    return write_dataset(str(tmp_path_factory.mktemp("data")))


@pytest.mark.parametrize(
    "clip, static, simreg",
    [
        ("global", False, 0),
        ("adagc", True, 0),
        pytest.param("adagc", False, 0, marks=pytest.mark.slow),
        pytest.param("global", True, 0, marks=pytest.mark.slow),
        pytest.param("global", True, 0.1, marks=pytest.mark.slow),
    ],
)
def test_a_steady_state_step_reads_nothing(dataset, tmp_path, clip, static, simreg):
    extra = [*STEADY, f"optim.clip={clip}", "optim.adagc.warmup_steps=4", f"train.static_shapes={str(static).lower()}"]
    extra.append(f"loss.simreg_weight={simreg}")
    trainer = Trainer(load_config(None, overrides(dataset, *extra)), str(tmp_path), init_distributed(backend="gloo"))
    seen = instrument(trainer, FIRST)
    summary = trainer.train()
    assert sorted(seen) == [3, 4, 5, 6] and summary["steps"] == 6
    assert all(counts[0] == 0 for counts in seen.values()), seen
    if static:
        assert 1 <= summary["distinct_shapes"] <= 4  # two micro-batches a step, few buckets


@pytest.mark.parametrize(
    "attention, fused",
    [("triton_grouped", False), ("triton", True)],
)
def test_a_step_of_the_triton_kernels_with_dropout_reads_nothing(tmp_path, attention, fused):
    """The kernels' dropout (seed, offset) is a device pair they load themselves: no
    ``.tolist()`` of it, and both backends take the lengths from the host (the code before
    read 2 times a step here with triton_grouped, the backward's seed, and 4 with triton, also
    its max_seqlen check's cu_seqlens). One layer, sequences of at most 16 tokens; step 2."""
    extra = [*tiny_triton_dropout(tmp_path, seq_len=16), f"model.attention={attention}"]
    extra += [*STEADY[1:3], "train.grad_accum_steps=2", "checkpoint.at_end=false"]
    if fused:
        extra += ["model.fused_ops=true", "model.overrides.hidden_dropout_prob=0.1"]
    trainer = Trainer(load_config(None, extra), str(tmp_path), init_distributed(backend="gloo"))
    seen = instrument(trainer, 2)
    assert trainer.train()["steps"] == 2 and sorted(seen) == [2]
    assert seen[2][0] == 0, seen
    # Step 2's draws: per micro-batch (2) the attention, and both fused ops of the layer.
    assert trainer.philox.tolist()[1] == 2 * (3 if fused else 1)


@pytest.mark.multiprocess
@pytest.mark.slow  # two ranks under torchrun
def test_two_ranks_with_rebalancing_read_nothing(dataset, tmp_path):
    out = tmp_path / "reads.json"
    args = [*overrides(dataset, *STEADY, "data.rebalance=balanced", "optim.clip=adagc")]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(ROOT, "tests", "bert", "train", "device_reads_worker.py"),
        str(out),
        str(tmp_path / "run"),
        str(FIRST),
        *args,
    ]
    run_launched(cmd, timeout=240, what="device_reads_worker")
    seen = json.loads(out.read_text())
    assert sorted(map(int, seen)) == [3, 4, 5, 6]
    assert all(counts[0] == 0 for counts in seen.values()), seen
