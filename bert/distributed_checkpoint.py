"""Sharded training checkpoints of earlier code (DCP directories), read into the single file's dict.

``optim.shard`` runs used to write ``DIR/checkpoints/step_%08d/``: each rank's ``__<rank>_0.distcp``,
DCP's ``.metadata``, rank 0's ``state.pt`` (bert.train_checkpoint's file format) and ``MANIFEST.json``
(every other file's size and SHA-256, checked by ``train_checkpoint.read``); ``whole_state`` reads the
shards into what a single file holds. DCP never opens anything: the rules are docs/reliability.md's
"Checkpoints" (allow-listed ``.metadata``, listed and hashed files, every element from one chunk).
"""

from __future__ import annotations

import io
import math
import os
import pickle

import torch
from torch import Tensor
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from bert.checkpoint.safe_load import CheckpointError, load_archive
from bert.checkpoint.training import MANIFEST, STATE, _first_line, copy_whole, is_plain_name, refuse_if, verify_dir
from common.files import UnsafeFile, open_checked, read_checked

__all__ = ["load_tensors", "read_metadata", "tensor_shapes", "whole_state"]


# ---- reading a DCP directory without DCP -----------------------------------------------------

_METADATA_CLASSES = "Metadata MetadataIndex ChunkStorageMetadata TensorStorageMetadata TensorProperties StorageMeta"
_ALLOWED = {("torch.distributed.checkpoint.metadata", name) for name in _METADATA_CLASSES.split()} | {
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}
_DTYPES = {getattr(torch, n) for n in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool")}
_MAX_METADATA = 16 << 20  # ~300 bytes per tensor and rank: BERT-large's on 64 ranks is ~4 MB


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"refused {module}.{name}")


def _is_size(value, rank: int | None = None, *more) -> bool:
    """Whether ``value`` (and each of ``more``) is a torch.Size of ``rank`` sane integers."""
    ok = isinstance(value, torch.Size) and rank in (None, len(value)) and all(0 <= n < 1 << 48 for n in value)
    return ok and all(_is_size(v, rank) for v in more)


def _metadata_problem(md) -> str | None:
    """Where the unpickled ``md`` is not what DCP's writer makes: the type of every field read."""
    if not isinstance(md, Metadata) or not all(isinstance(d, dict) for d in (md.state_dict_metadata, md.storage_data)):
        return f"a {type(md).__name__} without dicts of tensors and storage"
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):  # cannot be built; kept should the allowed set grow
            return f"{key!r} is not a tensor; only tensors are loaded"
        dims = len(entry.size) if _is_size(entry.size) else -1
        if not isinstance(key, str) or dims < 0 or getattr(entry.properties, "dtype", None) not in _DTYPES:
            return f"{key!r}: its size or dtype is not a training checkpoint's"
        for chunk in entry.chunks if isinstance(entry.chunks, list) else [None]:
            if not isinstance(chunk, ChunkStorageMetadata) or not _is_size(chunk.offsets, dims, chunk.sizes):
                return f"{key!r}: a chunk's offsets or sizes are not {dims} integers"
            if any(o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, entry.size)):
                return f"{key!r}: a chunk at {tuple(chunk.offsets)} leaves the tensor's {tuple(entry.size)}"
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return "a storage entry is not DCP's"
        fields = (info.relative_path, info.offset, info.length)
        if [type(f) for f in fields] != [str, int, int] or min(fields[1:]) < 0 or info.transform_descriptors:
            return f"the storage entry of {index.fqn!r} is not a path and a range, or is transformed (compressed)"
    return None


def read_metadata(path: str) -> Metadata:
    """DCP's index of the checkpoint at ``path``, built by the restricted unpickler from a bounded read and checked
    field by field (``_metadata_problem``); CheckpointError, one line naming the file, for whatever else it holds."""
    file = os.path.join(path, ".metadata")
    try:
        data = read_checked(file, max_bytes=_MAX_METADATA, root=path, what="DCP metadata")
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        problem = _metadata_problem(metadata)  # AttributeError: fields the pickle left out
    except _Refused as e:
        raise CheckpointError(f"{file}: {e}: only DCP's metadata classes are loaded") from None
    except UnsafeFile as e:
        raise CheckpointError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - the allowed classes raise anything on bad arguments
        raise CheckpointError(f"{file}: not DCP metadata ({type(e).__name__}: {_first_line(e)})") from None
    if problem:
        raise CheckpointError(f"{file}: not DCP metadata of tensors ({problem})")
    return metadata


