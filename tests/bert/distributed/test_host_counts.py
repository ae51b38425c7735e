"""bert.distributed.host_counts: a step's counts from the data are sums over samples, so the ranks' shares
add up to the global batch's however samples are spread (the rebalancer moves them)."""

from __future__ import annotations

import numpy as np
import pytest

from bert.distributed.host_counts import CountAgreement, StepCounts, local_counts, simreg_anchor_count
from data.synthetic import random_block


@pytest.mark.parametrize("scope", [None, "masked", "all"])
def test_shares_add_up_to_the_whole_batch_in_any_split(scope):
    block = random_block(12, seed=3, max_seq_length=40, max_predictions=6, vocab_size=12)
    whole = local_counts(block, False, 2, scope)
    rng = np.random.default_rng(0)
    for _ in range(3):
        order = rng.permutation(len(block))
        parts = [block.select(order[:5]), block.select(order[5:])]
        summed = local_counts(parts[0], True, 2, scope) + local_counts(parts[1], False, 0, scope)
        assert summed.tolist()[:3] == whole.tolist()[:3] and summed[3] == 1 and summed[5] == 2
        assert summed[4] == whole[4]
    assert whole.tolist()[:3] == [int(block.masked_counts.sum()), 12, block.num_tokens]
    if scope is not None:
        expected = simreg_anchor_count(
            block.seq_lens, block.input_ids, block.masked_positions, block.masked_ids, block.masked_counts, scope
        )
        assert whole[4] == expected > 0


def test_one_rank_agrees_with_itself():
    counts = CountAgreement(1, timeout_s=5).agree(np.array([5, 2, 30, 1, 4, 3]))
    assert counts == StepCounts(masked=5, sequences=2, tokens=30, stop=True, anchors=4, corrupt=3)
