"""Sharded training checkpoints of earlier code (DCP directories), read into the single file's dict.

``optim.shard`` runs used to write ``DIR/checkpoints/step_%08d/``: each rank's ``__<rank>_0.distcp``,
DCP's ``.metadata``, rank 0's ``state.pt`` (the rest, in bert.train_checkpoint's file format) and
``MANIFEST.json`` (every other file's size and SHA-256). ``bert.train_checkpoint.read`` checks the
manifest; ``whole_state`` reads the shards into what a single file holds, for the one restore path.

Safety: no checkpoint file may run code. DCP pickles ``.metadata`` and would unpickle it
with ``pickle.load``: here a restricted unpickler builds only DCP's own metadata classes,
``torch.Size``, dtypes and layouts, and refuses every other global without calling it.
Tensor records are read with ``weights_only=True``; DCP's "bytes" entries (arbitrary
objects, which DCP loads with ``weights_only=False``) were never written, and metadata that
declares one is refused (``BytesStorageMetadata`` is not among the classes built).
"""

from __future__ import annotations

import os
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from bert.checkpoint import CheckpointError

__all__ = ["load_tensors", "read_metadata", "tensor_shapes", "whole_state"]


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


# ---- reading DCP's metadata without running code --------------------------------------------

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused {module}.{name}")


def read_metadata(path: str) -> Metadata:
    """DCP's index of the checkpoint at ``path``, built by the restricted unpickler."""
    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{file}: {e}: only DCP's metadata classes are loaded") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{file}: not DCP metadata ({e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file}: not DCP metadata (a {type(metadata).__name__})")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):  # cannot be built; kept should the allowed set grow
            raise CheckpointError(f"{file}: {key!r} is not a tensor; only tensors are loaded")
    return metadata


def tensor_shapes(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor's whole shape and dtype, from the metadata (for the trainer's fit check)."""
    return {
        key: (tuple(entry.size), entry.properties.dtype)
        for key, entry in read_metadata(path).state_dict_metadata.items()
    }


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: per-rank metadata files are not read")
        metadata = read_metadata(str(self.path))
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_tensors(path: str, tensors: dict[str, Tensor]) -> None:
    """Fill ``tensors`` (flat names -> tensors of the resuming run's layout: DTensors of any
    mesh, or whole tensors) in place from the checkpoint at ``path``; every rank of the
    default group calls it (or a single process without one)."""
    read_metadata(path)  # refused here, with its own message, rather than inside DCP's wrapping
    try:
        with warnings.catch_warnings():
            # Without a process group (bert.export) DCP warns that it reads in one process: it does.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=_SafeReader(path), planner=DefaultLoadPlanner())
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - DCP wraps every rank's failure in one exception
        raise CheckpointError(f"{path}: cannot read the shards ({_first_line(e)})") from None


# ---- an earlier code's sharded checkpoint as the single file's dict -----------------------------


def whole_state(saved: dict, model: torch.nn.Module, optimizer=None) -> dict:
    """``saved`` (what ``bert.train_checkpoint.read`` gives for a directory) as the dict a single
    file holds: the model's whole tensors by name and, with ``optimizer`` (LAMB), its moments
    keyed by index into ``optimizer``'s parameter groups (the directory keys them by parameter
    name). Tensors are allocated in this run's shapes after the metadata's were checked against
    them (CheckpointError naming what does not fit); every rank of the default group calls it."""
    from bert.train_checkpoint import refuse_if

    path = saved["sharded"]
    shapes = tensor_shapes(path)
    ours = {f"model/{k}": v for k, v in model.state_dict().items()}
    moments: dict[str, tuple[int, str]] = {}  # "optim/<name>/<moment>" -> (index, moment)
    if optimizer is not None:
        groups = saved.get("optimizer_groups")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise CheckpointError("no 'optimizer_groups' state")
        names = {id(p): n for n, p in model.named_parameters()}
        for index, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
            for moment in ("exp_avg", "exp_avg_sq"):  # the writer saved both of every parameter
                key = f"optim/{names[id(p)]}/{moment}"
                ours[key], moments[key] = p, (index, moment)
    problems = [f"unexpected {k}" for k in shapes if k.startswith("model/") and k not in ours]
    problems += [f"missing {k}" for k in ours if k not in shapes]
    for key, target in ours.items():
        if key in shapes and shapes[key] != (tuple(target.shape), target.dtype):
            shape, dtype = shapes[key]
            problems.append(f"{key} is {dtype} {shape}, this run has {target.dtype} {tuple(target.shape)}")
    refuse_if("the checkpoint's tensors do not fit this run", problems)
    whole = {k: torch.empty(tuple(t.shape), dtype=t.dtype) for k, t in ours.items()}
    load_tensors(path, whole)
    state = {k: v for k, v in saved.items() if k not in ("sharded", "optimizer_groups")}
    state["model"] = {k[6:]: v for k, v in whole.items() if k.startswith("model/")}
    if optimizer is not None:
        param_groups, start = [], 0
        for g in groups:
            size = g.get("size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise CheckpointError(f"optimizer_groups: a group's size is {size!r}, not an integer >= 0")
            hyper = {k: v for k, v in g.items() if k != "size"}
            param_groups.append(hyper | {"params": list(range(start, start + size))})
            start += size
        state["optimizer"] = {"state": {}, "param_groups": param_groups}
        for key, (index, moment) in moments.items():
            state["optimizer"]["state"].setdefault(index, {})[moment] = whole[key]
    return state
