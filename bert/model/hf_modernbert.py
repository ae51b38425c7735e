"""The transformers adapter of ModernBERT: ``ModernBertForMaskedLM`` <-> this model, for a
pre-norm, rotary, gated-MLP config (the ``modernbert_*`` presets), by renaming alone; the contract
every adapter keeps is in ``bert.model.hf``. Dropout: docs/modern_encoders.md, "Exact against transformers".
"""

from __future__ import annotations

from dataclasses import replace

from bert.model.config import _HF_METADATA, BertConfig, alternating_layers
from common.config import short
from common.errors import ConfigError

_TYPES = {"full_attention": "global", "sliding_attention": "local"}
_HF_TYPES = {v: k for k, v in _TYPES.items()}

TIED = {"decoder.weight": "model.embeddings.tok_embeddings.weight"}
IGNORED: set[str] = set()
VOCAB_ROWS = ("model.embeddings.tok_embeddings.weight", "decoder.weight", "decoder.bias")

# config.json keys that hold no architecture: transformers' bookkeeping (as for BERT) and
# ModernBERT's token ids, fine-tuning heads and inference switches.
_IGNORED_KEYS = _HF_METADATA | set(
    "_name_or_path chunk_size_feed_forward is_encoder_decoder cls_token_id sep_token_id classifier_pooling"
    " deterministic_flash_attn sparse_prediction sparse_pred_ignore_index initializer_cutoff_factor"
    " reference_compile repad_logits_with_grad".split()
)
# ModernBertConfig's keys that are a BertConfig field renamed -> (the field, ModernBertConfig's default).
_RENAMED = {
    "vocab_size": ("vocab_size", 50368),
    "hidden_size": ("hidden_size", 768),
    "num_hidden_layers": ("num_hidden_layers", 22),
    "num_attention_heads": ("num_attention_heads", 12),
    "intermediate_size": ("intermediate_size", 1152),
    "hidden_activation": ("hidden_act", "gelu"),
    "attention_dropout": ("attention_probs_dropout_prob", 0.0),
    "max_position_embeddings": ("max_position_embeddings", 8192),
    "norm_eps": ("layer_norm_eps", 1e-5),
    "initializer_range": ("initializer_range", 0.02),
    "norm_bias": ("norm_bias", False),
    "attention_bias": ("attention_bias", False),
    "mlp_bias": ("mlp_bias", False),
    "classifier_bias": ("head_bias", False),
    "decoder_bias": ("decoder_bias", True),
    "local_attention": ("local_window", 128),
}
# BertConfig fields transformers' ModernBERT fixes (a config with another value has no ModernBertConfig).
_FIXED = dict(norm_placement="pre", norm_kind="layernorm", position_embedding="rotary", mlp="gated", type_vocab_size=0)
_FIXED.update(embedding_norm=True, first_attn_norm=False, next_sentence=False)


def config_from_hf(values: dict, source: str = "config") -> BertConfig:
    """The ``BertConfig`` of a ModernBERT ``config.json`` (as a dict); ConfigError names the key."""
    known = set(_RENAMED) | set(
        "embedding_dropout mlp_dropout layer_types global_attn_every_n_layers rope_parameters global_rope_theta"
        " local_rope_theta classifier_activation tie_word_embeddings".split()
    )
    if unknown := sorted(set(values) - known - _IGNORED_KEYS):
        raise ConfigError(f"{source}: unknown ModernBERT field(s) {unknown}")
    if values.get("tie_word_embeddings", True) is not True:
        raise ConfigError(f"{source}: tie_word_embeddings must be true (the MLM decoder is tied)")
    act = values.get("hidden_activation", "gelu")
    if values.get("classifier_activation", act) != act:
        raise ConfigError(
            f"{source}: classifier_activation {values['classifier_activation']!r} differs from "
            f"hidden_activation {act!r}; this model's head uses the hidden activation"
        )
    thetas = {"full_attention": values.get("global_rope_theta", 160000.0)}
    thetas["sliding_attention"] = values.get("local_rope_theta", 10000.0)
    rope = values.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{source}: rope_parameters: expected a mapping of layer types, got {short(rope)}")
    for kind, params in rope.items():
        if kind not in _TYPES or not isinstance(params, dict):
            raise ConfigError(f"{source}: rope_parameters: unexpected entry {kind!r}")
        if params.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: rope_parameters.{kind}.rope_type {params['rope_type']!r}: only 'default'")
        thetas[kind] = params.get("rope_theta", thetas[kind])
    try:
        shape = BertConfig(
            **{ours: values.get(hf, default) for hf, (ours, default) in _RENAMED.items()},
            **_FIXED,
            hidden_dropout_prob=max(values.get("embedding_dropout", 0.0), values.get("mlp_dropout", 0.0)),
            rope_theta_global=thetas["full_attention"],
            rope_theta_local=thetas["sliding_attention"],
            init_scheme="modernbert",
        )
        # The layer pattern after the sizes are checked (a num_hidden_layers of 10**9 is refused, not built).
        if values.get("layer_types") is not None:
            given = values["layer_types"]
            bad = next((t for t in given if t not in _TYPES), None) if isinstance(given, list) else given
            if bad is not None:
                raise ConfigError(f"layer_types: {short(bad)} is not one of {sorted(_TYPES)}")
            return replace(shape, layer_types=tuple(_TYPES[t] for t in given))
        every = values.get("global_attn_every_n_layers", 3)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"global_attn_every_n_layers: must be a positive integer, got {short(every)}")
        return replace(shape, layer_types=alternating_layers(shape.num_hidden_layers, every))
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{source}: {e}") from e


