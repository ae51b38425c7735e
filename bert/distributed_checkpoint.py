"""Sharded training checkpoints: ``torch.distributed.checkpoint`` (DCP) directories that reshard.

The trainer writes one with ``optim.shard`` set (bert.sharded_optim): every rank writes the
shards it holds of the weights and of LAMB's moments, so nothing is gathered to one rank, and
a run resumes from it at any world size and any ``optim.shard`` (``none`` included): DCP reads
into whatever layout the resuming run's tensors have. A checkpoint of step N is the directory
``DIR/checkpoints/step_%08d/`` next to the single-file ``step_%08d.pt`` ones
(bert.train_checkpoint, which lists, prunes and loads both kinds):

    __<rank>_0.distcp   each rank's tensors (DCP's format: raw tensor records, read with
                        ``torch.load(weights_only=True)``)
    .metadata           DCP's index of every tensor's shards
    state.pt            rank 0: everything but the big tensors (counters, schedule, loader
                        position, AdaGC, the optimizer's hyperparameters and step counts), in
                        bert.train_checkpoint's checksummed file format, plain data only
    MANIFEST.json       written last: the byte count and SHA-256 of every other file

Publishing as a whole: all of it is written under ``.step_%08d.tmp/``; after every rank's shards
are on disk (fsynced; DCP's save ends with a collective), rank 0 writes ``state.pt`` and the
manifest, fsyncs, renames the directory to its final name and fsyncs the parent. A kill of any
rank at any moment leaves at most the temporary directory, removed at the next start, and the
previous checkpoints untouched. On load every file is checked against the manifest first; a
directory without one, or whose files do not match it, is named and passed over like a damaged
single-file checkpoint.

Safety: no checkpoint file may run code. DCP pickles ``.metadata`` and would unpickle it
with ``pickle.load``: here a restricted unpickler builds only DCP's own metadata classes,
``torch.Size``, dtypes and layouts, and refuses every other global without calling it.
Tensor records are read with ``weights_only=True``; DCP's "bytes" entries (arbitrary
objects, which DCP loads with ``weights_only=False``) are never written, and metadata that
declares one is refused (``BytesStorageMetadata`` is not among the classes built).
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from bert.safe_load import CheckpointError, plain_data_problem
from bert.train_checkpoint import (
    MANIFEST,
    STATE,
    CheckpointWriteError,
    checkpoint_dir,
    temporary_dir,
    write_file,
    write_manifest,
)
from fileio import publish

__all__ = ["MANIFEST", "STATE", "checkpoint_dir", "load_tensors", "save", "tensor_shapes", "training_tensors"]


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer (fsyncs every file it writes); a class of its own so that the fault
    tests can stop a rank in the middle of its shards (tests/faults/fault_worker.py)."""


def save(directory: str, step: int, tensors: dict[str, Tensor], state: dict, is_main: bool) -> str:
    """Write the checkpoint of ``step``; every rank of the default group calls it. Returns its path.

    ``tensors``: flat names -> tensors (DTensors write their local shards, plain tensors are
    written once); ``state``: plain data, written by rank 0 (``is_main``). Raises
    ``CheckpointWriteError`` where a write failed (on every rank when DCP's part failed; on
    rank 0 alone when its own files did: the trainer all-reduces the outcome).
    """
    problem = plain_data_problem(state)
    if problem:
        raise TypeError(f"checkpoint state of step {step}: {problem}")
    final, tmp = checkpoint_dir(directory, step), temporary_dir(directory, step)
    if is_main:
        # A failed earlier attempt at this step leaves its files: DCP writes the same names,
        # and rank 0 clears them before it takes part in DCP's planning (no rank writes
        # before the plan is agreed).
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        dcp.save(tensors, storage_writer=_Writer(tmp, sync_files=True))
    except (CheckpointException, OSError) as e:
        # DCP gathers every rank's write errors into one CheckpointException, raised on every
        # rank; a peer that died is a communication failure instead, left to the caller's guard.
        raise CheckpointWriteError(f"{final}: cannot write the checkpoint's shards ({_first_line(e)})") from None
    if not is_main:
        return final
    try:
        write_file(os.path.join(tmp, STATE), state)
        write_manifest(tmp, step)
        if os.path.isdir(final):  # a re-save of the same step (a resumed run's first save)
            shutil.rmtree(final)
        publish(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"{final}: cannot write the checkpoint ({e.strerror or e})") from None
    return final


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


# ---- what a sharded checkpoint holds ----------------------------------------------------------


def training_tensors(model: torch.nn.Module, optimizer) -> dict[str, Tensor]:
    """The big tensors by name: ``model/<name>`` (the model's state dict) and
    ``optim/<parameter name>/<moment>`` (LAMB's moments, created as zeros where a parameter has
    none yet, so that a checkpoint can be loaded into them). Names, not optimizer indices, key
    the moments, so they reshard like the weights."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.init_state(p).items():
                if isinstance(value, Tensor) and value.dim():
                    tensors[f"optim/{names[id(p)]}/{key}"] = value
    return tensors


def optimizer_groups(optimizer) -> list[dict]:
    """The optimizer's hyperparameters and step counts per group (plain data, for ``state.pt``)."""
    return [
        {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in g.items() if k != "params"}
        | {"size": len(g["params"])}
        for g in optimizer.param_groups
    ]


def load_optimizer_groups(optimizer, groups: list[dict]) -> None:
    """Restore what ``optimizer_groups`` saved; CheckpointError when the groups do not match."""
    sizes = [g.get("size") for g in groups]
    if sizes != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointError(
            f"the optimizer state has parameter groups of sizes {sizes}, this optimizer "
            f"{[len(g['params']) for g in optimizer.param_groups]}"
        )
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "size"})
