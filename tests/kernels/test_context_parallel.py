"""Context-parallel attention (kernels/context_parallel.py) equals one rank.

The ranks are gloo processes (torch.multiprocessing); one launch per group size runs every
case. Each case: documents split over the group (lengths below the group size, lengths it does
and does not divide), whole sequences of each rank's own, a global layer or a window (one that
stays inside a neighbour's piece and one that reaches across several pieces), on the
``reference``, ``sdpa`` and ``triton`` (interpreter) backends. The out, dq, dk and dv rows of
every rank match the one-rank run within 1e-5 relative in fp32. The pure parts (the pieces, the
halo transfers) are checked without processes.
"""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from kernels.context_parallel import ContextShard, halo_plan, halo_transfers
from tests.kernels.context_parallel_worker import main

DOCS = [1, 3, 21, 16, 10]  # 1 and 3 shorter than 4 ranks; 16 divisible by 2 and 4, 21 by neither, 10 by 2 only
WHOLE = [[5, 9], [], [7]]  # whole sequences of rank r: WHOLE[r % 3] (rank 1 has none)
CASES = [
    (backend, window, DOCS, WHOLE)
    for backend in ("reference", "sdpa", "triton")
    for window in (None, 4, 14)  # reach 2 (a neighbour's piece), 7 (across pieces of 3 to 6 tokens)
]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("size", [2, 4])
def test_context_parallel_attention_equals_one_rank(size, tmp_path):
    out = tmp_path / "worst.json"
    mp.spawn(main, args=(size, str(tmp_path / "store"), str(out), CASES), nprocs=size, join=True)
    worst = json.loads(out.read_text())
    assert len(worst) == len(CASES)
    bad = {name: err for name, err in worst.items() if not err <= 1e-5}
    assert not bad, bad


def test_pieces_cover_each_document_in_order():
    for size in (1, 2, 3, 4):
        for length in (1, 2, 3, 4, 5, 37, 64):
            spans = [ContextShard(r, size, (), (length,)).piece(0) for r in range(size)]
            assert spans[0][0] == 0 and spans[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert max(e - s for s, e in spans) == -(-length // size)


def test_halo_is_what_a_window_reaches_and_no_more():
    shard = ContextShard(1, 4, (), (37,))  # pieces [0,10) [10,20) [20,30) [30,37)
    assert halo_transfers(shard, 4) == [
        (0, 1, 0, 6, 10), (1, 0, 0, 10, 14), (1, 2, 0, 16, 20), (2, 1, 0, 20, 24),
        (2, 3, 0, 26, 30), (3, 2, 0, 30, 34),
    ]  # fmt: skip
    plan = halo_plan(shard, 4)
    assert plan.recv_splits == [4, 0, 4, 0] and plan.send_splits == [4, 0, 4, 0]
    assert plan.ext_seqlens == [18] and plan.out_index == list(range(4, 14))
    far = halo_plan(ContextShard(3, 4, (), (37,)), 20)  # reach 20: from ranks 1 and 2
    assert far.recv_splits == [0, 10, 10, 0] and far.ext_seqlens == [27]  # [10, 30) + its 7


def test_a_backend_without_keys_of_their_own_is_refused_in_one_line():
    from kernels.context_parallel import context_parallel_backend
    from kernels.interface import BackendUnavailable

    with pytest.raises(BackendUnavailable, match=r"^dist.context_parallel: model.attention=padded: .*'cu_seqlens_k'"):
        context_parallel_backend("padded")
