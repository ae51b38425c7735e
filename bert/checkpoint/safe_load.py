"""Reading weight files that may come from anyone, without running their code (docs/reliability.md,
"Safe loading"): ``safe_torch_load``, ``plain_data_problem`` and, for every pretrained format,
``read_config_and_weights``. Every refusal is one ``CheckpointError`` line naming the file.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import zipfile

import torch
from torch import Tensor

from bert.checkpoint.tf_reader import is_tf_checkpoint, read_google_bert
from bert.model.config import BertConfig
from bert.model.hf import read_config
from common.errors import CheckpointError
from common.files import UnsafeFile, open_checked

_PLAIN_SCALARS = (str, int, float, bool, type(None))
_MAX_DEPTH = 32  # the trainer's state nests 5 deep; deeper is not ours


def plain_data_problem(obj) -> str | None:
    """None when ``obj`` is plain data (dense CPU tensors, numbers, strings, None, and lists,
    tuples and dicts of those, dict keys strings or ints); else where the first other thing is
    and what it is, e.g. ``"optimizer.param_groups[0].betas holds a torch.dtype"``."""
    stack = [(obj, "state", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > _MAX_DEPTH:
            return f"{where} is nested more than {_MAX_DEPTH} levels deep"
        if isinstance(value, Tensor):
            if value.layout != torch.strided or value.device.type != "cpu" or value.is_quantized:
                return f"{where} holds a {value.layout} {value.device.type} tensor (only dense CPU tensors are loaded)"
        elif isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    return f"{where} has a key of type {type(key).__module__}.{type(key).__qualname__}"
                stack.append((item, f"{where}.{key}", depth + 1))
        elif isinstance(value, (list, tuple)):
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))
        elif not isinstance(value, _PLAIN_SCALARS):
            return f"{where} holds a {type(value).__module__}.{type(value).__qualname__}"
    return None


class _Window(io.RawIOBase):
    """The first ``size`` bytes of an open file, read-only and seekable (for ``zipfile``)."""

    def __init__(self, f, size: int):
        self.f, self.size, self.pos = f, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(0, min(self.size, {0: 0, 1: self.pos, 2: self.size}[whence] + offset))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.size - self.pos)
        self.f.seek(self.pos)
        data = self.f.read(n)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _check_archive(path: str, window: _Window) -> None:
    """torch.save writes every record uncompressed: refuse compressed ones (a small file that
    inflates to any size) and records that claim more bytes than the file has."""
    try:
        with zipfile.ZipFile(window) as z:
            infos = z.infolist()
    except Exception as e:  # noqa: BLE001 - BadZipFile, EOFError, NotImplementedError (a version field)...: not ours
        raise CheckpointError(f"{path}: not a readable torch.save archive ({e})") from e
    total = 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CheckpointError(
                f"{path}: record {info.filename!r} is compressed ({info.compress_size} bytes "
                f"declared to inflate to {info.file_size}); torch.save never compresses, so it "
                f"is refused"
            )
        total += info.file_size
    if total > window.size:
        raise CheckpointError(f"{path}: its records declare {total} bytes, more than the {window.size} the file holds")


def _refusal(e: pickle.UnpicklingError) -> str:
    """One line for what torch's weights-only unpickler refused (its message is a page)."""
    text = str(e)
    if m := re.search(r"GLOBAL ([\w.]+)", text):
        return (
            f"refers to {m.group(1)}, which is not plain data (only tensors, numbers, strings, lists and "
            f"dicts are loaded); refused without running it"
        )
    m = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    detail = m.group(1) if m else text.strip().splitlines()[-1] if text.strip() else type(e).__name__
    return f"refused by the weights-only unpickler ({detail.split('. ')[0].rstrip('.')})"


def safe_torch_load(path: str, limit: int | None = None, archive_only: bool = False):
    """``torch.load(weights_only=True)`` of the regular file ``path`` (``common.files.open_checked``),
    its zip records checked first (``_check_archive``); every failure one CheckpointError line.
    ``limit``: the bytes of ``path`` that belong to the archive (default: all); ``archive_only``
    refuses torch's legacy (pre-1.6, non-zip) format."""
    try:
        with open_checked(path, what="a torch file") as f:
            window = _Window(f, os.fstat(f.fileno()).st_size if limit is None else limit)
            try:
                zipped = archive_only or zipfile.is_zipfile(window)
            except Exception:  # noqa: BLE001 - a zip broken enough to raise here: _check_archive names it
                zipped = True
            if zipped:
                _check_archive(path, window)
            f.seek(0)
            try:
                return torch.load(f, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                raise CheckpointError(f"{path}: {_refusal(e)}") from e
            except Exception as e:  # noqa: BLE001 - whatever else a malformed file raises, it is a bad file
                first = (str(e).strip().splitlines() or [""])[0]
                raise CheckpointError(f"{path}: cannot be loaded ({type(e).__name__}: {first})") from e
    except UnsafeFile as e:
        raise CheckpointError(str(e)) from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from e


def read_safetensors(path: str) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    try:
        open_checked(path, what="a safetensors file").close()  # a FIFO or a device is refused, not opened
        return load_file(path, device="cpu")
    except UnsafeFile as e:
        raise CheckpointError(str(e)) from e
    except BaseException as e:  # noqa: BLE001 - SafetensorError, OSError, a Rust panic (a BaseException)...
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path}: cannot read safetensors ({type(e).__name__}: {first})") from e


def _read_tf(prefix: str) -> dict[str, Tensor]:
    try:
        weights, _ = read_google_bert(prefix)
    except CheckpointError as e:
        raise CheckpointError(str(e) if str(e).startswith(prefix) else f"{prefix}: {e}") from e
    return {k: torch.from_numpy(v) for k, v in weights.items()}


def read_config_and_weights(path: str) -> tuple[BertConfig | None, dict[str, Tensor]]:
    """Read a transformers directory (``model.safetensors`` preferred to ``pytorch_model.bin``),
    a ``.safetensors`` file with transformers' names, NVIDIA's MLPerf ``.pt`` or a TensorFlow
    checkpoint prefix; the config is None for all but the first."""
    if is_tf_checkpoint(path):
        return None, _read_tf(path)
    if os.path.isdir(path):
        config = read_config(os.path.join(path, "config.json"))
        st = os.path.join(path, "model.safetensors")
        bin_ = os.path.join(path, "pytorch_model.bin")
        if os.path.exists(st):
            return config, read_safetensors(st)
        if os.path.exists(bin_):
            state_dict = safe_torch_load(bin_)
            if not isinstance(state_dict, dict):
                raise CheckpointError(f"{bin_}: expected a state dict, found a {type(state_dict).__name__}")
            return config, state_dict
        raise CheckpointError(f"{path}: holds neither model.safetensors nor pytorch_model.bin")
    if not os.path.exists(path):
        raise CheckpointError(
            f"{path}: no such file or directory, nor a TensorFlow checkpoint prefix ({os.path.basename(path)}.index)"
        )
    if path.endswith(".safetensors"):
        return None, read_safetensors(path)
    blob = safe_torch_load(path)
    if not isinstance(blob, dict) or not isinstance(blob.get("model"), dict):
        raise CheckpointError(f"{path}: expected a dict with a 'model' state dict (NVIDIA's MLPerf format)")
    return None, blob["model"]
