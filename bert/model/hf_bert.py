"""The transformers adapter of BERT: ``BertForPreTraining`` <-> this model, for BERT-shaped
configs (``BertConfig.is_bert``), exact both ways. The contract every adapter keeps is in ``bert.model.hf``.
"""

from __future__ import annotations

from dataclasses import fields

from bert.model.config import BertConfig

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


config_from_hf = BertConfig.from_dict  # transformers' BertConfig keys are ours


def config_to_hf(config: BertConfig) -> dict:
    return config.to_dict(transformers=True)


def name_map(config: BertConfig) -> dict[str, str]:
    """transformers' name -> this model's; the query, key and value are the parts of our ``qkv``."""
    m = dict(_TOP)
    for i in range(config.num_hidden_layers):
        for hf, ours in _PER_LAYER.items():
            for p in ("weight", "bias"):
                m[f"bert.encoder.layer.{i}.{hf}.{p}"] = f"layers.{i}.{ours}.{p}"
    for i in range(config.num_hidden_layers):
        for p in ("weight", "bias"):
            for n in ("query", "key", "value"):
                m[f"bert.encoder.layer.{i}.attention.self.{n}.{p}"] = f"layers.{i}.qkv.{p}"
    return m
