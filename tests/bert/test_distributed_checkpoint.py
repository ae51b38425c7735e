"""bert.distributed_checkpoint in one process: an earlier code's sharded directory (written as it
wrote them, tests/bert/old_checkpoints.py) read back, manifest checks, and files that must not run code."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from bert import distributed_checkpoint as dc
from bert.checkpoint import training as tc
from bert.checkpoint.safe_load import CheckpointError
from bert.model.config import BertConfig
from bert.model.pretraining import BertForPreTraining
from bert.optim.optimizers import Lamb, param_groups_for
from common.files import file_digest
from tests.bert.old_checkpoints import optimizer_groups, training_tensors, write_old_checkpoint

pytestmark = pytest.mark.usefixtures("one_rank_group")


def model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=96))
    optimizer = Lamb(param_groups_for(model, 0.01), lr=1e-3)
    return model, optimizer


def trained(seed: int = 0):
    model, optimizer = model_and_optimizer(seed)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return model, optimizer


def save(directory, step, model, optimizer):
    state = {"counters": {"step": step}, "optimizer_groups": optimizer_groups(optimizer.param_groups)}
    return write_old_checkpoint(directory, step, training_tensors(model, optimizer), state)


def rewrite_manifest(path):
    """What someone who edits a file can also do: make the manifest match it again."""
    with open(os.path.join(path, tc.MANIFEST)) as f:
        manifest = json.load(f)
    for name, entry in manifest["files"].items():
        entry["bytes"] = os.path.getsize(os.path.join(path, name))
        entry["sha256"] = file_digest(os.path.join(path, name), "sha256")
    with open(os.path.join(path, tc.MANIFEST), "w") as f:
        json.dump(manifest, f)


def test_round_trip_restores_every_tensor_and_the_step_count(tmp_path):
    """The directory read as the single file's dict (``whole_state``) restores every tensor."""
    model, optimizer = trained()
    path = save(tmp_path, 3, model, optimizer)
    assert sorted(os.listdir(path)) == sorted([".metadata", "__0_0.distcp", tc.STATE, tc.MANIFEST])
    assert tc.list_checkpoints(str(tmp_path)) == [(3, path)]
    state = tc.read(path)
    assert state["sharded"] == path and state["counters"]["step"] == 3
    other, other_opt = model_and_optimizer(seed=1)
    whole = dc.whole_state(state, other, other_opt)
    assert whole["optimizer"]["param_groups"][0]["params"] == list(range(len(optimizer.param_groups[0]["params"])))
    other.load_state_dict(whole["model"])
    other_opt.load_state_dict(whole["optimizer"])
    saved, got = training_tensors(model, optimizer), training_tensors(other, other_opt)
    assert saved.keys() == got.keys() and any(k.endswith("/exp_avg_sq") for k in saved)
    for key, value in saved.items():
        assert torch.equal(value, got[key]), key
    assert [g["step"] for g in other_opt.param_groups] == [1, 1]
    shapes = dc.tensor_shapes(path)
    assert shapes["model/embeddings.word.weight"] == ((96, 128), torch.float32)


def test_a_file_and_a_directory_are_listed_and_pruned_together(tmp_path):
    model, optimizer = trained()
    tc.save(str(tmp_path), 1, {"counters": {"step": 1}}, keep=5)
    save(tmp_path, 2, model, optimizer)
    save(tmp_path, 3, model, optimizer)
    assert [s for s, _ in tc.list_checkpoints(str(tmp_path))] == [1, 2, 3]
    tc.prune(str(tmp_path), keep=1)
    assert [s for s, _ in tc.list_checkpoints(str(tmp_path))] == [3]


def test_an_unfinished_write_is_not_a_checkpoint_and_is_removed(tmp_path):
    model, optimizer = trained()
    path = save(tmp_path, 2, model, optimizer)
    os.rename(path, os.path.join(tmp_path, ".step_00000002.tmp"))
    assert tc.list_checkpoints(str(tmp_path)) == []
    assert tc.remove_temporaries(str(tmp_path)) == [".step_00000002.tmp"]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: os.remove(os.path.join(p, tc.MANIFEST)), "no MANIFEST.json"),
        (lambda p: os.remove(os.path.join(p, "__0_0.distcp")), "__0_0.distcp is missing"),
        (lambda p: open(os.path.join(p, "__0_0.distcp"), "r+b").write(b"\0\0\0\0"), "checksum mismatch"),
        (lambda p: open(os.path.join(p, tc.STATE), "ab").write(b"x"), "the manifest records"),
    ],
)
def test_damage_is_detected_and_named(tmp_path, damage, message):
    model, optimizer = trained()
    path = save(tmp_path, 2, model, optimizer)
    damage(path)
    with pytest.raises(CheckpointError, match=message):
        tc.read(path)


def test_metadata_that_would_run_code_is_refused_without_running_it(tmp_path):
    model, optimizer = trained()
    path = save(tmp_path, 2, model, optimizer)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Payload(), f)
    rewrite_manifest(path)
    tc.read(path)  # the manifest and state.pt are fine: the metadata is only unpickled on load
    with pytest.raises(CheckpointError, match=r"refused posix\.system"):
        dc.load_tensors(path, training_tensors(*model_and_optimizer(1)))
    with pytest.raises(CheckpointError, match="refused"):
        dc.tensor_shapes(path)
    assert not marker.exists()


def test_an_object_entry_is_refused(tmp_path):
    """DCP would unpickle a non-tensor entry with weights_only=False: never read one."""
    path = str(tmp_path / "objects")
    dcp.save({"model/x": torch.ones(2), "extra": {"a": 1}}, storage_writer=dcp.FileSystemWriter(path))
    with pytest.raises(
        CheckpointError, match=r"refused torch\.distributed\.checkpoint\.metadata\.BytesStorageMetadata"
    ):
        dc.tensor_shapes(path)
