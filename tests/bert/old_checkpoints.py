"""Sharded checkpoints as the code before the single-file format wrote them (optim.shard runs):
a DCP directory ``step_%08d/`` with ``state.pt`` and ``MANIFEST.json``, so that tests can show
such a directory still resumes (bert.distributed_checkpoint reads it)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp

from bert.checkpoint import training as tc
from common.files import file_digest


def write_old_checkpoint(directory, step: int, tensors: dict, state: dict) -> str:
    """``tensors`` (``model/<name>``, ``optim/<parameter name>/<moment>``) as DCP shards, ``state``
    (plain data with ``optimizer_groups``) as ``state.pt``, then the manifest; returns the path."""
    path = os.path.join(directory, f"step_{step:08d}")
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(path))
    tc.write_file(os.path.join(path, tc.STATE), state)
    write_manifest(path, step)
    return path


def write_manifest(path: str, step: int) -> None:
    """MANIFEST.json of ``path``: the byte count and SHA-256 of every other file in it."""
    files = {}
    for name in sorted(n for n in os.listdir(path) if n != tc.MANIFEST):
        file = os.path.join(path, name)
        files[name] = {"bytes": os.path.getsize(file), "sha256": file_digest(file, "sha256")}
    with open(os.path.join(path, tc.MANIFEST), "w") as f:
        json.dump({"format": "bert-sharded-checkpoint/1", "step": step, "files": files}, f)


def training_tensors(model, optimizer) -> dict:
    """What the old writer saved as shards: the model's state dict and LAMB's moments by name
    (zeros where a parameter had none yet)."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.init_state(p).items():
                tensors[f"optim/{names[id(p)]}/{key}"] = value
    return tensors


def optimizer_groups(param_groups: list[dict]) -> list[dict]:
    """What the old writer saved of the optimizer's groups: hyperparameters, step counts and sizes."""
    return [
        {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
        | {"size": len(g["params"])}
        for g in param_groups
    ]


def from_single_file(pt_path: str, directory, model, optimizer) -> str:
    """A trainer's single-file checkpoint rewritten as the old sharded directory of the same
    step (``model`` and ``optimizer``: the run's, for the parameter names in optimizer order);
    the file is removed."""
    saved = tc.read(pt_path)
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    tensors = {f"model/{k}": v for k, v in saved["model"].items()}
    for index, moments in saved["optimizer"]["state"].items():
        tensors.update({f"optim/{ordered[index]}/{k}": v for k, v in moments.items()})
    state = {k: v for k, v in saved.items() if k not in ("model", "optimizer")}
    state["optimizer_groups"] = optimizer_groups(saved["optimizer"]["param_groups"])
    os.remove(pt_path)
    return write_old_checkpoint(directory, saved["counters"]["step"], tensors, state)
