"""bert.checkpoint.training's writer and restore path in one process: a sharded run (FSDP2 on a
group of one) writes the single file of whole tensors, which resumes unsharded and sharded
with every weight and moment equal (the multi-rank runs: tests/bert/train/test_trainer_sharded.py)."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from torch.distributed.tensor import DTensor

from bert.checkpoint import training as tc
from bert.config import OptimSection, load_config
from bert.model.config import BertConfig
from bert.model.pretraining import BertForPreTraining
from bert.optim.optimizers import build_optimizer
from bert.optim.shard import apply_sharding, build_sharded_lamb, local_shard
from bert.state import TrainState

pytestmark = pytest.mark.usefixtures("one_rank_group")

OPTIM = OptimSection(lr=1e-2, shard=1)
ONE_RANK = types.SimpleNamespace(rank=0, guard=lambda what, step: contextlib.nullcontext())


def parts(sharded: bool, seed: int) -> dict:
    torch.manual_seed(seed)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=96), attention="padded")
    if sharded:
        optimizer = build_sharded_lamb(OPTIM, model, apply_sharding(model, OPTIM, "fp32", 1, "cpu"))
    else:
        optimizer = build_optimizer(OPTIM, model, impl="torch")
    for p in model.parameters():
        g = torch.randn(p.shape)
        p.grad = DTensor.from_local(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
    optimizer.step()
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 10)
    return {"model": model, "optimizer": optimizer, "schedule": schedule, "adagc": None, "scaler": None}


@pytest.fixture(scope="module")
def unsharded(one_rank_group):
    return parts(sharded=False, seed=0)


def whole(run: dict) -> dict:
    """Every weight and moment of ``run`` as a plain tensor, by parameter name."""
    model, optimizer = run["model"], run["optimizer"]
    out = {f"model/{k}": local_shard(v) for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        out.update({f"{name}/{k}": local_shard(v) for k, v in optimizer.state[p].items() if torch.is_tensor(v)})
    return out


def test_a_sharded_run_writes_whole_tensors_that_resume_unsharded_and_sharded(tmp_path):
    saved_run = parts(sharded=True, seed=0)
    cfg = load_config(None, ["checkpoint.keep=2"])
    assert tc.write_checkpoint(str(tmp_path), TrainState(step=1), saved_run, {"step": 1}, cfg, ONE_RANK) is None
    saved = tc.read(tc.checkpoint_path(str(tmp_path), 1))
    assert not any(isinstance(v, DTensor) for v in saved["model"].values())
    want = {k: v.clone() for k, v in whole(saved_run).items()}
    with torch.no_grad():
        for t in whole(saved_run).values():
            t.zero_()  # the sharded run resumes into itself, emptied
    for run in (parts(sharded=False, seed=1), saved_run):
        assert tc.restore(saved, run).step == 1
        got = whole(run)
        assert got.keys() == want.keys() and any(k.endswith("exp_avg_sq") for k in got)
        for key, value in want.items():
            assert torch.equal(got[key], value), key
        assert [g["step"] for g in run["optimizer"].param_groups] == [1, 1]