def unfit(config: BertConfig) -> str | None:
    """The first field transformers' ModernBERT cannot express (None: it can express them all)."""
    for name, value in _FIXED.items():
        if getattr(config, name) != value:
            return f"{name}={getattr(config, name)!r}: transformers' ModernBERT has {value!r}"
    return None


def config_to_hf(config: BertConfig, token_ids: dict | None = None) -> dict:
    """``ModernBertConfig(**config_to_hf(c))`` is ``c``. ``token_ids``: pad/bos/eos/cls/sep ids
    of the tokenizer (default: ModernBERT's own when the vocabulary is its 50,368, else
    pad 0 and the others unset, as a BERT WordPiece vocabulary has [PAD] at 0)."""
    if problem := unfit(config):
        raise ConfigError(problem)
    if token_ids is None:
        if config.vocab_size == 50368:
            token_ids = dict(pad_token_id=50283, bos_token_id=50281, eos_token_id=50282)
            token_ids.update(cls_token_id=50281, sep_token_id=50282)
        else:
            token_ids = dict(pad_token_id=0, bos_token_id=None, eos_token_id=None, cls_token_id=None, sep_token_id=None)
    types = config.layer_types or ("global",) * config.num_hidden_layers
    out = {hf: getattr(config, ours) for hf, (ours, _) in _RENAMED.items()}
    out.update(architectures=["ModernBertForMaskedLM"], model_type="modernbert", tie_word_embeddings=True, **token_ids)
    out.update(classifier_activation=config.hidden_act, layer_types=[_HF_TYPES[t] for t in types])
    out.update(embedding_dropout=config.hidden_dropout_prob, mlp_dropout=config.hidden_dropout_prob)
    out["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": config.rope_theta_global},
        "sliding_attention": {"rope_type": "default", "rope_theta": config.rope_theta_local},
    }
    return out


def _names(bias: bool, hf: str, ours: str) -> dict[str, str]:
    return {f"{hf}.{p}": f"{ours}.{p}" for p in (("weight", "bias") if bias else ("weight",))}


def name_map(config: BertConfig) -> dict[str, str]:
    """transformers' name -> this model's, for every tensor (the tied decoder weight excepted)."""
    m = {"model.embeddings.tok_embeddings.weight": "embeddings.word.weight"}
    m.update(_names(config.norm_bias, "model.embeddings.norm", "embeddings.norm"))
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        if i > 0:
            m.update(_names(config.norm_bias, f"{hf}.attn_norm", f"{ours}.attn_norm"))
        m.update(_names(config.attention_bias, f"{hf}.attn.Wqkv", f"{ours}.qkv"))
        m.update(_names(config.attention_bias, f"{hf}.attn.Wo", f"{ours}.attn_out"))
        m.update(_names(config.norm_bias, f"{hf}.mlp_norm", f"{ours}.ffn_norm"))
        m.update(_names(config.mlp_bias, f"{hf}.mlp.Wi", f"{ours}.ffn_in"))
        m.update(_names(config.mlp_bias, f"{hf}.mlp.Wo", f"{ours}.ffn_out"))
    m.update(_names(config.norm_bias, "model.final_norm", "final_norm"))
    m.update(_names(config.head_bias, "head.dense", "mlm_transform"))
    m.update(_names(config.norm_bias, "head.norm", "mlm_norm"))
    if config.decoder_bias:
        m["decoder.bias"] = "mlm_bias"
    return m
