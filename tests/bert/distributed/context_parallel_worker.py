"""One rank of the model-level context-parallel tests (test_context_parallel_model.py).

Every rank builds the same seeded model and the same group batch. Per case it runs the batch
on one rank (this process, the whole batch) and under context parallelism (its
``split_batch`` share), sums the CP losses and gradients over the group, and compares them
with the one-rank loss and every parameter's gradient. Rank 0 writes, per case, the loss's
relative difference and the largest gradient one (max |a - b| / max |b| of a tensor).
"""

from __future__ import annotations

import dataclasses
import json

import torch
import torch.distributed as dist

from bert.distributed.context_parallel import NO_NSP, context_groups, split_batch
from bert.model.config import PRESETS
from bert.model.pretraining import BertForPreTraining
from bert.train.losses import pretraining_loss
from tests.batches import random_batch

VOCAB = 100
CONFIGS = {
    # BERT's block: post-norm, absolute positions, NSP, every layer global.
    "bert": dataclasses.replace(
        PRESETS["tiny"], hidden_size=64, num_attention_heads=2, intermediate_size=96, vocab_size=VOCAB,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ),
    # ModernBERT's: pre-norm, RoPE with a theta per layer type, GeGLU, global + window layers.
    "modernbert": dataclasses.replace(
        PRESETS["modernbert_tiny"], hidden_size=64, num_attention_heads=2, intermediate_size=96, vocab_size=VOCAB,
        num_hidden_layers=3, layer_types=("global", "local", "local"), local_window=8, max_position_embeddings=64,
    ),
}  # fmt: skip
LENGTHS = [3, 24, 11, 2, 1, 18, 6]  # threshold 2: 3 is split over 4 ranks too; 2 and 1 stay whole
THRESHOLD = 2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def loss_and_grads(model, batch, n_masked, n_seqs, group=None):
    model.zero_grad(set_to_none=True)
    out = model(batch)
    labels = batch.batch if hasattr(batch, "shard") else batch
    loss, _ = pretraining_loss(out.mlm_logits, labels.mlm_labels, out.nsp_logits, labels.nsp_labels, n_masked, n_seqs)
    loss.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    loss = loss.detach().clone()
    if group is not False:  # the group's sum: what DDP's all-reduce adds to the other ranks' gradients
        for g in [loss, *grads]:
            dist.all_reduce(g)
    return loss, grads


def run_case(config_name: str, backend: str, groups, owner: int) -> dict:
    torch.manual_seed(0)
    model = BertForPreTraining(CONFIGS[config_name], backend, context_parallel=True, context_group=groups.group)
    batch = random_batch(LENGTHS, VOCAB, seed=3)
    n_masked, n_seqs = batch.mlm_labels.numel(), batch.num_sequences
    # One rank, run by one process (a different one per case) and broadcast.
    if groups.rank == owner:
        loss_one, grads_one = loss_and_grads(model, batch, n_masked, n_seqs, group=False)
    else:
        loss_one, grads_one = torch.zeros(()), [torch.zeros_like(p) for p in model.parameters()]
    for x in (loss_one, *grads_one):
        dist.broadcast(x, owner)
    shard = split_batch(batch, groups.rank, groups.size, THRESHOLD)
    loss_cp, grads_cp = loss_and_grads(model, shard, n_masked, n_seqs)
    counted = (shard.nsp_labels != NO_NSP).sum()  # the sequences whose NSP label counts: not a piece without [CLS]
    dist.all_reduce(counted)
    assert int(counted) == n_seqs, (int(counted), n_seqs)
    return {"loss": rel(loss_cp, loss_one), "grad": max(rel(a, b) for a, b in zip(grads_cp, grads_one))}


def main(rank: int, size: int, store: str, out: str, cases: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    groups = context_groups(size)
    results = {f"{c}-{b}": run_case(c, b, groups, i % size) for i, (c, b) in enumerate(cases)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
