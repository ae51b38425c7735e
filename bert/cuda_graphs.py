"""CUDA graphs of the encoder, one per static shape (``train.cuda_graphs``; CUDA only).

Sits inside ``BertForPreTraining.forward``: the embeddings and the heads run eagerly, the
stack of encoder layers replays a graph. With ``train.static_shapes`` a micro-batch has one
of a few token counts T' (``data.static_shapes``), and ``max_seqlen`` is a constant, so
each T' gets its graphs the first time it is seen:

- training: ``torch.cuda.make_graphed_callables`` on a view of the layers, which captures
  the forward and the backward as two graphs behind one autograd function. It was chosen
  over ``torch.compile(mode="reduce-overhead")`` because it captures the eager kernels as
  they are (the Triton varlen kernel, the fused ops, cuBLAS) with no recompilation per
  shape and no graph breaks to hunt, and because the backward is graphed too;
  DDP's gradient hooks still fire, on the parameters' gradient accumulation after the
  backward graph.
- evaluation: a forward-only graph captured under ``no_grad`` into static input buffers.

All graphs share one memory pool. That is safe because they replay one after another and
each one's outputs are consumed before the next replays: a micro-batch runs its forward
then its backward, evaluation runs between steps.

What a graph needs from the rest of the step, checked when the run is configured
(``bert.train_config.check_cuda_graphs``) or when the model is built:

- the attention backend reads ``cu_seqlens`` on the device (``triton``, the single-launch
  varlen kernel, or ``padded``); ``triton_grouped`` plans its groups from the lengths on the
  host, a plan a replay would freeze, so it is refused;
- dropout draws fresh masks on every replay: torch's CUDA generator registers its Philox
  seed and offset with the graph (``padded`` attention, unfused ops), and the Triton
  kernels and fused ops read theirs through a pointer from the trainer's device state
  (``kernels.runtime.philox_from``), which an op in the graph advances (``docs/step.md``);
- autocast without its weight cache (``cache_enabled=False``), as graphs require.

Shape legend: N tokens (T' here), C hidden size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels.interface import VarlenLayout


class _Encoder(nn.Module):
    """The model's layers as one module taking (x [N, C], cu_seqlens [B+1], position_ids [N]);
    shares their parameters. Each layer gets its attention window (None: global) and, for a
    rotary model, the model's rotary table."""

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
    """Graphed encoder forward (+ backward when training), per (T', B + 1) shape.

    ``shapes`` lists the shapes captured so far (the summary reports their number).
    """

    def __init__(self, layers: nn.ModuleList, max_seqlen: int, rotary: nn.Module | None = None, num_warmup_iters=3):
        if not torch.cuda.is_available():
            raise RuntimeError("train.cuda_graphs: CUDA graphs need a CUDA device")
        self.layers, self.max_seqlen, self.num_warmup_iters = layers, max_seqlen, num_warmup_iters
        self.rotary = rotary
        self.pool = torch.cuda.graph_pool_handle()
        self._train: dict[tuple[int, int], nn.Module] = {}
        self._eval: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor, Tensor, Tensor, Tensor]] = {}

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return sorted(set(self._train) | set(self._eval))

    def __call__(self, x_NC: Tensor, cu_seqlens: Tensor, position_ids: Tensor) -> Tensor:
        key = (x_NC.shape[0], cu_seqlens.shape[0])
        if torch.is_grad_enabled() and self.layers.training:
            graphed = self._train.get(key)
            if graphed is None:
                graphed = self._train[key] = self._capture_train(x_NC, cu_seqlens, position_ids)
            return graphed(x_NC, cu_seqlens, position_ids)
        entry = self._eval.get(key)
        if entry is None:
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
        return torch.cuda.make_graphed_callables(view, sample, num_warmup_iters=self.num_warmup_iters, pool=self.pool)

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


DEVICE_DRAWN_ATTENTION_DROPOUT = ("padded", "triton")


def graph_safe_dropout(attention: str, attention_dropout: float) -> str | None:
    """None when dropout draws fresh masks under replay; else why not (for a one-line error).

    Hidden dropout always does: unfused it is torch's, fused the kernels' device state."""
    if attention_dropout > 0 and attention not in DEVICE_DRAWN_ATTENTION_DROPOUT:
        return (
            f"model.attention={attention!r}'s dropout is not known to draw on the device under a replay; "
            f"use one of {list(DEVICE_DRAWN_ATTENTION_DROPOUT)} or attention_probs_dropout_prob=0"
        )
    return None
