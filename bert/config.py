"""The BERT architecture's hyper-parameters: ``BertConfig``, its presets, and JSON I/O.

Field names are BERT's own, so a ``bert_config.json`` from Google's release or NVIDIA's
MLPerf package and a transformers ``config.json`` both load directly. Presets:

- ``tiny``: 2 layers, hidden 128, for tests and the CPU demo;
- ``base``: BERT-base, 12 layers, hidden 768;
- ``large``: MLPerf's BERT-large, 24 layers, hidden 1024, 16 heads, intermediate 4096.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace

from fileio import write_text

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")

# Keys transformers writes into config.json that describe its own bookkeeping, not the
# architecture. Any other unknown key is an error.
_HF_METADATA = {
    "architectures",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "pad_token_id",
    "use_cache",
    "classifier_dropout",
    "gradient_checkpointing",
    "directionality",
    "pooler_fc_size",
    "pooler_num_attention_heads",
    "pooler_num_fc_layers",
    "pooler_size_per_head",
    "pooler_type",
    "output_past",
    "bos_token_id",
    "eos_token_id",
    "id2label",
    "label2id",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "is_decoder",
    "add_cross_attention",
    "tie_word_embeddings",
    "position_embedding_type",
    "problem_type",
}


class ConfigError(ValueError):
    """A model configuration that is invalid; the message names the field."""


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size: {self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ConfigError(f"{name}: must lie in [0, 1), got {value!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act: {self.hidden_act!r} is not one of {ACTIVATIONS}")
        for name in ("layer_norm_eps", "initializer_range"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{name}: must be a positive number, got {value!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def preset(cls, name: str, **overrides) -> BertConfig:
        if name not in PRESETS:
            raise ConfigError(f"preset: unknown {name!r}; choose one of {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> BertConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known - _HF_METADATA)
        if unknown:
            raise ConfigError(f"{source}: unknown field(s) {unknown}")
        if values.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError(f"{source}: position_embedding_type must be 'absolute'")
        if values.get("tie_word_embeddings", True) is not True:
            raise ConfigError(f"{source}: tie_word_embeddings must be true (the MLM decoder is tied)")
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def from_json(cls, path: str) -> BertConfig:
        """Read BERT's ``bert_config.json`` or transformers' ``config.json``."""
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: cannot read a JSON model config ({e})") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        try:
            return cls.from_dict(values, source=path)
        except TypeError as e:  # wrong value types caught by the dataclass
            raise ConfigError(f"{path}: {e}") from None

    def to_dict(self, transformers: bool = False) -> dict:
        out = asdict(self)
        if transformers:
            out.update(
                architectures=["BertForPreTraining"],
                model_type="bert",
                pad_token_id=0,
                position_embedding_type="absolute",
                tie_word_embeddings=True,
            )
        return out

    def to_json(self, path: str, transformers: bool = False) -> None:
        """Write ``bert_config.json`` (BERT's) or, with ``transformers=True``, ``config.json``."""
        write_text(path, json.dumps(self.to_dict(transformers), indent=2, sort_keys=True) + "\n")


PRESETS = {
    "tiny": BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "small": BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    "base": BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": BertConfig(),
}
