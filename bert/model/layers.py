"""The encoder's parts, each chosen by a ``BertConfig`` field; ``bert.model`` assembles them.

Every projection is an ``nn.Linear`` with a fixed name (``qkv``, ``attn_out``, ``ffn_in``, ``ffn_out``)
that name-based conversions (FP8, the transformers adapters) find. The fields: docs/modern_encoders.md.

Shape legend as in ``bert.model``: N tokens, H heads, D head dim, C hidden, I intermediate.
"""

from __future__ import annotations

from functools import partial

import torch.nn.functional as F
from torch import Tensor, nn

from bert.model.config import ACTIVATIONS, BertConfig
from bert.model.fp8 import matmul
from common.errors import ConfigError
from kernels.ops import fused as fused_ops
from kernels.ops import rotary
from kernels.ops.gemm_epilogue import linear_bias_gelu

_gelu_tanh = partial(F.gelu, approximate="tanh")
_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh, "relu": F.relu, "silu": F.silu}


def activation(name: str):
    if name not in _ACTIVATIONS:  # BertConfig refuses it first; a config built around it lands here
        raise ConfigError(f"hidden_act: {name!r} is not one of {ACTIVATIONS}")
    return _ACTIVATIONS[name]


def make_norm(config: BertConfig) -> nn.Module:
    c, eps = config.hidden_size, config.layer_norm_eps
    if config.norm_kind == "rmsnorm":
        return nn.RMSNorm(c, eps=eps)
    return nn.LayerNorm(c, eps=eps, bias=config.norm_bias)


class Embeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        c = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, c)
        absolute = config.position_embedding == "absolute"
        self.position = nn.Embedding(config.max_position_embeddings, c) if absolute else None
        self.token_type = nn.Embedding(config.type_vocab_size, c) if config.type_vocab_size else None
        self.norm = make_norm(config) if config.embedding_norm else nn.Identity()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, segment_ids: Tensor, position_ids: Tensor) -> Tensor:
        x_NC = self.word(input_ids)
        if self.position is not None:
            x_NC = x_NC + self.position(position_ids)
        if self.token_type is not None:
            x_NC = x_NC + self.token_type(segment_ids)
        return self.dropout(self.norm(x_NC))


class Rotary(nn.Module):
    """cos/sin tables ``[P, D/2]`` fp32 per base theta, as buffers that are not saved (they
    follow from the config, so a context extension with a new theta loads old weights)."""

    def __init__(self, config: BertConfig, kernel: str):
        super().__init__()
        if kernel not in ("torch", "triton"):
            raise ValueError(f"model.rotary_kernel: {kernel!r} is not one of ('torch', 'triton')")
        self.kernel = kernel
        for kind, theta in (("global", config.rope_theta_global), ("local", config.rope_theta_local)):
            cos, sin = rotary.rotary_tables(config.head_dim, theta, config.max_position_embeddings)
            self.register_buffer(f"{kind}_cos", cos, persistent=False)
            self.register_buffer(f"{kind}_sin", sin, persistent=False)

    def forward(self, x_NHD: Tensor, position_ids: Tensor, kind: str) -> Tensor:
        fn = rotary.apply_rotary if self.kernel == "triton" else rotary.apply_rotary_reference
        return fn(x_NHD, getattr(self, f"{kind}_cos"), getattr(self, f"{kind}_sin"), position_ids)


