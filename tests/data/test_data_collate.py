"""Collation into UnpaddedBatch / PaddedBatch agrees with data.batch.unpad / pad on the same
samples, and the DALI backend (CPU pipeline) gives identical batches to the PyTorch one."""

from __future__ import annotations

import itertools
from dataclasses import fields

import pytest
import torch

from common.errors import DataError
from data.batch import pad, unpad
from data.collate import collate_padded, collate_unpadded
from data.hdf5io import to_fixed_arrays
from data.loader import EvalLoader, PretrainingLoader, make_collator
from data.samples import SampleBlock
from data.synthetic import random_block, write_shards

S, P, V = 97, 15, 700  # an awkward row length


def assert_same_batch(a, b):
    assert type(a) is type(b)
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("n,seed", [(1, 0), (7, 1), (56, 2)])
def test_unpadded_matches_unpad_of_the_fixed_layout(n, seed):
    block = random_block(n, seed, S, P, V, min_len=5)
    batch = collate_unpadded(block)
    assert_same_batch(batch, unpad(**to_fixed_arrays(block, S, P)))
    batch.check_values(vocab_size=V)
    assert batch.num_tokens == block.num_tokens and batch.max_seqlen == int(block.seq_lens.max())


@pytest.mark.parametrize("seq_len", [S, 128])
def test_padded_matches_pad(seq_len):
    block = random_block(23, 4, S, P, V)
    assert_same_batch(collate_padded(block, seq_len), pad(collate_unpadded(block), seq_len))


def test_masked_positions_point_at_the_masked_tokens():
    block = random_block(30, 5, S, P, V)
    u = collate_unpadded(block)
    p = collate_padded(block, S)
    assert torch.equal(u.input_ids[u.mlm_positions], p.input_ids.reshape(-1)[p.mlm_positions])
    starts = u.cu_seqlens[:-1].long()
    owner = torch.repeat_interleave(torch.arange(len(block)), torch.from_numpy(block.masked_counts).long())
    assert torch.equal(u.mlm_positions - starts[owner], torch.from_numpy(block.masked_positions).long())


def test_collate_rejects_what_does_not_fit():
    block = random_block(3, 6, S, P, V)
    with pytest.raises(DataError, match="more than seq_len 10"):
        collate_padded(block, 10)
    with pytest.raises(DataError, match="empty SampleBlock"):
        collate_unpadded(SampleBlock.empty())
    with pytest.raises(ValueError, match="backend 'tensorflow'"):
        make_collator("tensorflow")
    with pytest.raises(ValueError, match="needs seq_len"):
        make_collator("torch", "padded")


def _has_dali() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


# nvidia-dali-cuda120 is in requirements.txt; it has wheels for x86-64 and aarch64 Linux only.
needs_dali = pytest.mark.skipif(not _has_dali(), reason="nvidia-dali-cuda120 is not installed on this platform")


@needs_dali
@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", ["unpadded", "padded"])
def test_dali_batches_equal_torch_batches(layout):
    seq_len = S if layout == "padded" else None
    d = make_collator("dali", layout, seq_len, max_batch_size=64)
    t = make_collator("torch", layout, seq_len)
    for n, seed in ((64, 0), (1, 1), (17, 2), (64, 3)):  # batch sizes vary, as after rebalancing
        block = random_block(n, seed, S, P, V)
        assert_same_batch(d(block), t(block))
    with pytest.raises(ValueError, match="exceeds the DALI pipeline's max_batch_size 64"):
        d(random_block(65, 0, S, P, V))


@needs_dali
@pytest.mark.timeout(60)
def test_loader_backends_give_identical_batches(tmp_path):
    write_shards(tmp_path / "train", [40, 33, 51], seed=2, max_seq_length=S, max_predictions=P, vocab_size=V)
    runs = {}
    for backend in ("torch", "dali"):
        with PretrainingLoader(tmp_path / "train", 12, 1, 3, seed=5, backend=backend) as loader:
            runs[backend] = list(itertools.islice(loader.batches(), 12))
    for a, b in zip(runs["torch"], runs["dali"]):
        assert_same_batch(a, b)
    write_shards(tmp_path / "eval", [29], seed=3, max_seq_length=S, max_predictions=P, vocab_size=V)
    ev = {
        b: list(EvalLoader(next((tmp_path / "eval").iterdir()), 8, 0, 2, backend=b).batches("padded", S))
        for b in ("torch", "dali")
    }
    assert len(ev["torch"]) == 2
    for a, b in zip(ev["torch"], ev["dali"]):
        assert_same_batch(a, b)
