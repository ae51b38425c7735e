"""The encoder's hyper-parameters: ``BertConfig``, its presets, and JSON I/O.

The first block of fields is BERT's own (``bert_config.json`` and transformers' ``config.json``
load directly); the second says how the encoder is assembled (``bert.model.layers``), BERT by default
and written to JSON only where it differs. Every field is checked on construction, and the
parameters' memory before anything is built. Presets and their sources: docs/modern_encoders.md.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace

from common.config import short
from common.errors import ConfigError
from common.files import write_text

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")
LAYER_TYPES = ("global", "local")

# Keys of transformers' config.json that are its bookkeeping, not the architecture (others are errors).
_HF_METADATA = set(
    "architectures model_type torch_dtype dtype transformers_version pad_token_id use_cache classifier_dropout "
    "gradient_checkpointing directionality pooler_fc_size pooler_num_attention_heads pooler_num_fc_layers "
    "pooler_size_per_head pooler_type output_past bos_token_id eos_token_id id2label label2id output_hidden_states "
    "output_attentions return_dict is_decoder add_cross_attention tie_word_embeddings position_embedding_type "
    "problem_type".split()
)


MAX_SIZE = 2**31 - 1  # every size indexes int32 tensors somewhere
_INT_LEAST = {"type_vocab_size": 0, "local_window": 2}  # 0 token types: none; a window of 1 is no band
_PROBABILITIES = ("hidden_dropout_prob", "attention_probs_dropout_prob")
_CHOICES = {  # the values of each str field
    "hidden_act": ACTIVATIONS,
    "norm_placement": ("post", "pre"),
    "norm_kind": ("layernorm", "rmsnorm"),
    "position_embedding": ("absolute", "rotary"),
    "mlp": ("dense", "gated"),
    "init_scheme": ("bert", "modernbert"),
}


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except OverflowError:  # an integer past float's range
        return False


def _part(default):  # a field of the second block (the module docstring)
    return field(default=default, metadata={"part": True})


def alternating_layers(num_layers: int, global_every: int) -> tuple[str, ...]:
    """ModernBERT's pattern: layer i is global when i % global_every == 0, else local."""
    return tuple("global" if i % global_every == 0 else "local" for i in range(num_layers))


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
    # ---- how the encoder is assembled (bert.model.layers); the defaults are BERT ------------------
    # post: x = norm(x + f(x)) (BERT); pre: x = x + f(norm(x)) with a final norm after the last layer.
    norm_placement: str = _part("post")
    norm_kind: str = _part("layernorm")  # layernorm or rmsnorm (RMSNorm never has a bias)
    norm_bias: bool = _part(True)  # LayerNorm with a bias (BERT) or without (ModernBERT)
    position_embedding: str = _part("absolute")  # absolute: a learned table; rotary: RoPE on q and k
    rope_theta_global: float = _part(10000.0)  # rotary base of global layers
    rope_theta_local: float = _part(10000.0)  # rotary base of local (sliding-window) layers
    # dense: act(W x); gated: act(W_in x) * (W_gate x), one fused linear [2*intermediate, hidden],
    # input half first (GeGLU with hidden_act gelu, SwiGLU with silu).
    mlp: str = _part("dense")
    attention_bias: bool = _part(True)  # biases of the QKV and output projections
    mlp_bias: bool = _part(True)  # biases of the MLP's two projections
    head_bias: bool = _part(True)  # bias of the masked-LM head's transform
    decoder_bias: bool = _part(True)  # the masked-LM decoder's bias (the decoder weight is the word embeddings)
    embedding_norm: bool = _part(True)  # a norm after the embeddings
    first_attn_norm: bool = _part(True)  # pre-norm: a norm before layer 0's attention (ModernBERT has none)
    next_sentence: bool = _part(True)  # the pooler and the next-sentence head (BERT's NSP)
    # Per layer, "global" or "local" (attention inside |i - j| <= local_window // 2 of the same
    # sequence); empty: every layer global. ``alternating_layers`` writes ModernBERT's pattern.
    layer_types: tuple[str, ...] = _part(())
    local_window: int = _part(128)
    # bert: normal(0, initializer_range) everywhere; modernbert: truncated at 2 std, output
    # projections (attention, MLP, head transform) at initializer_range / sqrt(2 * layers).
    init_scheme: str = _part("bert")

    def __post_init__(self):
        for f in fields(self):
            value, name = getattr(self, f.name), f.name
            if f.type == "int":
                least = _INT_LEAST.get(name, 1)
                if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_SIZE:
                    raise ConfigError(f"{name}: must be an integer in [{least}, {MAX_SIZE:,}], got {short(value)}")
            elif f.type == "float":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
                    raise ConfigError(f"{name}: must be a finite number, got {short(value)}")
                object.__setattr__(self, name, float(value))
                if name in _PROBABILITIES and not 0.0 <= value < 1.0:
                    raise ConfigError(f"{name}: must lie in [0, 1), got {value!r}")
                if name not in _PROBABILITIES and value <= 0:
                    raise ConfigError(f"{name}: must be a positive number, got {value!r}")
            elif f.type == "bool" and not isinstance(value, bool):
                raise ConfigError(f"{name}: must be true or false, got {short(value)}")
            elif f.type == "str" and value not in _CHOICES[name]:
                raise ConfigError(f"{name}: {short(value)} is not one of {_CHOICES[name]}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size: {self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        if isinstance(self.layer_types, list):  # from JSON
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if not isinstance(self.layer_types, tuple) or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ConfigError(f"layer_types: expected a list of {LAYER_TYPES}, got {short(self.layer_types)}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types: {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}"
            )
        # The fp32 parameters alone against the machine's memory, before anything is allocated:
        # a typo of 10**9 is a line, not a MemoryError.
        need, have = 4 * self.parameter_count(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > have:
            raise ConfigError(
                f"the model's fp32 parameters alone take {need / 2**30:,.4g} GiB (vocab_size {self.vocab_size}, "
                f"hidden_size {self.hidden_size}, num_hidden_layers {self.num_hidden_layers}, "
                f"max_position_embeddings {self.max_position_embeddings}), more than this machine's "
                f"{have / 2**30:,.0f} GiB"
            )
        if self.position_embedding == "rotary" and self.head_dim % 2:
            raise ConfigError(f"position_embedding: rotary needs an even head dim, got {self.head_dim}")
        if self.norm_kind == "rmsnorm" and self.norm_bias:
            raise ConfigError("norm_bias: RMSNorm has no bias; set norm_bias false")

    def parameter_count(self) -> int:
        """Parameters of ``bert.model.BertForPreTraining`` for this config (tests check it), with
        the rotary tables' elements, computed without building anything."""
        H, inner, V = self.hidden_size, self.intermediate_size, self.vocab_size
        norm = H * (2 if self.norm_kind == "layernorm" and self.norm_bias else 1)
        ab, mb = int(self.attention_bias), int(self.mlp_bias)
        width = 2 * inner if self.mlp == "gated" else inner
        layer = 4 * H * H + 4 * H * ab + width * (H + mb) + H * (inner + mb) + 2 * norm
        n = V * H + self.type_vocab_size * H + norm * self.embedding_norm + self.num_hidden_layers * layer
        n -= norm * (self.norm_placement == "pre" and not self.first_attn_norm)  # layer 0's missing attention norm
        if self.position_embedding == "absolute":
            n += self.max_position_embeddings * H
        else:  # cos and sin tables per layer type
            n += 2 * len(set(self.layer_types) or {"global"}) * self.max_position_embeddings * (self.head_dim // 2)
        n += norm * (self.norm_placement == "pre") + H * H + H * self.head_bias + norm + V * self.decoder_bias
        return n + (H * H + H + 2 * H + 2) * self.next_sentence

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, the attention window (None: global)."""
        types = self.layer_types or ("global",) * self.num_hidden_layers
        return tuple(self.local_window if t == "local" else None for t in types)

    @property
    def is_bert(self) -> bool:
        """Whether every part field is BERT's (the architecture transformers' BertForPreTraining is)."""
        return all(getattr(self, f.name) == f.default for f in fields(self) if f.metadata.get("part"))

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
        if unknown := sorted(set(values) - known - _HF_METADATA):
            raise ConfigError(f"{source}: unknown field(s) {unknown}")
        if values.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError(f"{source}: position_embedding_type must be 'absolute'")
        if values.get("tie_word_embeddings", True) is not True:
            raise ConfigError(f"{source}: tie_word_embeddings must be true (the MLM decoder is tied)")
        return cls(**{k: v for k, v in values.items() if k in known})

    def to_dict(self, transformers: bool = False) -> dict:
        """BERT's fields, and the part fields that differ from BERT's; ``transformers=True``:
        transformers' ``BertConfig`` (other architectures: ``bert.model.hf_modernbert``)."""
        parts = {f.name: f.default for f in fields(self) if f.metadata.get("part")}
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        out = {k: v for k, v in out.items() if k not in parts or getattr(self, k) != parts[k]}
        if transformers:
            if not self.is_bert:
                raise ConfigError("to_dict: only a BERT-shaped config is a transformers BertConfig")
            out.update(architectures=["BertForPreTraining"], model_type="bert", pad_token_id=0)
            out.update(position_embedding_type="absolute", tie_word_embeddings=True)
        return out

    def to_json(self, path: str, transformers: bool = False) -> None:
        """Write ``bert_config.json`` (BERT's) or, with ``transformers=True``, ``config.json``."""
        write_text(path, json.dumps(self.to_dict(transformers), indent=2, sort_keys=True) + "\n")


def _modernbert(**shape) -> BertConfig:
    """ModernBERT's architecture sized by ``shape``; the values and their sources: docs/modern_encoders.md."""
    layers = shape.pop("num_hidden_layers", 22)
    values = dict(vocab_size=50368, num_hidden_layers=layers, max_position_embeddings=8192, type_vocab_size=0)
    values.update(hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    values.update(norm_placement="pre", norm_bias=False, layer_norm_eps=1e-5, first_attn_norm=False)
    values.update(position_embedding="rotary", rope_theta_global=160000.0, rope_theta_local=10000.0)
    values.update(mlp="gated", attention_bias=False, mlp_bias=False, head_bias=False, next_sentence=False)
    values.update(layer_types=alternating_layers(layers, 3), local_window=128, init_scheme="modernbert")
    return BertConfig(**(values | shape))


PRESETS = {
    "tiny": BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "small": BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    "base": BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": BertConfig(),
    "modernbert_base": _modernbert(
        hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152
    ),
    "modernbert_large": _modernbert(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=2624
    ),
    "modernbert_tiny": _modernbert(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=192,
        max_position_embeddings=512,
        local_window=32,
        rope_theta_global=10000.0,
    ),
}


BIAS_GELU = ("eager", "triton", "epilogue")  # the FFN-in's bias+GELU (epilogue: in the GEMM, kernels.ops.gemm_epilogue)


def resolve_bias_gelu(config: BertConfig, fused_ops: bool, bias_gelu: str) -> str:
    """The FFN-in's bias+GELU (``auto`` resolved: triton with the fused kernels on a dense MLP, else
    eager), with ``fused_ops``, checked against the block they implement (ConfigError naming the field)."""
    if bias_gelu == "auto":
        bias_gelu = "triton" if fused_ops and config.mlp == "dense" else "eager"
    if bias_gelu not in BIAS_GELU:
        raise ConfigError(f"model.bias_gelu: {bias_gelu!r} is not one of {['auto', *BIAS_GELU]}")
    if bias_gelu != "eager" and (config.hidden_act != "gelu" or config.mlp != "dense" or not config.mlp_bias):
        raise ConfigError(
            f"model.bias_gelu: {bias_gelu} implements bias + erf GELU of a dense MLP, not "
            f"hidden_act={config.hidden_act!r}, mlp={config.mlp!r}, mlp_bias={config.mlp_bias}"
        )
    if fused_ops:
        if config.hidden_act != "gelu":
            raise ConfigError(f"model.fused_ops: the fused kernels implement erf GELU, not {config.hidden_act!r}")
        bert_block = dict(norm_placement="post", norm_kind="layernorm", norm_bias=True, mlp="dense")
        bert_block.update(attention_bias=True, mlp_bias=True)
        other = [f"{k}={getattr(config, k)!r}" for k, v in bert_block.items() if getattr(config, k) != v]
        if other:
            raise ConfigError(f"model.fused_ops: the fused kernels implement BERT's post-LN block, not {other[0]}")
    return bias_gelu
