"""One rank of the context-parallel attention tests (tests/kernels/test_context_parallel.py).

Every rank builds the same seeded batch of whole documents and runs each case twice: on one
rank (the backend on the whole documents, in this process) and under context parallelism (its
shard: a few whole sequences of its own plus its piece of every split document), then compares
its rows of the output and of dq, dk, dv with the one-rank ones. Rank 0 writes the largest
relative differences per case as JSON.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from kernels.context_parallel import ContextLayout, ContextShard, context_parallel_backend
from kernels.interface import VarlenLayout

H, D = 2, 32


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b| (0 for empty tensors)."""
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_case(
    backend: str, window: int | None, doc_lens: list[int], whole: list[list[int]], rank: int, size: int, owner: int
):
    g = torch.Generator().manual_seed(1000 + sum(doc_lens) + (window or 0))
    # The one-rank batch: every rank's whole sequences, then the documents, in one flat batch.
    all_lens = [n for lens in whole for n in lens] + doc_lens
    t = sum(all_lens)
    q, k, v, w = (torch.randn(t, H, D, generator=g) for _ in range(4))
    cu = torch.tensor([0, *torch.tensor(all_lens).cumsum(0).tolist()], dtype=torch.int32)
    fn = context_parallel_backend(backend)

    def grads(q, k, v, layout):
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        out = fn(q, k, v, layout, 0.0, True)
        (out * w_rows).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    # One rank, run by one process of the group (a different one per case) and broadcast: the
    # rows of each rank's tokens, in its local order, are compared below.
    w_rows = w
    if rank == owner:
        one = grads(q, k, v, VarlenLayout(cu, max(all_lens), window, host_seqlens=tuple(all_lens)))
    else:
        one = tuple(torch.empty(t, H, D) for _ in range(4))
    for x in one:
        dist.broadcast(x, owner)

    shard = ContextShard(rank, size, tuple(whole[rank]), tuple(doc_lens))
    starts = torch.tensor([0, *torch.tensor(all_lens).cumsum(0).tolist()])
    rows = []
    for i, n in enumerate(whole[rank]):
        b = sum(len(x) for x in whole[:rank]) + i
        rows.append(torch.arange(starts[b], starts[b] + n))
    for d, a, e in shard.pieces():
        b = sum(len(x) for x in whole) + d
        rows.append(torch.arange(starts[b] + a, starts[b] + e))
    rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    local = shard.seqlens
    cu_local = torch.tensor([0, *torch.tensor(local, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
    layout = ContextLayout(cu_local, max(local, default=0), shard, None, window)
    w_rows = w[rows]
    cp = grads(q[rows], k[rows], v[rows], layout)
    return max(rel(a, b[rows]) for a, b in zip(cp, one))


def main(rank: int, size: int, store: str, out: str, cases: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    results = {}
    for i, (backend, window, doc_lens, whole) in enumerate(cases):
        whole = [whole[r % len(whole)] for r in range(size)]
        name = f"{backend}-w{window}-docs{doc_lens}"
        results[name] = run_case(backend, window, doc_lens, whole, rank, size, i % size)
    gathered = [None] * size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        worst = {name: max(r[name] for r in gathered) for name in results}
        with open(out, "w") as f:
            json.dump(worst, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit("run by tests/kernels/test_context_parallel.py")
