"""dist.context_parallel=[2,40] through the trainer: 2 ranks with every sequence above 40 tokens split
across them train as one rank does (the same losses), a checkpoint written under it resumes with
context parallelism off, and the combinations that cannot split a document are refused in one
line when the configuration loads."""

from __future__ import annotations

import pytest

from bert.config import load_config
from common.errors import ConfigError
from tests.bert.train.test_trainer import dataset, losses, run_in_process  # noqa: F401 (dataset is a fixture)

CP = ["model.attention=reference"]


@pytest.mark.multiprocess
@pytest.mark.slow  # torchrun, 2 ranks, twice
def test_two_context_parallel_ranks_train_as_one_rank_and_resume_without_it(dataset, tmp_path):  # noqa: F811
    """Steps 1-3 at N = 2 with a checkpoint at step 3, steps 4-5 resumed from it at N = 1 (CP off):
    the five losses are one rank's."""
    from tests.bert.train.test_trainer_distributed import STEPS
    from tests.faults.common import spawn_ranks

    run_in_process(dataset, tmp_path / "one", *STEPS, *CP)
    two, logs = tmp_path / "two", tmp_path / "logs"
    logs.mkdir()
    common = (*STEPS, *CP, "data.rebalance=none", "checkpoint.interval_steps=100")
    # Asked to stop after step 3 (what SIGTERM does): it checkpoints step 3 and exits.
    jobs = spawn_ranks(
        2, two, dataset, *common, "dist.context_parallel=[2,40]", log_dir=str(logs), FAULT_STOP_AT_STEP=3
    )
    for job in jobs:
        assert job.wait(300, "a CP rank asked to stop after step 3") == 0, job.output()[-3000:]
    assert len(losses(two)) == 3
    for job in spawn_ranks(2, two, dataset, *common, log_dir=str(logs)):
        assert job.wait(300, "a rank resumed with CP off") == 0, job.output()[-3000:]
    one, resumed = losses(tmp_path / "one"), losses(two)
    assert len(one) == len(resumed) == 5
    assert resumed == pytest.approx(one, rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow  # torchrun, 2 ranks
def test_context_parallel_ranks_rebalanced_with_the_sharded_optimizer_train_as_one_rank(dataset, tmp_path):  # noqa: F811
    """N = 2 with data.rebalance=balanced (the exchange carries out place_context: long samples to
    the group, short ones to a rank each) and optim.shard=dp (FSDP2 and ShardedLamb over both ranks,
    which are also the CP group): the unsharded single rank's losses (9e-8 relative when written)."""
    from tests.bert.train.test_trainer_distributed import STEPS
    from tests.faults.common import spawn_ranks

    run_in_process(dataset, tmp_path / "one", *STEPS, *CP)
    two, logs = tmp_path / "two", tmp_path / "logs"
    logs.mkdir()
    extra = ("data.rebalance=balanced", "dist.context_parallel=[2,40]", "optim.shard=dp")
    for job in spawn_ranks(2, two, dataset, *STEPS, *CP, *extra, log_dir=str(logs)):
        assert job.wait(300, "a CP rank with the sharded optimizer") == 0, job.output()[-3000:]
    one, got = losses(tmp_path / "one"), losses(two)
    assert len(one) == len(got) == 5
    assert got == pytest.approx(one, rel=1e-5)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["data.layout=packed", "model.attention=flashmask"], r"data.layout=packed rows hold whole sequences"),
        (["data.layout=padded", "model.attention=padded"], r"data.layout=padded pads"),
        (["model.attention=padded"], r"keys of their own\); model.attention=padded: does not implement .*cu_seqlens_k"),
        (["train.static_shapes=true"], r"set train.static_shapes=false"),
        (["data.backend=dali"], r"set data.backend=torch"),
        (["optim.shard=2"], r"not run with sharded groups yet; set optim.shard=dp or none"),
        (["data.rebalance=measured"], r"places split documents with data.rebalance=balanced"),
        (
            ["dist.context_parallel=[0,40]"],
            r"dist.context_parallel: expected \[N >= 1, threshold >= 1\], got \[0, 40\]",
        ),
    ],
)
def test_what_cannot_split_a_document_is_refused_in_one_line(extra, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, ["dist.context_parallel=[2,40]", "model.attention=reference", *extra])
    assert "\n" not in str(e.value)