class EncoderLayer(nn.Module):
    """One transformer layer, its norm placement and window (None: global) as ``config`` says; the
    layout passed to ``forward`` carries the window (``bert.model.pretraining.windowed``)."""

    def __init__(self, config: BertConfig, index: int, attention_fn, fused_ops: bool, bias_gelu: str = "eager"):
        super().__init__()
        c, i = config.hidden_size, config.intermediate_size
        self.num_heads = config.num_attention_heads
        self.pre_norm = config.norm_placement == "pre"
        self.window = config.layer_windows[index]
        self.kind = "global" if self.window is None else "local"
        self.gated = config.mlp == "gated"
        self.qkv = nn.Linear(c, 3 * c, bias=config.attention_bias)
        self.attn_out = nn.Linear(c, c, bias=config.attention_bias)
        no_attn_norm = self.pre_norm and index == 0 and not config.first_attn_norm
        self.attn_norm = nn.Identity() if no_attn_norm else make_norm(config)
        self.ffn_in = nn.Linear(c, 2 * i if self.gated else i, bias=config.mlp_bias)
        self.ffn_out = nn.Linear(i, c, bias=config.mlp_bias)
        self.ffn_norm = make_norm(config)
        self.hidden_dropout = config.hidden_dropout_prob
        self.attention_dropout = config.attention_probs_dropout_prob
        self.act = activation(config.hidden_act)
        self.attention_fn = attention_fn
        self.fused_ops = fused_ops
        self.bias_gelu = bias_gelu

    def forward(self, x_NC: Tensor, layout, position_ids: Tensor, rotary: Rotary | None) -> Tensor:
        if self.pre_norm:
            a_NC = self._attention(self.attn_norm(x_NC), layout, position_ids, rotary)
            x_NC = x_NC + F.dropout(self.attn_out(a_NC), self.hidden_dropout, self.training)
            return x_NC + F.dropout(self.ffn_out(self._mlp(self.ffn_norm(x_NC))), self.hidden_dropout, self.training)
        a_NC = self._attention(x_NC, layout, position_ids, rotary)
        x_NC = self._residual_norm(a_NC, self.attn_out, x_NC, self.attn_norm)
        return self._residual_norm(self._mlp(x_NC), self.ffn_out, x_NC, self.ffn_norm)

    def _attention(self, x_NC: Tensor, layout, position_ids: Tensor, rotary: Rotary | None) -> Tensor:
        n, c = x_NC.shape
        q_NHD, k_NHD, v_NHD = self.qkv(x_NC).view(n, 3, self.num_heads, c // self.num_heads).unbind(1)
        if rotary is not None:
            q_NHD, k_NHD = rotary(q_NHD, position_ids, self.kind), rotary(k_NHD, position_ids, self.kind)
        a_NHD = self.attention_fn(q_NHD, k_NHD, v_NHD, layout, self.attention_dropout, self.training)
        return a_NHD.reshape(n, c)

    def _mlp(self, x_NC: Tensor) -> Tensor:
        if self.gated:
            input_NI, gate_NI = self.ffn_in(x_NC).chunk(2, dim=-1)
            return self.act(input_NI) * gate_NI
        if self.bias_gelu == "triton":
            return fused_ops.bias_gelu(matmul(self.ffn_in, x_NC), self.ffn_in.bias)
        if self.bias_gelu == "epilogue":
            return linear_bias_gelu(x_NC, self.ffn_in.weight, self.ffn_in.bias)
        return self.act(self.ffn_in(x_NC))

    def _residual_norm(self, h: Tensor, proj: nn.Linear, residual: Tensor, norm: nn.LayerNorm) -> Tensor:
        """LayerNorm(residual + dropout(proj(h)))."""
        if self.fused_ops:
            y_NC = matmul(proj, h)
            return fused_ops.bias_dropout_add_layer_norm(
                y_NC, proj.bias, residual, norm.weight, norm.bias, self.hidden_dropout, norm.eps, self.training
            )
        return norm(residual + F.dropout(proj(h), self.hidden_dropout, self.training))


def init_weights(model: nn.Module, config: BertConfig) -> None:
    """``config.init_scheme`` (the field's comment); modules in ``nn.Module.apply``'s order
    (children first), so a seed gives BERT the same weights it always had."""
    std = config.initializer_range
    out_std = std / (2.0 * config.num_hidden_layers) ** 0.5
    names = {id(m): name.rsplit(".", 1)[-1] for name, m in model.named_modules()}

    def init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            if config.init_scheme == "modernbert":
                s = out_std if names[id(module)] in ("attn_out", "ffn_out", "mlm_transform") else std
                nn.init.trunc_normal_(module.weight, mean=0.0, std=s, a=-2 * s, b=2 * s)
            else:
                nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            nn.init.ones_(module.weight)
        else:
            return
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)

    model.apply(init)
