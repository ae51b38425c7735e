"""Static shapes (data.static_shapes): the padding sequence changes no loss, gradient or count;
distinct shapes and padding at the documented bucket."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bert.config import OptimSection
from bert.model.config import BertConfig
from bert.model.pretraining import BertForPreTraining
from bert.optim.optimizers import build_optimizer
from bert.train.losses import pretraining_loss, simreg_loss
from data.collate import collate_unpadded
from data.static_shapes import IGNORE, StaticShapes, auto_token_bucket, real_part
from data.synthetic import random_block


def test_padding_is_one_extra_sequence_nothing_reads():
    block = random_block(5, seed=0, max_seq_length=64, max_predictions=8, vocab_size=50)
    batch = collate_unpadded(block)
    shapes = StaticShapes(token_bucket=64, masked_bucket=16, max_seqlen=64)
    padded = shapes.pad(batch)
    t, m, b = batch.num_tokens, batch.mlm_positions.numel(), batch.num_sequences
    assert padded.num_tokens % 64 == 0 and padded.num_tokens > t
    assert padded.mlm_positions.numel() % 16 == 0 and padded.mlm_positions.numel() >= max(m, 0.15 * padded.num_tokens)
    assert padded.num_sequences == b + 1 and padded.max_seqlen == 64
    assert torch.equal(padded.cu_seqlens[: b + 1], batch.cu_seqlens) and int(padded.cu_seqlens[-1]) == padded.num_tokens
    assert (padded.mlm_labels[m:] == IGNORE).all() and int(padded.nsp_labels[-1]) == IGNORE
    assert (padded.mlm_positions[m:] == t).all()  # the padding sequence's first token
    real = real_part(padded, t, b, m)
    for name in ("input_ids", "segment_ids", "position_ids", "cu_seqlens", "mlm_positions", "mlm_labels", "nsp_labels"):
        assert torch.equal(getattr(real, name), getattr(batch, name)), name
    assert padded.mlm_positions.numel() == shapes.padded_sizes(t, m)[1]
    with pytest.raises(ValueError, match="max_seqlen"):
        StaticShapes(token_bucket=128, masked_bucket=16, max_seqlen=64).pad(collate_unpadded(random_block(9, seed=1)))


def _model(seed):
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForPreTraining(cfg, attention="reference")


@pytest.mark.slow  # 2 x 100 steps
def test_static_shapes_losses_equal_dynamic_over_100_steps():
    """fp32, dropout off: per-step losses of the padded path within 1e-6 of the unpadded one,
    LAMB updating both models (so the padding would show in later steps' weights too)."""
    dynamic, static = _model(0), _model(0)
    opt_d = build_optimizer(OptimSection(lr=2e-3), dynamic)
    opt_s = build_optimizer(OptimSection(lr=2e-3), static)
    shapes = StaticShapes(token_bucket=64, masked_bucket=16, max_seqlen=64)
    seen = set()
    worst = 0.0
    for step in range(100):
        block = random_block(4, seed=step, max_seq_length=48, max_predictions=7, vocab_size=64)
        batch = collate_unpadded(block)
        m, b = int(block.masked_counts.sum()), len(block)
        losses = []
        for model, opt, x in ((dynamic, opt_d, batch), (static, opt_s, shapes.pad(batch))):
            seen.add((x.num_tokens, x.mlm_positions.numel()))
            out = model(x)
            loss, _ = pretraining_loss(out.mlm_logits, x.mlm_labels, out.nsp_logits, x.nsp_labels, m, b)
            real = real_part(x, batch.num_tokens, b, m)
            reg, anchors = simreg_loss(out.hidden_states[: batch.num_tokens], real)
            loss = loss + 0.1 * reg / anchors.clamp(min=1)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
        assert abs(losses[0] - losses[1]) <= 1e-6 * max(1.0, abs(losses[0])), (step, losses)
    assert worst > 0 or len(seen) > 2  # the test compared different computations


def test_bucket_choice_at_the_mlperf_length_distribution():
    """The documented choice: at most 16 shapes and at most 3% token padding over MLPerf's
    8-GPU H100 recipe (96 samples per GPU, 3,680 steps; bench.lengths' distribution)."""
    from bench.lengths import MAX_LEN, builtin_lengths

    rng = np.random.default_rng(0)
    steps, ranks, b = 3680, 8, 96
    lens = builtin_lengths(rng, steps * ranks * b).reshape(-1, b)
    masked = np.minimum(76, np.maximum(1, np.rint(lens * 0.15))).astype(np.int64)
    bucket = auto_token_bucket(b, MAX_LEN)
    shapes = StaticShapes(token_bucket=bucket, masked_bucket=64, max_seqlen=max(MAX_LEN, bucket))
    tokens, counts = lens.sum(1), masked.sum(1)
    padded = [shapes.padded_sizes(int(t), int(m)) for t, m in zip(tokens, counts)]
    distinct = len(set(padded))
    padding = sum(p for p, _ in padded) / tokens.sum() - 1
    assert distinct <= 16 and padding <= 0.03, (bucket, distinct, padding)
