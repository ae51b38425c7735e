"""Weights in and out: transformers' ``BertForPreTraining`` names <-> this model's.

- ``to_hf_state_dict(model)`` / ``load_hf_state_dict(model, state_dict)``: the mapping,
  exact both ways (the fused QKV weight is split into query/key/value and concatenated back).
- ``load_pretrained(model, path)``: a transformers directory (``config.json`` with
  ``model.safetensors`` or ``pytorch_model.bin``), NVIDIA's MLPerf checkpoint
  (``model.ckpt-28252.pt``: a dict whose ``model`` entry holds transformers-style names, its
  vocabulary padded to a multiple of 8), or MLPerf's TensorFlow phase-1 checkpoint given by
  its prefix (``model.ckpt-28252``, read by ``bert.tf_checkpoint`` without TensorFlow).
- ``read_tf_checkpoint(prefix)``: every variable of a TF V2 checkpoint, bitwise.
- ``export_hf(model, directory)``: a directory ``transformers.BertForPreTraining.from_pretrained``
  loads.

Mismatches are reported together: every missing key, unexpected key, shape mismatch and
tensor that is not floating point in one ``CheckpointError``.

No file read here can run code: ``safetensors`` is read where a directory has it (it holds
tensors only), and torch files go through ``safe_torch_load`` (``weights_only=True``, no
compressed records). The training checkpoints (bert/train_checkpoint.py) use the same two
helpers, ``safe_torch_load`` and ``plain_data_problem``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import zipfile

import torch
from torch import Tensor

from bert.config import BertConfig, ConfigError
from bert.tf_checkpoint import (
    TFCheckpointError,
    google_bert_to_hf,
    is_slot_or_counter,
    is_tf_checkpoint,
    read_tf_checkpoint,
)
from fileio import publishing_dir

__all__ = [
    "CheckpointError",
    "to_hf_state_dict",
    "load_hf_state_dict",
    "read_config_and_weights",
    "read_tf_checkpoint",
    "load_pretrained",
    "export_hf",
    "drop_vocab_padding",
]


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model, or that is refused; the message lists every problem."""


# ---- reading files that may come from anyone --------------------------------------------------

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
    except (zipfile.BadZipFile, ValueError, EOFError) as e:
        raise CheckpointError(f"{path}: not a readable torch.save archive ({e})") from None
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


_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _refusal(e: pickle.UnpicklingError) -> str:
    """One line for what torch's weights-only unpickler refused (its message is a page)."""
    text = str(e)
    m = _REFUSED_GLOBAL.search(text)
    if m:
        return (
            f"refers to {m.group(1)}, which is not plain data (only tensors, numbers, strings, lists and "
            f"dicts are loaded); refused without running it"
        )
    m = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    detail = m.group(1) if m else text.strip().splitlines()[-1] if text.strip() else type(e).__name__
    return f"refused by the weights-only unpickler ({detail.split('. ')[0].rstrip('.')})"


def safe_torch_load(path: str, limit: int | None = None, archive_only: bool = False):
    """``torch.load(path, weights_only=True)`` on the CPU, every failure one CheckpointError line.

    ``limit``: the bytes of ``path`` that belong to the archive (default: all). A zip archive
    is checked first (no compressed records); ``archive_only`` also refuses torch's legacy
    (pre-1.6, non-zip) format, which nothing here writes.
    """
    try:
        with open(path, "rb") as f:
            window = _Window(f, os.path.getsize(path) if limit is None else limit)
            if zipfile.is_zipfile(window):
                _check_archive(path, window)
            elif archive_only:
                raise CheckpointError(f"{path}: not a torch.save zip archive")
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: {_refusal(e)}") from None
    except Exception as e:  # noqa: BLE001 - whatever else a malformed file raises, it is a bad file
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path}: cannot be loaded ({type(e).__name__}: {first})") from None


def _read_safetensors(path: str) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, ...: a bad file either way
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path}: cannot read safetensors ({type(e).__name__}: {first})") from None


# Keys that transformers may store that carry no information of their own: tied copies
# (decoder weight = word embeddings, decoder bias = predictions bias) and a constant buffer.
_ALIASES = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}
_IGNORED = {"bert.embeddings.position_ids"}