def tensor_shapes(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor's whole shape and dtype, from the metadata (for the trainer's fit check)."""
    return {
        key: (tuple(entry.size), entry.properties.dtype)
        for key, entry in read_metadata(path).state_dict_metadata.items()
    }


def _plan(path: str, metadata: Metadata, files: dict) -> dict[str, list]:
    """Per storage file, its (offset, length, key, chunk) records, sorted; CheckpointError where one
    lies outside the manifest's files, two overlap, or chunks hold other than a tensor's elements."""
    file = os.path.join(path, ".metadata")
    plan: dict[str, list] = {}
    for key, entry in metadata.state_dict_metadata.items():
        covered = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
        if covered != math.prod(entry.size):
            raise CheckpointError(
                f"{file}: the chunks of {key!r} hold {covered} elements, the tensor {math.prod(entry.size)}: "
                f"every element must be stored once"
            )
        for chunk in entry.chunks:
            info = metadata.storage_data.get(MetadataIndex(key, chunk.offsets))
            name = getattr(info, "relative_path", None)  # None: a chunk without a storage entry
            if not is_plain_name(name) or name not in files or name in (MANIFEST, STATE, ".metadata"):
                raise CheckpointError(
                    f"{file}: {key!r} is stored in {name!r}, not a data file the manifest lists; refused"
                )
            nbytes = math.prod(chunk.sizes) * entry.properties.dtype.itemsize
            if info.offset + info.length > files[name]["bytes"] or nbytes > info.length:
                raise CheckpointError(
                    f"{file}: the record of {key!r} at {tuple(chunk.offsets)} ({info.length} bytes at {info.offset}) "
                    f"cannot hold its {nbytes} bytes inside {name}"
                )
            plan.setdefault(name, []).append((info.offset, info.length, key, chunk))
    for name, records in plan.items():
        records.sort(key=lambda r: r[:2])
        for (o1, n1, k1, _), (o2, _, k2, _) in zip(records, records[1:]):
            if o1 + n1 > o2:
                raise CheckpointError(f"{file}: the records of {k1!r} and {k2!r} overlap in {name}")
    return plan


def read_tensors(path: str, files: dict) -> dict[str, Tensor]:
    """Every tensor of the DCP directory ``path``, whole, on the CPU; ``files``: its manifest's entries
    (``train_checkpoint.verify_dir``, which hashed them). Reads only what they list; every element
    comes from exactly one chunk; CheckpointError, one line naming the file and the rule."""
    metadata = read_metadata(path)
    plan = _plan(path, metadata, files)
    entries = metadata.state_dict_metadata
    tensors = {key: torch.empty(tuple(e.size), dtype=e.properties.dtype) for key, e in entries.items()}
    seen = {key: torch.zeros(t.shape, dtype=torch.bool) for key, t in tensors.items()}
    for name, records in plan.items():
        file = os.path.join(path, name)
        try:
            with open_checked(file, max_bytes=files[name]["bytes"], root=path, what="a DCP data file") as f:
                for offset, length, key, chunk in records:
                    where = f"{file}: the record of {key!r} at {tuple(chunk.offsets)}"
                    f.seek(offset)
                    value = load_archive(where, io.BytesIO(f.read(length)), length)
                    if not isinstance(value, Tensor) or value.dtype != tensors[key].dtype or value.shape != chunk.sizes:
                        raise CheckpointError(f"{where} is not a {tensors[key].dtype} tensor of {tuple(chunk.sizes)}")
                    region = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
                    if seen[key][region].any():
                        raise CheckpointError(f"{where} overlaps another chunk: every element must be stored once")
                    seen[key][region] = True
                    tensors[key][region] = value
        except UnsafeFile as e:
            raise CheckpointError(str(e)) from None
        except OSError as e:
            raise CheckpointError(f"{file}: cannot read ({e.strerror or e})") from None
    return tensors  # no element missed: as many were written, none twice (_plan, seen)


def load_tensors(path: str, tensors: dict[str, Tensor]) -> None:
    """Fill ``tensors`` (flat names -> tensors of the resuming run's layout: DTensors of any
    mesh, or whole tensors) in place from the checkpoint at ``path`` (verified against its
    manifest here), every element of every one written (CheckpointError naming the ones it
    lacks). Each rank reads the whole tensors and keeps its own part (no communication)."""
    saved = read_tensors(path, verify_dir(path)["files"])
    missing = sorted(set(tensors) - set(saved))
    if missing:
        more = f" (+{len(missing) - 4} more)" if len(missing) > 4 else ""
        raise CheckpointError(f"{path}: holds no {', '.join(missing[:4])}{more}: every tensor must be restored")
    copy_whole((target, saved[key]) for key, target in tensors.items())


# ---- an earlier code's sharded checkpoint as the single file's dict -----------------------------


def whole_state(saved: dict, model: torch.nn.Module, optimizer=None) -> dict:
    """``saved`` (what ``bert.train_checkpoint.read`` gives for a directory) as the dict a single
    file holds: the model's whole tensors by name and, with ``optimizer`` (LAMB), its moments
    keyed by index into ``optimizer``'s parameter groups (the directory keys them by parameter
    name). Tensors are allocated in this run's shapes after the metadata's were checked against
    them (CheckpointError naming what does not fit); every rank of the default group calls it."""
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
