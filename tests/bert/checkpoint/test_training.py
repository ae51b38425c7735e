"""bert.train_checkpoint's writer and restore path in one process: a sharded run (FSDP2 on a
group of one) writes the single file of whole tensors, which resumes unsharded and sharded
with every weight and moment equal; an earlier code's sharded directory that does not fit is
refused before anything is read (the multi-rank runs: test_trainer_sharded.py)."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from torch.distributed.tensor import DTensor

from bert.checkpoint import training as tc
from bert.checkpoint.safe_load import CheckpointError
from bert.config import OptimSection, load_config
from bert.model.config import BertConfig
from bert.model.pretraining import BertForPreTraining
from bert.optim.optimizers import build_optimizer
from bert.optim.shard import apply_sharding, build_sharded_lamb, local_shard
from bert.train.state import TrainState
from tests.bert.old_checkpoints import optimizer_groups, training_tensors, write_old_checkpoint

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


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t.pop("optim/embeddings.word.weight/exp_avg"), "missing optim/embeddings.word.weight/exp_avg"),
        (lambda t: t.update({"model/embeddings.word.weight": torch.zeros(97, 128)}), r"is torch.float32 \(97, 128\)"),
        (lambda t: t.update({"model/extra": torch.zeros(2)}), "unexpected model/extra"),
    ],
    ids=["missing-moment", "other-shape", "unexpected-tensor"],
)
def test_an_earlier_sharded_directory_that_does_not_fit_is_refused(unsharded, tmp_path, damage, message):
    tensors = training_tensors(unsharded["model"], unsharded["optimizer"])
    damage(tensors)
    state = {"counters": {"step": 3}, "optimizer_groups": optimizer_groups(unsharded["optimizer"].param_groups)}
    path = write_old_checkpoint(tmp_path, 3, tensors, state)
    with pytest.raises(CheckpointError, match=message):
        tc.restore(tc.read(path), unsharded)  # refused before anything is loaded: the run itself will do


def test_an_earlier_sharded_directory_gives_the_model_alone_to_the_export(unsharded, tmp_path):
    """bert.export reads the weights only (no optimizer): the moments are not needed."""
    from bert.distributed_checkpoint import whole_state

    tensors = {
        k: v for k, v in training_tensors(unsharded["model"], unsharded["optimizer"]).items() if "optim/" not in k
    }
    path = write_old_checkpoint(tmp_path, 3, tensors, {"counters": {"step": 3}, "optimizer_groups": []})
    state = whole_state(tc.read(path), BertForPreTraining(BertConfig.preset("tiny", vocab_size=96)))
    assert "optimizer" not in state and state.keys() >= {"model", "counters"}
    for key, value in unsharded["model"].state_dict().items():
        assert torch.equal(state["model"][key], value), key
