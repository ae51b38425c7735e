"""Pure tests of data.rebalance's exchange format: packing samples into int32 words and the
per-rank input checks carried in the header. Seeds are fixed in each test.
"""

import numpy as np
import pytest

from data.rebalance.exchange import check_block, pack_samples, unpack_samples
from data.samples import SampleBlock
from tests.data.rebalance.rebalance_worker import random_block


def test_pack_unpack_round_trip():
    block = random_block(0, 0, batch=30)
    assert (block.masked_counts[block.seq_lens == 1] == 0).all()
    for idx in (np.array([3, 0, 29, 7]), np.arange(30), np.zeros(0, np.int64)):
        sel = block.select(idx)
        words = pack_samples(block, idx)
        assert words.dtype == np.int32 and len(words) == int((1 + sel.seq_lens + 2 * sel.masked_counts).sum())
        assert unpack_samples(words, sel.seq_lens, sel.masked_counts, block).equals(sel)


def _broken(field, fn):
    block = random_block(1, 0, batch=6)
    setattr(block, field, fn(getattr(block, field).copy()))
    return block


def _set(i, v):
    def f(a):
        a[i] = v
        return a

    return f


@pytest.mark.parametrize(
    "block, code, index",
    [
        (SampleBlock.empty(), 1, 0),
        (random_block(1, 0, batch=5), 2, 0),
        (_broken("seq_lens", _set(2, 0)), 3, 2),
        (_broken("seq_lens", _set(4, 513)), 3, 4),
        (_broken("input_ids", lambda a: a[:-1]), 4, 0),
        (_broken("masked_counts", lambda a: a * 0 + 600), 5, 0),
        (_broken("masked_ids", lambda a: a[:-1]), 6, 0),
        (_broken("masked_positions", lambda a: a + 600), 7, 0),
        (_broken("input_ids", _set(-1, -5)), 8, 5),
        (_broken("segment_ids", _set(0, 2)), 9, 0),
        (_broken("nsp_labels", _set(3, 7)), 10, 3),
        (_broken("nsp_labels", lambda a: a[:-1]), 11, 0),
    ],
)
def test_check_block_names_the_problem(block, code, index):
    assert check_block(random_block(1, 0, batch=6), 6, 512) == (0, 0, 0)
    got = check_block(block, 6, 512)
    assert got[:2] == (code, index)
