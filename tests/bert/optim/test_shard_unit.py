"""bert.optim.shard in one process: the config fields, the refusals, and a group of one rank
that must step exactly as the unsharded optimizer (the multi-rank tests: test_sharded_optim.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from bert.config import OptimSection, load_config
from bert.optim.shard import apply_sharding, build_sharded_lamb, optimizer_state_bytes, shard_group_size
from common.errors import ConfigError
from tests.bert.report.test_closed_division import CLOSED

pytestmark = pytest.mark.usefixtures("one_rank_group")


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.shard=0", "optim.shard: must be >= 1, got 0"),
        ("optim.shard=half", "optim.shard: expected none, dp or a group size, got 'half'"),
        ("optim.reduce_dtype=bf16", "optim.reduce_dtype: bf16 applies to sharded gradients"),
        ("optim.reduce_dtype=fp64", "optim.reduce_dtype: 'fp64' is not one of"),
    ],
)
def test_bad_sharding_fields_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
    with pytest.raises(ConfigError, match="optim.shard: sharding runs LAMB"):
        load_config(None, ["optim.shard=dp", "optim.name=adamw"])


def test_the_closed_division_allows_sharding():
    cfg = load_config(None, [*CLOSED, "optim.shard=dp", "optim.reduce_dtype=bf16"])
    assert cfg.optim.shard == "dp" and cfg.optim.reduce_dtype == "bf16"


def test_group_sizes():
    assert shard_group_size("none", 8) is None
    assert shard_group_size("dp", 8) == 8
    assert shard_group_size(4, 8) == 4
    with pytest.raises(ConfigError, match="optim.shard: a group of 3 ranks does not divide the 8 ranks"):
        shard_group_size(3, 8)


def test_a_group_of_one_steps_as_the_unsharded_lamb():
    """FSDP2 on one rank: the shards are the whole tensors, so every update must equal Lamb's
    (norms from sqrt of the summed squares: equal to the last bits)."""
    from bert.model.config import BertConfig
    from bert.model.pretraining import BertForPreTraining
    from bert.optim.optimizers import build_optimizer
    from bert.optim.shard import local_shard

    torch.manual_seed(0)
    ref = BertForPreTraining(BertConfig.preset("tiny", vocab_size=96), attention="padded")
    model = copy.deepcopy(ref)
    optim = OptimSection(lr=1e-2, shard=1)
    ref_opt = build_optimizer(optim, ref, impl="torch")
    sharding = apply_sharding(model, optim, "fp32", 1, "cpu")
    opt = build_sharded_lamb(optim, model, sharding)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(ref.parameters(), model.parameters()):
            g = torch.randn(p.shape, generator=gen)
            p.grad = g.clone()
            q.grad = torch.distributed.tensor.DTensor.from_local(g.clone(), q.device_mesh, q.placements)
        ref_opt.step()
        opt.step()
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(local_shard(q), p, rtol=1e-6, atol=1e-7)
    assert optimizer_state_bytes(opt) == optimizer_state_bytes(ref_opt) > 0


def test_the_device_skip_is_shared_by_the_sharded_lamb():
    """step(found_inf=...) (bert.optim's device-side skip) on shards: a flagged step leaves the
    shards, the moments and the step counts bitwise as they were; an unflagged one updates."""
    from bert.model.config import BertConfig
    from bert.model.pretraining import BertForPreTraining
    from bert.optim.shard import local_shard

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=96), attention="padded")
    optim = OptimSection(lr=1e-2, shard=1)
    opt = build_sharded_lamb(optim, model, apply_sharding(model, optim, "fp32", 1, "cpu"))

    def snapshot():
        tensors = [local_shard(p).clone() for p in model.parameters()]
        tensors += [local_shard(v).clone() for s in opt.state.values() for v in s.values()]
        return tensors, [float(g.get("step", 0)) for g in opt.param_groups]

    for step, skip in enumerate([False, True, False]):
        for p in model.parameters():
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            p.grad = torch.distributed.tensor.DTensor.from_local(g, p.device_mesh, p.placements)
        before = snapshot()
        opt.step(found_inf=torch.tensor(skip))
        after = snapshot()
        same = all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and before[1] == after[1]
        assert same == skip, step
