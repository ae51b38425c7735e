"""BERT for pretraining on unpadded batches: embeddings -> encoder -> MLM and NSP heads.

The model runs on a flat token dimension from the embeddings to the heads. For an
``UnpaddedBatch`` that is T real tokens and no padding is ever computed; for a
``PaddedBatch`` (the baseline) it is B*S tokens, padding included; for a ``PackedBatch`` it
is R*S tokens of rows packed with whole sequences. The attention backend,
chosen by name (``kernels.registry``), is told which tokens form which sequence through a
layout object.

The masked-LM head runs only at the M masked positions (gathered before the head, as the
MLPerf submissions do), so the vocabulary projection costs M rows, not T.

Numerics match ``transformers.BertForPreTraining`` (post-LayerNorm BERT, erf GELU, tied
decoder) given the same weights; ``bert.checkpoint`` maps the state dicts both ways. The
query, key and value projections are one fused ``[3*hidden, hidden]`` linear layer.

Shape legend: N tokens the layers run on (T unpadded, B*S padded, R*S packed), B sequences,
M masked positions, H heads, D head dim, C hidden size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bert.config import ACTIVATIONS, BertConfig, ConfigError
from bert.fp8 import matmul
from data.batch import PackedBatch, PaddedBatch, UnpaddedBatch
from kernels.gemm_epilogue import linear_bias_gelu
from kernels.interface import PackedLayout, PaddedLayout, VarlenLayout
from kernels.registry import get_backend

BIAS_GELU = ("eager", "triton", "epilogue")  # the FFN-in's bias+GELU implementations


@dataclass
class PretrainingOutput:
    mlm_logits: Tensor  # [M, V]
    nsp_logits: Tensor  # [B, 2]
    hidden_states: Tensor  # [N, C], the last encoder layer


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


# hidden_act -> the function; the names are bert.config.ACTIVATIONS.
_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh, "relu": F.relu}


def activation(name: str):
    if name not in _ACTIVATIONS:  # BertConfig refuses it first; a config built around it lands here
        raise ConfigError(f"hidden_act: {name!r} is not one of {ACTIVATIONS}")
    return _ACTIVATIONS[name]


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, segment_ids: Tensor, position_ids: Tensor) -> Tensor:
        x_NC = self.word(input_ids) + self.position(position_ids) + self.token_type(segment_ids)
        return self.dropout(self.norm(x_NC))


class BertLayer(nn.Module):
    """One post-LayerNorm transformer layer: attention, residual + LN, FFN, residual + LN."""

    def __init__(self, config: BertConfig, attention_fn, fused_ops: bool, bias_gelu: str):
        super().__init__()
        c, i = config.hidden_size, config.intermediate_size
        self.num_heads = config.num_attention_heads
        self.qkv = nn.Linear(c, 3 * c)
        self.attn_out = nn.Linear(c, c)
        self.attn_norm = nn.LayerNorm(c, eps=config.layer_norm_eps)
        self.ffn_in = nn.Linear(c, i)
        self.ffn_out = nn.Linear(i, c)
        self.ffn_norm = nn.LayerNorm(c, eps=config.layer_norm_eps)
        self.hidden_dropout = config.hidden_dropout_prob
        self.attention_dropout = config.attention_probs_dropout_prob
        self.act = activation(config.hidden_act)
        self.attention_fn = attention_fn
        self.fused_ops = fused_ops
        self.bias_gelu = bias_gelu

    def forward(self, x_NC: Tensor, layout) -> Tensor:
        n, c = x_NC.shape
        q_NHD, k_NHD, v_NHD = self.qkv(x_NC).view(n, 3, self.num_heads, c // self.num_heads).unbind(1)
        a_NHD = self.attention_fn(q_NHD, k_NHD, v_NHD, layout, self.attention_dropout, self.training)
        x_NC = self._residual_norm(a_NHD.reshape(n, c), self.attn_out, x_NC, self.attn_norm)
        if self.bias_gelu == "triton":
            h_NI = _fused().bias_gelu(matmul(self.ffn_in, x_NC), self.ffn_in.bias)
        elif self.bias_gelu == "epilogue":
            h_NI = linear_bias_gelu(x_NC, self.ffn_in.weight, self.ffn_in.bias)
        else:
            h_NI = self.act(self.ffn_in(x_NC))
        return self._residual_norm(h_NI, self.ffn_out, x_NC, self.ffn_norm)

    def _residual_norm(self, h: Tensor, proj: nn.Linear, residual: Tensor, norm: nn.LayerNorm) -> Tensor:
        """LayerNorm(residual + dropout(proj(h)))."""
        if self.fused_ops:
            return _fused().bias_dropout_add_layer_norm(
                matmul(proj, h),
                proj.bias,
                residual,
                norm.weight,
                norm.bias,
                self.hidden_dropout,
                norm.eps,
                self.training,
            )
        return norm(residual + F.dropout(proj(h), self.hidden_dropout, self.training))


def _fused():
    import kernels.fused_ops as fused_ops  # imported on use: Triton only when asked for

    return fused_ops


class BertForPreTraining(nn.Module):
    """BERT with the masked-LM and next-sentence heads.

    ``attention`` names the backend (``kernels.registry.backend_names()``) and
    ``attention_options`` are its settings, if it takes any; ``fused_ops`` switches the
    bias+GELU and bias+dropout+residual+LayerNorm Triton kernels on; ``bias_gelu`` picks the
    FFN-in's bias+GELU alone: ``eager``, ``triton`` (the fused kernel) or ``epilogue`` (in the
    GEMM, ``kernels.gemm_epilogue``); ``auto`` is ``triton`` with ``fused_ops``, else ``eager``.
    """

    def __init__(
        self,
        config: BertConfig,
        attention: str = "reference",
        fused_ops: bool = False,
        attention_options: dict | None = None,
        bias_gelu: str = "auto",
    ):
        super().__init__()
        self.config = config
        self.attention = attention
        if bias_gelu == "auto":
            bias_gelu = "triton" if fused_ops else "eager"
        if bias_gelu not in BIAS_GELU:
            raise ValueError(f"model.bias_gelu: {bias_gelu!r} is not one of {['auto', *BIAS_GELU]}")
        if config.hidden_act != "gelu" and fused_ops:
            raise ValueError(f"model.fused_ops: the fused kernels implement erf GELU, not {config.hidden_act!r}")
        if config.hidden_act != "gelu" and bias_gelu != "eager":
            raise ValueError(f"model.bias_gelu: {bias_gelu} implements GELU, not {config.hidden_act!r}")
        attention_fn = get_backend(attention, **(attention_options or {}))
        c = config.hidden_size
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(
            BertLayer(config, attention_fn, fused_ops, bias_gelu) for _ in range(config.num_hidden_layers)
        )
        self.pooler = nn.Linear(c, c)
        self.mlm_transform = nn.Linear(c, c)
        self.mlm_norm = nn.LayerNorm(c, eps=config.layer_norm_eps)
        self.mlm_bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.nsp = nn.Linear(c, 2)
        self.act = activation(config.hidden_act)
        # bert.cuda_graphs.EncoderGraphs (train.cuda_graphs): replays the layers for unpadded batches.
        self.encoder_graphs = None
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, batch: UnpaddedBatch | PaddedBatch | PackedBatch) -> PretrainingOutput:
        if isinstance(batch, UnpaddedBatch):
            ids, seg, pos = batch.input_ids, batch.segment_ids, batch.position_ids  # [T]
            layout = VarlenLayout(batch.cu_seqlens, batch.max_seqlen)
            cls_index = batch.cu_seqlens[:-1].long()  # [B]
        elif isinstance(batch, PaddedBatch):
            b, s = batch.input_ids.shape
            ids, seg, pos = (x.reshape(-1) for x in (batch.input_ids, batch.segment_ids, batch.position_ids))
            layout = PaddedLayout(batch.attention_mask)
            cls_index = torch.arange(b, device=ids.device) * s
        elif isinstance(batch, PackedBatch):  # R*S tokens, several sequences per row
            ids, seg, pos = (x.reshape(-1) for x in (batch.input_ids, batch.segment_ids, batch.position_ids))
            layout = PackedLayout(batch.startend_row_indices)
            cls_index = batch.cls_positions
        else:
            raise TypeError(f"batch: expected UnpaddedBatch, PaddedBatch or PackedBatch, got {type(batch).__name__}")

        x_NC = self.embeddings(ids, seg, pos)
        if self.encoder_graphs is not None and isinstance(batch, UnpaddedBatch):
            x_NC = self.encoder_graphs(x_NC, batch.cu_seqlens)
        else:
            for layer in self.layers:
                x_NC = layer(x_NC, layout)

        pooled_BC = torch.tanh(self.pooler(x_NC[cls_index]))
        nsp_logits = self.nsp(pooled_BC)
        m_MC = self.mlm_norm(self.act(self.mlm_transform(x_NC[batch.mlm_positions])))
        mlm_logits = F.linear(m_MC, self.embeddings.word.weight, self.mlm_bias)  # tied decoder
        return PretrainingOutput(mlm_logits=mlm_logits, nsp_logits=nsp_logits, hidden_states=x_NC)
