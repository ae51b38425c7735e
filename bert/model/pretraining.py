"""BERT for pretraining on unpadded batches: embeddings -> encoder -> MLM and NSP heads.

The encoder is assembled from parts (``bert.model.layers``) as its ``BertConfig`` says. It runs on a
flat token dimension; the attention backend (``kernels.registry``) learns the sequences from a
layout, one per layer window. The MLM head runs only at the M masked positions. Numerics match
``transformers.BertForPreTraining`` and ``ModernBertForMaskedLM`` given the same weights.

Shape legend: N tokens the layers run on (T unpadded, B*S padded, R*S packed), B sequences,
M masked positions, H heads, D head dim, C hidden size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bert.distributed.context_parallel import ContextBatch
from bert.model.config import BertConfig, resolve_bias_gelu
from bert.model.layers import Embeddings, EncoderLayer, Rotary, activation, init_weights, make_norm
from data.batch import PackedBatch, PaddedBatch, UnpaddedBatch
from kernels.context_parallel import ContextLayout, context_parallel_backend
from kernels.interface import PackedLayout, PaddedLayout, VarlenLayout
from kernels.masks import window_bounds
from kernels.registry import get_backend


@dataclass
class PretrainingOutput:
    mlm_logits: Tensor  # [M, V]
    nsp_logits: Tensor | None  # [B, 2]; None without a next-sentence head (config.next_sentence false)
    hidden_states: Tensor  # [N, C], the last encoder layer (after the final norm of a pre-norm encoder)


def windowed(layout, window: int | None):
    """``layout`` restricted to the band |i - j| <= window // 2 (None: the layout itself). The
    packed layout carries a window in its FlashMask bounds (kernels.masks.window_bounds)."""
    if window is None:
        return layout
    if isinstance(layout, PackedLayout):
        return PackedLayout(window_bounds(layout.startend_row_indices, window, n=2), layout.causal)
    return replace(layout, window=window)


class BertForPreTraining(nn.Module):
    """BERT with the masked-LM and next-sentence heads. ``attention``: the backend's name
    (``kernels.registry``), ``attention_options`` its settings; ``fused_ops``: the bias+GELU and
    bias+dropout+residual+LayerNorm Triton kernels (post-norm BERT only); ``bias_gelu``: the
    FFN-in's bias+GELU alone (``bert.model.config.resolve_bias_gelu``); ``rotary_kernel``: ``torch``
    (the reference) or ``triton`` (``kernels.ops.rotary``)."""

    def __init__(
        self,
        config: BertConfig,
        attention: str = "reference",
        fused_ops: bool = False,
        attention_options: dict | None = None,
        bias_gelu: str = "auto",
        rotary_kernel: str = "torch",
        context_parallel: bool = False,
        context_group=None,
    ):
        super().__init__()
        self.config = config
        self.attention = attention
        bias_gelu = resolve_bias_gelu(config, fused_ops, bias_gelu)  # the one check, for raw arguments too
        attention_fn = get_backend(attention, **(attention_options or {}))
        if context_parallel:
            attention_fn = context_parallel_backend(attention, **(attention_options or {}))
        self.context_parallel, self.context_group = context_parallel, context_group
        c = config.hidden_size
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(
            EncoderLayer(config, i, attention_fn, fused_ops, bias_gelu) for i in range(config.num_hidden_layers)
        )
        self.final_norm = make_norm(config) if config.norm_placement == "pre" else None
        self.rotary = Rotary(config, rotary_kernel) if config.position_embedding == "rotary" else None
        self.pooler = nn.Linear(c, c) if config.next_sentence else None
        self.mlm_transform = nn.Linear(c, c, bias=config.head_bias)
        self.mlm_norm = make_norm(config)
        self.mlm_bias = nn.Parameter(torch.zeros(config.vocab_size)) if config.decoder_bias else None
        self.nsp = nn.Linear(c, 2) if config.next_sentence else None
        self.act = activation(config.hidden_act)
        # bert.train.cuda_graphs.EncoderGraphs (train.cuda_graphs): replays the layers for unpadded batches.
        self.encoder_graphs = None
        init_weights(self, config)

    def forward(self, batch: UnpaddedBatch | PaddedBatch | PackedBatch | ContextBatch) -> PretrainingOutput:
        shard = None
        if isinstance(batch, ContextBatch):
            if not self.context_parallel:
                raise ValueError("a ContextBatch needs a model built with context_parallel=True")
            batch, shard = batch.batch, batch.shard
        if isinstance(batch, UnpaddedBatch):
            ids, seg, pos = batch.input_ids, batch.segment_ids, batch.position_ids  # [T]
            # Host lengths spare grouped attention a device read; not under torch.compile (docs/step.md).
            lens = None if torch.compiler.is_compiling() else batch.host_seqlens
            layout = VarlenLayout(batch.cu_seqlens, batch.max_seqlen, host_seqlens=lens)
            if shard is not None:  # a piece's first token is no [CLS]: its NSP label is ignored
                layout = ContextLayout(batch.cu_seqlens, batch.max_seqlen, shard, self.context_group)
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

        layouts = {window: windowed(layout, window) for window in set(self.config.layer_windows)}
        x_NC = self.embeddings(ids, seg, pos)
        if self.encoder_graphs is not None and shard is not None:
            raise ValueError("train.cuda_graphs: a graph replays one layout; context parallelism changes it each step")
        if self.encoder_graphs is not None and isinstance(batch, UnpaddedBatch):
            x_NC = self.encoder_graphs(x_NC, batch.cu_seqlens, pos)
        else:
            for layer in self.layers:
                x_NC = layer(x_NC, layouts[layer.window], pos, self.rotary)
        if self.final_norm is not None:
            x_NC = self.final_norm(x_NC)

        nsp_logits = None if self.nsp is None else self.nsp(torch.tanh(self.pooler(x_NC[cls_index])))  # [B, 2]
        m_MC = self.mlm_norm(self.act(self.mlm_transform(x_NC[batch.mlm_positions])))
        mlm_logits = F.linear(m_MC, self.embeddings.word.weight, self.mlm_bias)  # tied decoder
        return PretrainingOutput(mlm_logits=mlm_logits, nsp_logits=nsp_logits, hidden_states=x_NC)
