"""dist.fault_tolerance: the config's refusals, and the pure part of a replica's step (its share of
the global batch for any number of live replicas). The runs with replicas killed: tests/faults/."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from bert.config import load_config
from bert.distributed.fault_tolerance import Quorum, ReplicaPlanner
from common.errors import ConfigError
from data.rebalance.plan import DEFAULT_COST, imbalance, sample_costs
from data.synthetic import random_block

FT = ["dist.fault_tolerance=torchft", "train.seed=1"]


@pytest.mark.parametrize(
    "extra, key",
    [
        ([], None),  # accepted
        (["optim.shard=dp"], "optim.shard"),
        (["data.rebalance=measured"], "data.rebalance"),
        (["train.static_shapes=true"], "train.static_shapes"),
        (["train.seed=null"], "train.seed"),
    ],
)
def test_what_a_replica_cannot_do_is_refused_in_one_line(monkeypatch, extra, key):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchft" else None)
    if key is None:
        assert load_config(None, FT + extra).dist.fault_tolerance == "torchft"
        return
    with pytest.raises(ConfigError, match=rf"^{key}: with dist.fault_tolerance=torchft, ") as e:
        load_config(None, FT + extra)
    assert "\n" not in str(e.value)


def test_missing_torchft_is_one_line_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(
        ConfigError, match=r"^dist.fault_tolerance: torchft is not installed \(pip install -e '.\[ft\]'"
    ):
        load_config(None, FT)


def test_the_closed_division_refuses_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    closed = ["log.division=closed", "log.submitter=tests", "checkpoint.init=/phase1/model.ckpt-28252.pt"]
    with pytest.raises(ConfigError, match=r"^dist.fault_tolerance: the closed division times one run on the system"):
        load_config(None, closed + FT)


def sample_keys(block) -> list[tuple]:
    """Each sample as a hashable (length, first tokens, masked count) key."""
    at = np.concatenate([[0], np.cumsum(block.seq_lens)])
    return [
        (int(n), tuple(block.input_ids[a : a + 8].tolist()), int(m))
        for n, a, m in zip(block.seq_lens, at, block.masked_counts)
    ]


@pytest.mark.parametrize("rebalance", ["none", "stripe", "balanced"])
@pytest.mark.parametrize("replicas", [1, 2, 3, 5])
def test_the_live_replicas_shares_are_the_whole_global_batch_once(rebalance, replicas):
    block = random_block(12, seed=replicas, max_seq_length=128)
    planner = ReplicaPlanner(loader=[], rebalance=rebalance, cost=DEFAULT_COST, group_size=None, simreg_scope=None)
    shares = [planner.share(block, 7, Quorum(r, replicas, 1, False, 0.0)) for r in range(replicas)]
    got = sorted(k for share, _ in shares for k in sample_keys(share))
    assert got == sorted(sample_keys(block))  # every sample of the step once, whatever the quorum
    # 12 % 5: no even split to balance, so contiguous slices (sizes differ by one); else balanced as asked.
    assert all(stats is None for _, stats in shares) == (rebalance == "none" or 12 % replicas != 0)
    if rebalance == "balanced" and 12 % replicas == 0 and replicas > 1:
        costs = [sample_costs(s.seq_lens, DEFAULT_COST).sum() for s, _ in shares]
        before = [sample_costs(c, DEFAULT_COST).sum() for c in np.split(block.seq_lens, replicas)]
        assert imbalance(np.array(costs)) <= imbalance(np.array(before)) + 1e-9
