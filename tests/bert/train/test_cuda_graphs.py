"""CUDA graphs of the encoder (bert.train.cuda_graphs): GPU-only, with the CPU-side refusals."""

from __future__ import annotations

import pytest
import torch

from bert.config import load_config
from bert.model.config import BertConfig
from bert.model.pretraining import BertForPreTraining
from bert.train.losses import pretraining_loss
from common.errors import ConfigError
from data.collate import collate_unpadded
from data.static_shapes import StaticShapes
from data.synthetic import random_block
from kernels import registry

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU; none is available")


def test_cuda_graphs_is_a_one_line_config_error_where_it_cannot_run():
    base = ["train.static_shapes=true", "train.cuda_graphs=true"]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="train.cuda_graphs: CUDA graphs need a CUDA device"):
            load_config(None, base)
    with pytest.raises(ConfigError, match="train.cuda_graphs"):
        load_config(None, ["train.cuda_graphs=true", "train.device=cpu"])
    with pytest.raises(ConfigError, match="train.static_shapes: pads unpadded batches"):
        load_config(None, ["train.static_shapes=true", "data.layout=padded"])
    assert registry.graph_refusal("triton", 0.1) is None  # the kernels' Philox state is on the device
    assert registry.graph_refusal("padded", 0.1) is None  # torch's CUDA generator, registered with the graph
    assert "plans its launches on the host" in registry.graph_refusal("triton_grouped", 0.0)
    assert "flash_attn" not in registry.graph_refusal("triton_grouped", 0.0)  # names the safe ones only


def test_graph_safety_and_device_dropout_are_registry_facts(monkeypatch):
    from kernels.interface import VarlenLayout

    spec = registry.Backend("host_drop", "kernels.reference:reference_attention", (VarlenLayout,), graphs=True)
    monkeypatch.setitem(registry.BACKENDS, "host_drop", spec)
    assert registry.graph_refusal("host_drop", 0.0) is None
    assert "'host_drop''s dropout is not known to draw on the device" in registry.graph_refusal("host_drop", 0.1)


def test_cuda_graphs_refuse_the_sharded_optimizer(monkeypatch):
    """FSDP2's per-layer all-gathers run in module hooks, outside what a replay repeats."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # reach the checks after the device's
    graphed = ["train.static_shapes=true", "train.cuda_graphs=true", "model.attention=padded"]
    with pytest.raises(ConfigError, match="train.cuda_graphs: optim.shard's FSDP2"):
        load_config(None, [*graphed, "optim.shard=dp"])
    load_config(None, graphed)  # unsharded: accepted


def _tiny(attention, dropout=0.0, fused_ops=False):
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return BertForPreTraining(cfg, attention=attention, fused_ops=fused_ops).cuda()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["padded", "triton"])
def test_graph_replay_equals_eager_fp32(attention):
    """Losses and gradients of graphed steps within 1e-6 of eager ones, over several shapes."""
    from bert.train.cuda_graphs import EncoderGraphs

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    eager, graphed = _tiny(attention), _tiny(attention)
    shapes = StaticShapes(token_bucket=128, masked_bucket=16, max_seqlen=128)
    graphed.encoder_graphs = EncoderGraphs(graphed.layers, shapes.max_seqlen)
    for step in range(6):
        block = random_block(6, seed=step, max_seq_length=96, max_predictions=10, vocab_size=64)
        batch = shapes.pad(collate_unpadded(block)).to("cuda")
        m, b = int(block.masked_counts.sum()), len(block)
        results = []
        for model in (eager, graphed):
            model.zero_grad(set_to_none=True)
            out = model(batch)
            loss, _ = pretraining_loss(out.mlm_logits, batch.mlm_labels, out.nsp_logits, batch.nsp_labels, m, b)
            loss.backward()
            results.append((loss.detach(), [p.grad.detach().clone() for p in model.parameters()]))
        torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
        for ge, gg in zip(results[0][1], results[1][1]):
            torch.testing.assert_close(gg, ge, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        eager.eval(), graphed.eval()
        torch.testing.assert_close(graphed(batch).mlm_logits, eager(batch).mlm_logits, rtol=1e-6, atol=1e-6)
    assert len(graphed.encoder_graphs.shapes) >= 2


@gpu
@pytest.mark.gpu
def test_a_graph_replay_draws_fresh_dropout_masks():
    """The Triton attention kernel and the fused ops with dropout, graphed (the trainer's
    setup: the draws inside ``philox_from``): two replays of the same batch drop different
    entries, because the device Philox state advances inside the graph; reseeding the state
    from the host repeats the first replay's masks."""
    from bert.train.cuda_graphs import EncoderGraphs
    from kernels.runtime import philox_from, philox_state, seed_philox_

    model = _tiny("triton", dropout=0.1, fused_ops=True).train()
    shapes = StaticShapes(token_bucket=128, masked_bucket=16, max_seqlen=128)
    model.encoder_graphs = EncoderGraphs(model.layers, shapes.max_seqlen)
    block = random_block(6, seed=0, max_seq_length=96, max_predictions=10, vocab_size=64)
    batch = shapes.pad(collate_unpadded(block)).to("cuda")
    state = philox_state("cuda")
    with philox_from(state):
        seed_philox_(state, 1234)
        model(batch)  # captures the shape's graphs
        seed_philox_(state, 1234)
        first, second = (model(batch).mlm_logits.detach().clone() for _ in range(2))
        seed_philox_(state, 1234)
        again = model(batch).mlm_logits.detach().clone()
    assert len(model.encoder_graphs.shapes) == 1  # the later calls replayed the graph
    assert not torch.equal(first, second)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
