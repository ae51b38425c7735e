"""One rank of the sharded-LAMB engine tests (tests/bert/optim/test_shard.py), run by torchrun.

For each case of ``--cases`` (``SHARD:CLIP:GRAD_ACCUM``, comma-separated) trains a tiny BERT
(dropout off, fp32) for a few steps on seeded synthetic batches, either unsharded (SHARD
``none``: DDP + ``bert.optim.Lamb``, the reference) or sharded (``dp`` or a group size: FSDP2 +
``ShardedLamb``); rank 0 writes, per case, the per-step losses, the gradient norms and the
optimizer-state bytes of every rank as JSON to ``--out``. One launch runs every case: starting
ranks costs more than training them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from bert.config import AdaGCSection, OptimSection  # noqa: E402
from bert.model.config import BertConfig  # noqa: E402
from bert.model.pretraining import BertForPreTraining  # noqa: E402
from bert.optim.clipping import AdaGC, clip_global_  # noqa: E402
from bert.optim.optimizers import build_optimizer  # noqa: E402
from bert.optim.shard import WholeNorms, apply_sharding, build_sharded_lamb, local_shard, optimizer_state_bytes
from bert.train.losses import pretraining_loss  # noqa: E402
from data.loader import make_collator  # noqa: E402
from data.synthetic import random_block  # noqa: E402

VOCAB, SEQ, PER_RANK = 96, 32, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for case in args.cases.split(","):
        shard, clip, grad_accum = case.split(":")
        results[case] = run(shard, clip, int(grad_accum), args.steps, args.preset)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()  # every rank is done with its peers
    # No teardown (process group, interpreter), as run_pretraining.py skips the interpreter's:
    # gloo sometimes aborts in it ("terminate called without an active exception") after
    # everything is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(shard: str, clip: str, grad_accum: int, steps: int, preset: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    optim = OptimSection(lr=2e-2, weight_decay=0.01, shard=shard if shard in ("none", "dp") else int(shard))

    torch.manual_seed(0)
    config = BertConfig.preset(preset, vocab_size=VOCAB, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForPreTraining(config, attention="padded")
    sharding = apply_sharding(model, optim, "fp32", world, "cpu")
    if sharding is None:
        forward = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = build_optimizer(optim, model, impl="torch")
        local, norms = local_shard, WholeNorms(None)
    else:
        forward = model
        optimizer = build_sharded_lamb(optim, model, sharding)
        local, norms = sharding.local, sharding.norms
    group = sharding.group_size if sharding else None
    adagc = None
    if clip == "adagc":
        adagc = AdaGC(model.named_parameters(), AdaGCSection(warmup_steps=2, lambda_rel=1.0), local=local, norms=norms)
    collate = make_collator("torch", "unpadded", SEQ)
    params = [p for p in model.parameters()]
    losses, grad_norms = [], []
    for step in range(steps):
        block = random_block(PER_RANK * world, seed=step, max_seq_length=SEQ, max_predictions=6, vocab_size=VOCAB)
        mine = block.select(np.arange(rank * PER_RANK, (rank + 1) * PER_RANK))
        num_masked, num_seqs = int(block.masked_counts.sum()), len(block)
        micro = PER_RANK // grad_accum
        total = torch.zeros(())
        for i in range(grad_accum):
            last = i == grad_accum - 1
            batch = collate(mine.select(np.arange(i * micro, (i + 1) * micro)))
            if group is None:
                ctx = forward.no_sync() if not last else _null()
            else:
                model.set_requires_gradient_sync(last)
                ctx = _null()
            with ctx:
                out = forward(batch)
                loss, _ = pretraining_loss(
                    out.mlm_logits, batch.mlm_labels, out.nsp_logits, batch.nsp_labels, num_masked, num_seqs
                )
                (loss * world).backward()  # both engines average gradients over ranks
            total += loss.detach()
        if adagc is not None:
            norm = adagc.clip_(compute_global_norm=True).global_norm
        elif clip == "global":
            norm = clip_global_(params, 1.0, local=local, norms=norms)
        else:
            norm = torch.linalg.vector_norm(norms([local(p.grad) for p in params]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(float(total))
        grad_norms.append(float(norm))
    state_bytes = [None] * world
    dist.all_gather_object(state_bytes, optimizer_state_bytes(optimizer))
    return {"losses": losses, "grad_norms": grad_norms, "state_bytes": state_bytes}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
