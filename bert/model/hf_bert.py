"""The transformers adapter of BERT: ``BertForPreTraining`` <-> this model, for BERT-shaped
configs (``BertConfig.is_bert``). The contract every adapter keeps is in ``bert.model.hf``.

The fused QKV weight is split into query/key/value on the way out and concatenated on the
way in, so the mapping is exact both ways.
"""

from __future__ import annotations

from dataclasses import fields

import torch
from torch import Tensor

from bert.model.config import BertConfig

MODEL_TYPE = "bert"
# Copies transformers stores beside the tensor they are tied to.
TIED = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}
IGNORED = {"bert.embeddings.position_ids"}  # a constant buffer
VOCAB_ROWS = ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias", *TIED)

_TOP = {
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
_PER_LAYER = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "ffn_in",
    "output.dense": "ffn_out",
    "output.LayerNorm": "ffn_norm",
}


def unfit(config: BertConfig) -> str | None:
    """Why ``BertForPreTraining`` cannot hold ``config`` (None: it can)."""
    for f in fields(config):
        if f.metadata.get("part") and getattr(config, f.name) != f.default:
            return f"{f.name}={getattr(config, f.name)!r}: BERT has {f.default!r}"
    return None


def config_from_hf(values: dict, source: str = "config") -> BertConfig:
    return BertConfig.from_dict(values, source=source)


def config_to_hf(config: BertConfig) -> dict:
    return config.to_dict(transformers=True)


def _name_map(num_layers: int) -> dict[str, str]:
    """transformers' name -> this model's, for every tensor but the split QKV."""
    m = dict(_TOP)
    for i in range(num_layers):
        for hf, ours in _PER_LAYER.items():
            for p in ("weight", "bias"):
                m[f"bert.encoder.layer.{i}.{hf}.{p}"] = f"layers.{i}.{ours}.{p}"
    return m


def _qkv_names(i: int, p: str) -> list[str]:
    return [f"bert.encoder.layer.{i}.attention.self.{n}.{p}" for n in ("query", "key", "value")]


def _qkv(config: BertConfig):
    return [(i, p) for i in range(config.num_hidden_layers) for p in ("weight", "bias")]


def hf_names(config: BertConfig) -> set[str]:
    """Every name transformers stores a tensor of its own under (not ``TIED``, not ``IGNORED``)."""
    return set(_name_map(config.num_hidden_layers)) | {n for i, p in _qkv(config) for n in _qkv_names(i, p)}


def to_hf(config: BertConfig, ours: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {hf: ours[name] for hf, name in _name_map(config.num_hidden_layers).items()}
    for i, p in _qkv(config):
        for hf, part in zip(_qkv_names(i, p), ours[f"layers.{i}.qkv.{p}"].chunk(3, dim=0)):
            out[hf] = part.clone()
    return out


def from_hf(config: BertConfig, state_dict: dict[str, Tensor], problems: list[str]) -> dict[str, Tensor]:
    """The tensors of ``state_dict`` under this model's names; a QKV that cannot be fused goes to ``problems``."""
    new = {name: state_dict[hf] for hf, name in _name_map(config.num_hidden_layers).items() if hf in state_dict}
    for i, p in _qkv(config):
        parts = [state_dict.get(n) for n in _qkv_names(i, p)]
        if all(t is not None for t in parts):
            if len({tuple(t.shape) for t in parts}) == 1:
                new[f"layers.{i}.qkv.{p}"] = torch.cat(parts, 0)
            else:
                problems.append(f"shape mismatch: {_qkv_names(i, p)[0]} and its key/value differ in shape")
    return new


def hf_name(config: BertConfig, ours: str) -> str:
    """transformers' name of this model's tensor ``ours`` (for messages)."""
    return {name: hf for hf, name in _name_map(config.num_hidden_layers).items()}.get(ours, ours)
