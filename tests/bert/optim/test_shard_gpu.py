"""Sharded LAMB on a CUDA GPU (one process, NCCL, group size 1): bf16 compute weights and fp16's
sharded scaler. Skipped without a GPU; bench/gpu_check.sh runs them (pytest -m gpu)."""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl_group():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if dist.is_initialized():
        pytest.skip("a process group exists already")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model():
    from bert.model.config import BertConfig
    from bert.model.pretraining import BertForPreTraining

    torch.manual_seed(0)
    config = BertConfig.preset("tiny", vocab_size=96, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForPreTraining(config, attention="padded").cuda()


def _batch(step: int):
    from data.loader import make_collator
    from data.synthetic import random_block

    block = random_block(8, seed=step, max_seq_length=64, max_predictions=8, vocab_size=96)
    return make_collator("torch", "unpadded", 64)(block).to("cuda"), int(block.masked_counts.sum()), len(block)


def _train(model, optimizer, forward, steps: int, dtype, scaler=None, local=None, norms=None) -> list[float]:
    from bert.optim.clipping import clip_global_
    from bert.train.losses import pretraining_loss

    view = {"local": local, "norms": norms} if local else {}
    losses = []
    for step in range(steps):
        batch, masked, seqs = _batch(step)
        with torch.autocast("cuda", dtype=dtype):
            out = forward(batch)
            loss, _ = pretraining_loss(out.mlm_logits, batch.mlm_labels, out.nsp_logits, batch.nsp_labels, masked, seqs)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        clip_global_([p for p in model.parameters() if p.grad is not None], 1.0, **view)
        scaler.step(optimizer) if scaler else optimizer.step()
        if scaler:
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def test_group_of_one_bf16_matches_unsharded(nccl_group):
    """optim.shard=1 on one GPU with bf16 compute: FSDP2 casts the weights to bf16 itself, the
    unsharded run autocasts; the losses agree to bf16's rounding and both decrease."""
    from bert.config import OptimSection
    from bert.optim.optimizers import build_optimizer
    from bert.optim.shard import apply_sharding, build_sharded_lamb

    ref_model = _model()
    model = copy.deepcopy(ref_model)
    ref_opt = build_optimizer(OptimSection(lr=1e-3), ref_model, impl="torch")
    ref = _train(ref_model, ref_opt, ref_model, 6, torch.bfloat16)
    optim = OptimSection(lr=1e-3, shard=1)
    sharding = apply_sharding(model, optim, "bf16", 1, "cuda")
    opt = build_sharded_lamb(optim, model, sharding)
    got = _train(model, opt, model, 6, torch.bfloat16, None, sharding.local, sharding.norms)
    assert got == pytest.approx(ref, rel=2e-2)
    assert got[-1] < got[0]


def test_fp16_sharded_scaler_steps_and_skips(nccl_group):
    """fp16 with FSDP2 and ShardedGradScaler (bert.train.build.build_grad_scaler): the scaler
    unscales DTensor gradients, and an overflow lowers the scale and skips the update."""
    from bert.config import OptimSection, TrainSection
    from bert.optim.shard import apply_sharding, build_sharded_lamb
    from bert.train.build import build_grad_scaler

    model = _model()
    optim = OptimSection(lr=1e-3, shard=1)
    sharding = apply_sharding(model, optim, "fp16", 1, "cuda")
    optimizer = build_sharded_lamb(optim, model, sharding)
    scaler = build_grad_scaler(TrainSection(precision="fp16", device="cuda"), sharding)
    losses = _train(model, optimizer, model, 4, torch.float16, scaler, sharding.local, sharding.norms)
    assert all(torch.isfinite(torch.tensor(losses)))
    from bert.optim.shard import local_shard

    before = [local_shard(p).detach().clone() for p in model.parameters()]
    scale = scaler.get_scale()
    batch, masked, seqs = _batch(99)
    from bert.train.losses import pretraining_loss

    with torch.autocast("cuda", dtype=torch.float16):
        out = model(batch)
        loss, _ = pretraining_loss(out.mlm_logits, batch.mlm_labels, out.nsp_logits, batch.nsp_labels, masked, seqs)
    scaler.scale(loss * float("inf")).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() < scale
    assert all(torch.equal(a, local_shard(b)) for a, b in zip(before, model.parameters()))
