"""The transformers side of the model: one adapter per model family, keyed by ``model_type``,
the exact state-dict mapping both ways, and ``config.json`` / ``bert_config.json`` read into a
``BertConfig``. Files of weights are read and written by ``bert.checkpoint.pretrained``.

An adapter (``bert/model/hf_bert.py``, ``bert/model/hf_modernbert.py``) is a module with ``TIED``
(transformers' name of a stored copy -> the name it copies); ``IGNORED`` (names read and dropped);
``VOCAB_ROWS`` (names whose first dimension is the vocabulary); ``unfit(config)`` (why the family
cannot hold a config, None if it can); ``config_from_hf`` / ``config_to_hf`` (``config.json``'s dict
<-> ``BertConfig``); ``name_map(config)`` (transformers' name of every tensor it stores -> this model's;
names that share one of ours are its parts along dim 0, in order). A new family: CONTRIBUTING.md.
"""

from __future__ import annotations

import importlib
import json

import torch
from torch import Tensor

from bert.model.config import BertConfig
from common.config import cut
from common.errors import CheckpointError, ConfigError
from common.files import UnsafeFile, read_checked

ADAPTERS = {"bert": "bert.model.hf_bert", "modernbert": "bert.model.hf_modernbert"}


def adapter(model_type: str):
    """The adapter module of ``model_type``; ConfigError for a family with none."""
    if model_type not in ADAPTERS:
        raise ConfigError(f"model_type {model_type!r}: no transformers adapter here (one of {sorted(ADAPTERS)})")
    return importlib.import_module(ADAPTERS[model_type])


def adapter_for(config: BertConfig):
    """The adapter of the first family that can hold ``config``; ConfigError saying why none can."""
    reasons = []
    for model_type in ADAPTERS:
        family = adapter(model_type)
        reason = family.unfit(config)
        if reason is None:
            return family
        reasons.append(reason)
    raise ConfigError(f"no transformers class holds this config ({'; '.join(reasons)})")


def to_hf_state_dict(model, tensors: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """This model's weights under transformers' names (``state_dict()`` of its family's class), or
    ``tensors`` (this model's names -> tensors of the same shapes, e.g. gradients) renamed."""
    family = adapter_for(model.config)
    ours = model.state_dict() if tensors is None else tensors
    out = {}
    for name, hf_names in _parts(family.name_map(model.config)).items():
        if len(hf_names) == 1:
            out[hf_names[0]] = ours[name]
        else:
            out.update(zip(hf_names, (part.clone() for part in ours[name].chunk(len(hf_names), dim=0))))
    out.update({alias: out[target] for alias, target in family.TIED.items()})
    return out


def _parts(name_map: dict[str, str]) -> dict[str, list[str]]:
    """This model's name -> transformers' names of its parts (one, or a fused tensor's, in order)."""
    parts: dict[str, list[str]] = {}
    for hf, ours in name_map.items():
        parts.setdefault(ours, []).append(hf)
    return parts


def load_hf_state_dict(model, state_dict: dict[str, Tensor]) -> None:
    """Load transformers-named weights into ``model``; all problems reported at once."""
    cfg = model.config
    try:
        family = adapter_for(cfg)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e
    name_map = family.name_map(cfg)
    parts, wanted = _parts(name_map), set(name_map)
    missing = sorted(wanted - set(state_dict))
    unexpected = sorted(set(state_dict) - wanted - set(family.TIED) - family.IGNORED)
    problems = [f"{what} keys {names}" for what, names in (("missing", missing), ("unexpected", unexpected)) if names]
    _check_float(state_dict, wanted | set(family.TIED))
    new = {}
    for name, hf_names in parts.items():
        tensors = [state_dict.get(hf) for hf in hf_names]
        if any(t is None for t in tensors):
            continue
        if len({tuple(t.shape) for t in tensors}) == 1:
            new[name] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, 0)
        else:  # the parts of a fused tensor: BERT's query, key and value
            problems.append(f"shape mismatch: {hf_names[0]} and its key/value differ in shape")
    for alias, target in family.TIED.items():
        if alias in state_dict and target in state_dict and not torch.equal(state_dict[alias], state_dict[target]):
            problems.append(f"{alias} differs from {target}, but this model ties them")
    ours = model.state_dict()
    for name, tensor in new.items():
        if tuple(tensor.shape) != tuple(ours[name].shape):
            where = parts[name][0] if len(parts[name]) == 1 else name  # a fused tensor by our name
            problems.append(
                f"shape mismatch: {where} is {tuple(tensor.shape)}, model expects {tuple(ours[name].shape)}"
            )
    if problems:
        raise CheckpointError("; ".join(problems))
    with torch.no_grad():
        for name, tensor in new.items():
            ours[name].copy_(tensor)


def _check_float(state_dict: dict, keys: set[str]) -> None:
    """CheckpointError naming the entries of ``keys`` that are not floating-point tensors."""
    kinds = {}  # key -> what it holds instead, in key order
    for k in sorted(keys & state_dict.keys()):
        v = state_dict[k]
        if not (isinstance(v, Tensor) and v.is_floating_point()):
            kinds[k] = v.dtype if isinstance(v, Tensor) else type(v).__name__
    if kinds:
        what = ", ".join(f"{k} ({kind})" for k, kind in list(kinds.items())[:5])
        more = f" (+{len(kinds) - 5} more)" if len(kinds) > 5 else ""
        raise CheckpointError(f"not floating-point tensors: {what}{more}")


def drop_vocab_padding(state_dict: dict[str, Tensor], vocab_size: int, rows: tuple[str, ...]) -> dict[str, Tensor]:
    """The rows ``rows`` cut back to ``vocab_size`` where padded to the next multiple of 8 (NVIDIA's
    converted checkpoint, docs/training.md); any other size stays a shape mismatch."""
    padded = -(-vocab_size // 8) * 8
    out = dict(state_dict)
    for name in rows:
        t = out.get(name)
        if t is not None and t.shape[0] == padded != vocab_size:
            out[name] = t[:vocab_size]
    return out


def read_config(path: str) -> BertConfig:
    """Read BERT's ``bert_config.json``, or transformers' ``config.json`` of a BERT or of another
    family with an adapter (``model_type`` "modernbert": ``bert.model.hf_modernbert``)."""
    try:
        values = json.loads(read_checked(path, max_bytes=1 << 20, what="model config"))
    except UnsafeFile as e:
        raise ConfigError(str(e)) from e
    except OSError as e:
        raise ConfigError(f"{path}: cannot read a JSON model config ({e.strerror or e})") from e
    except (ValueError, RecursionError) as e:  # not JSON, an integer of 4,300+ digits, deep nesting
        raise ConfigError(
            f"{path}: not a JSON model config ({cut(str(e).splitlines()[0] if str(e) else type(e).__name__)})"
        ) from e
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    try:
        return adapter(values.get("model_type", "bert")).config_from_hf(values, source=path)
    except (ConfigError, TypeError) as e:
        raise ConfigError(str(e) if str(e).startswith(path) else f"{path}: {e}") from e
