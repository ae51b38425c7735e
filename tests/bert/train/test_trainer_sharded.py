"""optim.shard end to end: the trainer under torchrun at 2 and 4 gloo ranks against one process.

20 steps of the tiny BERT, fp32, dropout off, global-norm clipping at a threshold the
gradients cross (so clipping acts). Sharded runs must give the per-step losses of the same
global batch trained unsharded in this process within 1e-6 (relative: fp32 rounds a loss of
~4.6 to 5e-7, and the shards' sums of squares are added in another order than whole-tensor
norms; 4 unsharded ranks were 1.8e-7 from one process when measured), a group of 2 inside 4 ranks too;
a sharded run's checkpoint of step 10 (its tensors gathered whole into one file) resumes on 2
ranks (sharded) and on 1 rank (unsharded) with the uninterrupted run's losses for steps 11-20,
and exports to transformers.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.bert.train.test_trainer import ROOT, TINY, losses, run_in_process
from tests.helpers import PYTHON, run_launched

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

CONFIG = os.path.join(ROOT, "launch", "configs", "cpu_demo.yaml")
STEPS = [
    "train.max_steps=20",
    "train.global_batch_size=8",
    "optim.lr=5e-3",
    "optim.max_grad_norm=0.5",
    "eval.interval_samples=100000",
    "checkpoint.interval_steps=10",
]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from tests.batches import write_dataset

    return write_dataset(str(tmp_path_factory.mktemp("data")))


def train(ranks: int, out, dataset, *extra, timeout: float = 400) -> list[float]:
    train_dir, eval_file = dataset
    args = [os.path.join(ROOT, "launch", "run_torchrun.sh"), "1", str(ranks), CONFIG, str(out)]
    args += [*TINY, *STEPS, f"data.train_dir={train_dir}", f"data.eval_file={eval_file}", *extra]
    run_launched(args, timeout, what=f"{ranks} ranks {' '.join(extra)}")
    return losses(out)


def one_process(out, dataset, *extra) -> list[float]:
    """The reference: the same run unsharded, in this process (one rank, the whole global batch)."""
    run_in_process(dataset, out, *STEPS, *extra, "optim.shard=none")
    return losses(out)


def records(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory):
    """One process, unsharded (the reference), and 4 ranks sharded over all 4 and in groups of 2."""
    path = tmp_path_factory.mktemp("one")
    out = {"none": (path, one_process(path, dataset))}
    for name, shard in (("dp", "dp"), ("2", "2")):
        path = tmp_path_factory.mktemp(f"four-{name}")
        out[name] = (path, train(4, path, dataset, f"optim.shard={shard}"))
    return out


@pytest.mark.parametrize("shard", ["dp", "2"])
def test_four_ranks_sharded_match_unsharded(runs, shard):
    ref, got = runs["none"][1], runs[shard][1]
    assert len(ref) == len(got) == 20
    assert got == pytest.approx(ref, rel=1e-6, abs=0)
    grad = [r["grad_norm"] for r in records(runs["none"][0])]
    assert max(grad) > 0.5  # clipping acted


def test_two_ranks_adagc_and_grad_accum_match_unsharded(dataset, tmp_path):
    extra = [
        "optim.clip=adagc",
        "optim.adagc.warmup_steps=5",
        "train.grad_accum_steps=2",
        "checkpoint.interval_steps=0",
    ]
    ref = one_process(tmp_path / "none", dataset, *extra)
    got = train(2, tmp_path / "dp", dataset, *extra, "optim.shard=dp")
    assert len(ref) == len(got) == 20
    assert got == pytest.approx(ref, rel=1e-6, abs=0)
    clipped = [r.get("adagc_clipped_share", 0) for r in records(tmp_path / "none")]
    assert max(clipped) > 0  # AdaGC's per-tensor clipping acted


@pytest.fixture(scope="module")
def stopped_at_10(dataset, tmp_path_factory):
    """The 4-rank sharded run asked to stop after step 10 (as SIGTERM does): its directory."""
    from tests.faults.common import spawn_ranks

    out, logs = tmp_path_factory.mktemp("stopped"), tmp_path_factory.mktemp("stopped-logs")
    jobs = spawn_ranks(4, out, dataset, *STEPS, "optim.shard=dp", log_dir=str(logs), FAULT_STOP_AT_STEP=10)
    for job in jobs:
        assert job.wait(400, "a rank of the run stopped at step 10") == 0, job.output()[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000010.pt"]
    return out


@pytest.mark.parametrize("ranks, shard", [(2, "dp"), (1, "none")])
def test_a_sharded_checkpoint_resumes_at_another_world_size(runs, stopped_at_10, dataset, tmp_path, ranks, shard):
    """Step 10 of a 4-rank sharded run, resumed on 2 ranks sharded and on 1 rank unsharded:
    steps 11-20 are the uninterrupted 4-rank run's."""
    out = tmp_path / "run"
    shutil.copytree(stopped_at_10, out)
    resumed = train(ranks, out, dataset, f"optim.shard={shard}")
    steps = [r["step"] for r in records(out)]
    assert steps == list(range(1, 21))  # the records of steps 1-10 are the stopped run's
    uninterrupted = runs["dp"][1]
    assert resumed[:10] == pytest.approx(uninterrupted[:10], rel=1e-6, abs=0)
    assert resumed[10:] == pytest.approx(uninterrupted[10:], rel=1e-6, abs=0)


def test_export_from_a_sharded_checkpoint(runs, tmp_path):
    """The sharded run's step-10 checkpoint exports the weights the unsharded run's has."""
    from safetensors.torch import load_file

    from tests.bert.checkpoint.test_export import write_vocab

    vocab = write_vocab(tmp_path / "vocab.txt")
    exported = {}
    for name in ("dp", "none"):
        out = tmp_path / name
        cmd = [PYTHON, "-m", "bert.checkpoint.export", str(runs[name][0]), "--output", str(out), "--checkpoint", "10"]
        cmd += ["--vocab", str(vocab)]
        run_launched(cmd, 120, what="bert.checkpoint.export")
        exported[name] = load_file(str(out / "model.safetensors"))
    assert exported["dp"].keys() == exported["none"].keys()
    for key, value in exported["none"].items():
        torch.testing.assert_close(exported["dp"][key], value, rtol=1e-5, atol=1e-6)
    from transformers import BertForPreTraining

    model = BertForPreTraining.from_pretrained(str(tmp_path / "dp"))
    assert model.config.vocab_size == 96


def test_two_ranks_bf16_compute_weights_and_bf16_reduction(dataset, tmp_path):
    """train.precision=bf16: FSDP2 gathers bf16 copies of the fp32 masters (the unsharded run
    autocasts instead) and optim.reduce_dtype=bf16 reduce-scatters bf16 gradients; the losses
    follow the one-process bf16 run's to bf16's rounding, and the masters stay fp32."""
    extra = ["train.precision=bf16", "train.max_steps=10", "checkpoint.interval_steps=10"]
    ref = one_process(tmp_path / "none", dataset, *extra)
    got = train(2, tmp_path / "dp", dataset, *extra, "optim.shard=dp", "optim.reduce_dtype=bf16")
    assert len(got) == len(ref) == 10
    assert got == pytest.approx(ref, rel=2e-3)
    from bert.checkpoint.training import read

    saved = read(str(tmp_path / "dp" / "checkpoints" / "step_00000010.pt"))
    moments = [t for m in saved["optimizer"]["state"].values() for t in m.values()]
    assert {t.dtype for t in [*saved["model"].values(), *moments]} == {torch.float32}