def _name_map(num_layers: int) -> dict[str, str]:
    """HF name -> our name, for every tensor except the split QKV."""
    m = {
        "bert.embeddings.word_embeddings.weight": "embeddings.word.weight",
        "bert.embeddings.position_embeddings.weight": "embeddings.position.weight",
        "bert.embeddings.token_type_embeddings.weight": "embeddings.token_type.weight",
        "bert.embeddings.LayerNorm.weight": "embeddings.norm.weight",
        "bert.embeddings.LayerNorm.bias": "embeddings.norm.bias",
        "bert.pooler.dense.weight": "pooler.weight",
        "bert.pooler.dense.bias": "pooler.bias",
        "cls.predictions.bias": "mlm_bias",
        "cls.predictions.transform.dense.weight": "mlm_transform.weight",
        "cls.predictions.transform.dense.bias": "mlm_transform.bias",
        "cls.predictions.transform.LayerNorm.weight": "mlm_norm.weight",
        "cls.predictions.transform.LayerNorm.bias": "mlm_norm.bias",
        "cls.seq_relationship.weight": "nsp.weight",
        "cls.seq_relationship.bias": "nsp.bias",
    }
    per_layer = {
        "attention.output.dense": "attn_out",
        "attention.output.LayerNorm": "attn_norm",
        "intermediate.dense": "ffn_in",
        "output.dense": "ffn_out",
        "output.LayerNorm": "ffn_norm",
    }
    for i in range(num_layers):
        for hf, ours in per_layer.items():
            for p in ("weight", "bias"):
                m[f"bert.encoder.layer.{i}.{hf}.{p}"] = f"layers.{i}.{ours}.{p}"
    return m


def _qkv_names(i: int, p: str) -> list[str]:
    return [f"bert.encoder.layer.{i}.attention.self.{n}.{p}" for n in ("query", "key", "value")]


