"""dist.context_parallel=[2,40] through the trainer: 2 ranks with every sequence above 40 tokens split
across them train as one rank does (the same losses), and the combinations that cannot split
a document are refused in one line when the configuration loads."""

from __future__ import annotations

import pytest

from bert.train_config import ConfigError, load_config
from tests.bert.test_trainer import dataset, losses, run_in_process  # noqa: F401 (dataset is a fixture)

CP = ["model.attention=reference"]


@pytest.mark.multiprocess
@pytest.mark.slow  # torchrun, 2 ranks
def test_two_context_parallel_ranks_train_as_one_rank(dataset, tmp_path):  # noqa: F811
    from tests.bert.test_trainer_distributed import STEPS, launch

    run_in_process(dataset, tmp_path / "one", *STEPS, *CP)
    launch("run_torchrun.sh", 2, tmp_path / "two", dataset, *CP, "dist.context_parallel=[2,40]", "data.rebalance=none")
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == len(two) == 5
    assert two == pytest.approx(one, rel=1e-5)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["data.layout=packed", "model.attention=flashmask"], r"data.layout=packed rows hold whole sequences"),
        (["data.layout=padded", "model.attention=padded"], r"data.layout=padded pads"),
        (["model.attention=padded"], r"keys of their own\); model.attention=padded: does not implement .*cu_seqlens_k"),
        (["train.static_shapes=true"], r"set train.static_shapes=false"),
        (["optim.shard=dp"], r"not run under optim.shard yet"),
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
