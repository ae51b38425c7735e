"""CUDA graphs of the encoder, one per static shape (``train.cuda_graphs``; CUDA only).

``EncoderGraphs`` (``bert.train.build.build_graphs``): the embeddings and heads run eagerly, the encoder layers replay
a graph per (T', B + 1) shape, captured when first seen (forward and backward in training, forward in evaluation), all
in one memory pool. Which backends can replay: ``kernels.registry`` and docs/step.md, "CUDA graphs".

Shape legend: N tokens (T' here), C hidden size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels.interface import VarlenLayout


class _Encoder(nn.Module):
    """The model's layers as one module taking (x [N, C], cu_seqlens [B+1], position_ids [N]); shares their parameters.
    Each layer gets its attention window (None: global) and, for a rotary model, the model's rotary table."""

    def __init__(self, layers: nn.ModuleList, max_seqlen: int, rotary: nn.Module | None):
        super().__init__()
        self.layers, self.max_seqlen, self.rotary = layers, max_seqlen, rotary

    def forward(self, x_NC: Tensor, cu_seqlens: Tensor, position_ids: Tensor) -> Tensor:
        windows = {layer.window for layer in self.layers}
        layouts = {w: VarlenLayout(cu_seqlens, self.max_seqlen, window=w) for w in windows}
        for layer in self.layers:
            x_NC = layer(x_NC, layouts[layer.window], position_ids, self.rotary)
        return x_NC


class EncoderGraphs:
    """Graphed encoder forward (+ backward when training), per (T', B + 1) shape; ``shapes``: those captured so far."""

    def __init__(self, layers: nn.ModuleList, max_seqlen: int, rotary: nn.Module | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("train.cuda_graphs: CUDA graphs need a CUDA device")
        self.layers, self.max_seqlen, self.rotary = layers, max_seqlen, rotary
        self.pool = torch.cuda.graph_pool_handle()
        self._train: dict[tuple[int, int], nn.Module] = {}
        self._eval: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor, Tensor, Tensor, Tensor]] = {}

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return sorted(set(self._train) | set(self._eval))

    def __call__(self, x_NC: Tensor, cu_seqlens: Tensor, position_ids: Tensor) -> Tensor:
        key = (x_NC.shape[0], cu_seqlens.shape[0])
        if torch.is_grad_enabled() and self.layers.training:
            if (graphed := self._train.get(key)) is None:
                graphed = self._train[key] = self._capture_train(x_NC, cu_seqlens, position_ids)
            return graphed(x_NC, cu_seqlens, position_ids)
        if (entry := self._eval.get(key)) is None:
            entry = self._eval[key] = self._capture_eval(x_NC, cu_seqlens, position_ids)
        graph, static_x, static_cu, static_pos, static_out = entry
        static_x.copy_(x_NC)
        static_cu.copy_(cu_seqlens)
        static_pos.copy_(position_ids)
        graph.replay()
        return static_out  # valid until the next replay; the heads consume it at once

    def _capture_train(self, x_NC: Tensor, cu_seqlens: Tensor, position_ids: Tensor) -> nn.Module:
        view = _Encoder(self.layers, self.max_seqlen, self.rotary)
        sample = (x_NC.detach().clone().requires_grad_(x_NC.requires_grad), cu_seqlens.clone(), position_ids.clone())
        return torch.cuda.make_graphed_callables(view, sample, num_warmup_iters=3, pool=self.pool)

    @torch.no_grad()
    def _capture_eval(self, x_NC: Tensor, cu_seqlens: Tensor, position_ids: Tensor):
        view = _Encoder(self.layers, self.max_seqlen, self.rotary)
        static_x, static_cu, static_pos = x_NC.detach().clone(), cu_seqlens.clone(), position_ids.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: autotuning, lazy inits
            for _ in range(2):
                view(static_x, static_cu, static_pos)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_out = view(static_x, static_cu, static_pos)
        return graph, static_x, static_cu, static_pos, static_out
