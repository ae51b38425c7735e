"""The model under context parallelism equals one rank: BERT (global layers, NSP, absolute
positions) and ModernBERT (global and window layers, RoPE), reference and triton (interpreter)
backends, CP = 2 and 4 as gloo processes. The group's summed loss and every parameter's summed
gradient match one rank's within 1e-5 relative in fp32; split documents include one shorter
than 4 tokens and lengths that 2 and 4 do and do not divide. ``split_batch`` itself is
checked without processes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from bert.distributed.context_parallel import NO_NSP, split_batch
from tests.batches import random_batch
from tests.bert.distributed.context_parallel_worker import LENGTHS, VOCAB, main

CASES = {  # the interpreter is slow: triton's BERT at CP = 2 (the kernels' own test has CP = 4 for both)
    2: [("bert", "reference"), ("modernbert", "reference"), ("bert", "triton"), ("modernbert", "triton")],
    4: [("bert", "reference"), ("modernbert", "reference"), ("modernbert", "triton")],
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("size", [2, 4])
def test_model_under_context_parallelism_equals_one_rank(size, tmp_path):
    out = tmp_path / "results.json"
    mp.spawn(main, args=(size, str(tmp_path / "store"), str(out), CASES[size]), nprocs=size, join=True)
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(f"{c}-{b}" for c, b in CASES[size])
    bad = {case: r for case, r in results.items() if not (r["loss"] <= 1e-5 and r["grad"] <= 1e-5)}
    assert not bad, bad


def test_split_batch_keeps_every_token_once_at_its_document_position():
    batch = random_batch(LENGTHS, VOCAB, seed=3)
    seq_of = torch.repeat_interleave(torch.arange(len(LENGTHS)), batch.seqlens.long())

    def masked(b, docs):  # (document, position, token, label) of each masked token
        return sorted(zip(docs[b.mlm_positions].tolist(), b.position_ids[b.mlm_positions].tolist(),
                          b.input_ids[b.mlm_positions].tolist(), b.mlm_labels.tolist()))  # fmt: skip

    size, tokens, got = 4, [], []
    for rank in range(size):
        part = split_batch(batch, rank, size, threshold=2)
        b, shard = part.batch, part.shard
        long = [i for i, n in enumerate(LENGTHS) if n > 2]
        whole = [i for i, n in enumerate(LENGTHS) if n <= 2 and i % size == rank]
        docs = torch.tensor([d for d, n in zip(whole + [long[d] for d, _, _ in shard.pieces()], shard.seqlens)
                             for _ in range(n)], dtype=torch.long)  # fmt: skip
        for i, (s, n) in enumerate(zip(shard.starts, shard.seqlens)):
            lo = int(b.cu_seqlens[i])
            assert b.position_ids[lo : lo + n].tolist() == list(range(s, s + n))
            assert (int(b.nsp_labels[i]) == NO_NSP) == (s > 0)
        tokens += zip(docs.tolist(), b.position_ids.tolist(), b.input_ids.tolist())
        got += masked(b, docs)
    assert sorted(tokens) == sorted(zip(seq_of.tolist(), batch.position_ids.tolist(), batch.input_ids.tolist()))
    assert sorted(got) == masked(batch, seq_of)