def to_hf_state_dict(model, tensors: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """This model's weights under transformers' ``BertForPreTraining.state_dict()`` names
    (``ModernBertForMaskedLM``'s for a config that is not BERT's: ``bert.modernbert_hf``).

    ``tensors`` maps this model's parameter names to other tensors of the same shapes (for
    example gradients) to rename instead of the weights.
    """
    if not model.config.is_bert:
        from bert import modernbert_hf

        return modernbert_hf.to_hf_state_dict(model, tensors)
    ours = model.state_dict() if tensors is None else tensors
    out = {hf: ours[name] for hf, name in _name_map(model.config.num_hidden_layers).items()}
    for i in range(model.config.num_hidden_layers):
        for p in ("weight", "bias"):
            for hf, part in zip(_qkv_names(i, p), ours[f"layers.{i}.qkv.{p}"].chunk(3, dim=0)):
                out[hf] = part.clone()
    for alias, target in _ALIASES.items():
        out[alias] = out[target]
    return out


def load_hf_state_dict(model, state_dict: dict[str, Tensor]) -> None:
    """Load transformers-named weights into ``model``; all problems reported at once.

    BERT-shaped configs take ``BertForPreTraining``'s names, others ``ModernBertForMaskedLM``'s
    (``bert.modernbert_hf``)."""
    cfg = model.config
    if not cfg.is_bert:
        from bert import modernbert_hf

        try:
            new, problems = modernbert_hf.renamed(cfg, state_dict)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        _check_float(state_dict, set(modernbert_hf.name_map(cfg)) | {"decoder.weight"})
        hf_of = {ours: hf for hf, ours in modernbert_hf.name_map(cfg).items()}
        _check_shapes_and_copy(model, new, problems, hf_of)
        return
    names = _name_map(cfg.num_hidden_layers)
    wanted = set(names) | {
        n for i in range(cfg.num_hidden_layers) for p in ("weight", "bias") for n in _qkv_names(i, p)
    }
    missing = sorted(wanted - set(state_dict))
    unexpected = sorted(set(state_dict) - wanted - set(_ALIASES) - _IGNORED)
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    _check_float(state_dict, wanted | set(_ALIASES))
    new = {}
    for hf, name in names.items():
        if hf in state_dict:
            new[name] = state_dict[hf]
    for i in range(cfg.num_hidden_layers):
        for p in ("weight", "bias"):
            parts = [state_dict.get(n) for n in _qkv_names(i, p)]
            if all(t is not None for t in parts):
                if len({tuple(t.shape) for t in parts}) == 1:
                    new[f"layers.{i}.qkv.{p}"] = torch.cat(parts, 0)
                else:
                    problems.append(f"shape mismatch: {_qkv_names(i, p)[0]} and its key/value differ in shape")
    for alias, target in _ALIASES.items():
        if alias in state_dict and target in state_dict and not torch.equal(state_dict[alias], state_dict[target]):
            problems.append(f"{alias} differs from {target}, but this model ties them")
    _check_shapes_and_copy(model, new, problems, {name: hf for hf, name in names.items()})


def _check_float(state_dict: dict, keys: set[str]) -> None:
    """CheckpointError naming the entries of ``keys`` that are not floating-point tensors."""
    not_float = sorted(
        k for k, v in state_dict.items() if k in keys and (not isinstance(v, Tensor) or not v.is_floating_point())
    )
    if not_float:
        kinds = {
            k: state_dict[k].dtype if isinstance(state_dict[k], Tensor) else type(state_dict[k]).__name__
            for k in not_float[:5]
        }
        what = ", ".join(f"{k} ({kind})" for k, kind in kinds.items())
        raise CheckpointError(
            f"not floating-point tensors: {what}" + (f" (+{len(not_float) - 5} more)" if len(not_float) > 5 else "")
        )


def _check_shapes_and_copy(model, new: dict[str, Tensor], problems: list[str], hf_of: dict[str, str]) -> None:
    """Add shape mismatches to ``problems``; raise them all, or copy ``new`` into the model."""
    ours = model.state_dict()
    for name, tensor in new.items():
        if tuple(tensor.shape) != tuple(ours[name].shape):
            hf = hf_of.get(name, name)
            problems.append(f"shape mismatch: {hf} is {tuple(tensor.shape)}, model expects {tuple(ours[name].shape)}")
    if problems:
        raise CheckpointError("; ".join(problems))
    with torch.no_grad():
        for name, tensor in new.items():
            ours[name].copy_(tensor)


# The tensors whose first dimension is the vocabulary.
_VOCAB_ROWS = (
    "bert.embeddings.word_embeddings.weight",
    "cls.predictions.bias",
    "cls.predictions.decoder.weight",
    "cls.predictions.decoder.bias",
)


def drop_vocab_padding(state_dict: dict[str, Tensor], vocab_size: int) -> dict[str, Tensor]:
    """Cut the vocabulary padding of NVIDIA's converted checkpoint.

    NVIDIA's converter rounds the vocabulary up to a multiple of 8 (30,522 -> 30,528) for
    tensor-core-friendly GEMMs. The padding rows belong to no token: no input id reaches them
    and no label names them, so dropping them gives the reference model (MLCommons' TF model
    has 30,522 rows). The one difference is in the MLM softmax, whose denominator NVIDIA's
    padded model also sums over the 6 padding logits. Only padding to the next multiple of 8
    is accepted; any other size is a different vocabulary and stays a shape mismatch.
    """
    padded = -(-vocab_size // 8) * 8
    out = dict(state_dict)
    for name in _VOCAB_ROWS:
        t = out.get(name)
        if t is not None and t.shape[0] == padded != vocab_size:
            out[name] = t[:vocab_size]
    return out


def _read_tf(prefix: str) -> dict[str, Tensor]:
    try:
        variables = read_tf_checkpoint(prefix, include=lambda name: not is_slot_or_counter(name))
        weights, _ = google_bert_to_hf(variables)
    except TFCheckpointError as e:
        raise CheckpointError(str(e) if str(e).startswith(prefix) else f"{prefix}: {e}") from None
    return {k: torch.from_numpy(v) for k, v in weights.items()}


def read_config_and_weights(path: str) -> tuple[BertConfig | None, dict[str, Tensor]]:
    """Read a transformers directory (``model.safetensors`` preferred to ``pytorch_model.bin``),
    a ``.safetensors`` file with transformers' names, NVIDIA's MLPerf ``.pt`` or a TensorFlow
    checkpoint prefix; the config is None for all but the first (they ship a separate
    ``bert_config.json``)."""
    if is_tf_checkpoint(path):
        return None, _read_tf(path)
    if os.path.isdir(path):
        config = BertConfig.from_json(os.path.join(path, "config.json"))
        st = os.path.join(path, "model.safetensors")
        bin_ = os.path.join(path, "pytorch_model.bin")
        if os.path.exists(st):
            return config, _read_safetensors(st)
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
        return None, _read_safetensors(path)
    blob = safe_torch_load(path)
    if not isinstance(blob, dict) or not isinstance(blob.get("model"), dict):
        raise CheckpointError(f"{path}: expected a dict with a 'model' state dict (NVIDIA's MLPerf format)")
    return None, blob["model"]


def load_pretrained(model, path: str) -> None:
    """Initialise ``model`` from a transformers directory or NVIDIA's MLPerf checkpoint."""
    config, state_dict = read_config_and_weights(path)
    state_dict = drop_vocab_padding(state_dict, model.config.vocab_size)
    if config is not None and config != model.config:
        diff = {k: (v, getattr(model.config, k)) for k, v in config.to_dict().items() if getattr(model.config, k) != v}
        raise CheckpointError(f"{path}: config differs from the model's (checkpoint, model): {diff}")
    try:
        load_hf_state_dict(model, state_dict)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None


def export_hf(model, directory: str) -> None:
    """Write ``config.json`` and ``model.safetensors`` that transformers loads
    (``BertForPreTraining``, or ``ModernBertForMaskedLM`` for a ModernBERT config); the
    directory appears complete or not at all."""
    from safetensors.torch import save_file

    with publishing_dir(directory) as tmp:
        if model.config.is_bert:
            model.config.to_json(os.path.join(tmp, "config.json"), transformers=True)
            tied = set(_ALIASES)
        else:
            from bert import modernbert_hf

            with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:  # the directory is published whole
                json.dump(modernbert_hf.config_to_hf(model.config), f, indent=2, sort_keys=True)
            tied = {"decoder.weight"}
        # safetensors stores each tensor once: drop the tied copies, as transformers does.
        tensors = {k: v.detach().contiguous().cpu() for k, v in to_hf_state_dict(model).items() if k not in tied}
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
