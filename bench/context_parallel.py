"""Context parallelism on the CPU: peak memory per rank against one rank holding the document.

A tiny-width ModernBERT (a global layer every third, the others local; RoPE; GeGLU) takes one forward and
backward on one document of ``--tokens`` tokens (random ids, 30% masked), first on one rank,
then split across ``--ranks`` gloo ranks (``dist.context_parallel``'s path: ``split_batch``
and ``kernels.context_parallel``), each run in fresh processes. Memory is each process's peak
resident set during the step minus its resident set just before it (the model and the batch
are built, the libraries loaded), from ``getrusage``'s ``ru_maxrss``. Printed side by side:
the peak per rank, its ratio to the one-rank peak (goal at most 0.35 at 4 ranks), the step's
time, and the attention's bytes per layer as the plan moves them against an all-gather of K/V.

    python -m bench.context_parallel [--tokens 65536] [--ranks 4] [--hidden 64] [--heads 4]
        [--layers 6] [--window 128] [--attention sdpa] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bert.distributed.context_parallel import split_batch
from bert.model.config import PRESETS
from bert.model.pretraining import BertForPreTraining
from bert.train.losses import pretraining_loss
from data.batch import UnpaddedBatch
from kernels.context_parallel import ContextShard, halo_plan


def model_config(args):
    from dataclasses import replace

    types = tuple("global" if i % 3 == 0 else "local" for i in range(args.layers))
    return replace(
        PRESETS["modernbert_tiny"],
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        intermediate_size=args.hidden * 3 // 2,
        num_hidden_layers=args.layers,
        layer_types=types,
        local_window=args.window,
        vocab_size=args.vocab,
        max_position_embeddings=args.tokens,
    )


def document(tokens: int, vocab: int, seed: int = 0) -> UnpaddedBatch:
    """One document of ``tokens`` random ids, 30% of its positions (never the first) masked."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (tokens,), generator=g)
    masked = torch.randperm(tokens - 1, generator=g)[: int(0.3 * tokens)].sort().values + 1
    return UnpaddedBatch(
        input_ids=ids,
        segment_ids=torch.zeros(tokens, dtype=torch.long),
        position_ids=torch.arange(tokens),
        cu_seqlens=torch.tensor([0, tokens], dtype=torch.int32),
        max_seqlen=tokens,
        mlm_positions=masked,
        mlm_labels=ids[masked],
        nsp_labels=torch.zeros(1, dtype=torch.long),
        host_seqlens=(tokens,),
    )


def rss_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rss_now_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def step(args, rank: int, size: int) -> dict:
    """One forward and backward of this rank's share (the whole document when size is 1)."""
    torch.manual_seed(0)
    cp = size > 1
    model = BertForPreTraining(model_config(args), args.attention, context_parallel=cp)
    # A warm-up step on a short document first: the libraries' one-time buffers (thread pools,
    # the kernels' first calls, gloo's pairs) are not the step's memory.
    small = document(4 * args.window, args.vocab, seed=1)
    warm = split_batch(small, rank, size, threshold=1) if cp else small
    out = model(warm)
    pretraining_loss(out.mlm_logits, warm.mlm_labels, out.nsp_logits, warm.nsp_labels, 1, 1)[0].backward()
    model.zero_grad(set_to_none=True)
    del out, warm, small
    batch = document(args.tokens, args.vocab)
    n_masked = batch.mlm_labels.numel()
    part = split_batch(batch, rank, size, threshold=1) if cp else batch
    del batch
    if cp:
        dist.barrier()
    before = rss_now_mib()
    t0 = time.perf_counter()
    out = model(part)
    loss, _ = pretraining_loss(out.mlm_logits, part.mlm_labels, out.nsp_logits, part.nsp_labels, n_masked, 1)
    loss.backward()
    seconds = time.perf_counter() - t0
    return {"rank": rank, "peak_mib": rss_peak_mib() - before, "seconds": seconds, "loss": float(loss)}


def worker(rank: int, size: int, store: str, out: str, args) -> None:
    torch.set_num_threads(1)
    if size > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    result = step(args, rank, size)
    results = [result]
    if size > 1:
        results = [None] * size
        dist.all_gather_object(results, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    if size > 1:
        dist.destroy_process_group()


def run(args, size: int) -> list[dict]:
    # glibc raises its mmap threshold after a large free, so later tensors land in the heap and
    # the peak resident set varies from run to run (1,961 and 2,310 MiB for the same one-rank
    # step); a fixed threshold puts every tensor over 64 KiB in its own mapping, returned on free.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 16))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(worker, args=(size, os.path.join(tmp, "store"), out, args), nprocs=size, join=True)
        with open(out) as f:
            return json.load(f)


def attention_bytes(args, size: int) -> dict:
    """Bytes one rank receives per layer and pass, from the plan, in fp32: a global layer's
    all-gather of K/V, a window layer's halo, and what an all-gather would be for it."""
    kv_row = 2 * args.hidden * 4  # K and V of one token, all heads
    c = -(-args.tokens // size)
    gather = (size - 1) * c * kv_row  # forward; the backward gathers again and reduce-scatters as much
    halos = [
        sum(halo_plan(ContextShard(r, size, (), (args.tokens,)), args.window // 2).recv_splits) for r in range(size)
    ]
    return {"global_all_gather": gather, "window_halo_max": max(halos) * kv_row, "window_as_all_gather": gather}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument(
        "--attention", default="sdpa", help="a backend that takes cu_seqlens_k (sdpa, reference, triton)"
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.ranks < 2:
        print("--tokens and --ranks: at least 2", file=sys.stderr)
        return 2
    one = run(args, 1)[0]
    many = run(args, args.ranks)
    worst = max(r["peak_mib"] for r in many)
    cfg = model_config(args)
    print(
        f"tiny-width ModernBERT: {cfg.num_hidden_layers} layers {cfg.layer_types}, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads, window {cfg.local_window}; one document of {args.tokens:,} tokens; "
        f"attention={args.attention}, fp32"
    )
    print(f"{'run':<16}{'peak MiB':>10}{'vs one rank':>13}{'step s':>9}{'loss':>10}")
    print(f"{'one rank':<16}{one['peak_mib']:>10.1f}{1.0:>13.3f}{one['seconds']:>9.1f}{one['loss']:>10.5f}")
    for r in many:
        name, share = f"CP rank {r['rank']}/{args.ranks}", r["peak_mib"] / one["peak_mib"]
        print(f"{name:<16}{r['peak_mib']:>10.1f}{share:>13.3f}{r['seconds']:>9.1f}{r['loss']:>10.5f}")
    ratio = worst / one["peak_mib"]
    total = sum(r["loss"] for r in many)
    print(f"largest CP rank / one rank: {ratio:.3f} (goal <= 0.35 at 4 ranks); loss summed over ranks {total:.5f}")
    b = attention_bytes(args, args.ranks)
    print(
        f"bytes received per rank per layer, forward: global all-gather {b['global_all_gather'] / 2**20:.2f} MiB; "
        f"window halo {b['window_halo_max'] / 2**10:.1f} KiB "
        f"({b['window_halo_max'] / b['window_as_all_gather']:.4f} of an all-gather)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"one": one, "cp": many, "ratio": ratio, "bytes": b, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
