"""MLM+NSP loss normalisation, and SimReg against a per-sequence loop reference written here."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bert.train.losses import pretraining_loss, simreg_loss
from data.batch import UnpaddedBatch


def make_batch(seqs, masked, vocab=6, seed=0):
    """seqs: token ids per sequence (lists); masked: per sequence, {position: original id}.

    The masked positions' input ids are replaced by a [MASK]-like id (vocab), so scope
    ``all`` must put the originals back to get the labels right.
    """
    ids, positions, labels, cu = [], [], [], [0]
    for s, m in zip(seqs, masked):
        base = cu[-1]
        ids += [vocab if i in m else t for i, t in enumerate(s)]
        for i, orig in m.items():
            positions.append(base + i)
            labels.append(orig)
        cu.append(base + len(s))
    lens = [len(s) for s in seqs]
    return UnpaddedBatch(
        input_ids=torch.tensor(ids),
        segment_ids=torch.zeros(len(ids), dtype=torch.long),
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(lens),
        mlm_positions=torch.tensor(positions, dtype=torch.long),
        mlm_labels=torch.tensor(labels, dtype=torch.long),
        nsp_labels=torch.zeros(len(seqs), dtype=torch.long),
    )


def reference_simreg(hidden, batch, temperature, scope):
    """The definition, sequence by sequence and anchor by anchor."""
    cu = batch.cu_seqlens.tolist()
    original = batch.input_ids.clone()
    original[batch.mlm_positions] = batch.mlm_labels
    total, anchors = hidden.new_zeros(()), 0
    for b in range(batch.num_sequences):
        if scope == "all":
            idx = list(range(cu[b], cu[b + 1]))
        else:
            idx = [int(p) for p in batch.mlm_positions if cu[b] <= int(p) < cu[b + 1]]
        labels = [int(original[i]) for i in idx]
        z = F.normalize(hidden[idx], dim=-1)
        for i in range(len(idx)):
            others = [a for a in range(len(idx)) if a != i]
            pos = [p for p in others if labels[p] == labels[i]]
            if not pos:
                continue
            sims = torch.stack([z[i] @ z[a] / temperature for a in others])
            log_denominator = torch.logsumexp(sims, 0)
            total = total - sum(z[i] @ z[p] / temperature - log_denominator for p in pos) / len(pos)
            anchors += 1
    return total, anchors


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand_ids(n, vocab=6):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    # Lengths span several 64-token buckets; label collisions are frequent (6 ids).
    seqs = [rand_ids(1), rand_ids(2), rand_ids(5), list(range(9)), rand_ids(70), rand_ids(130)]
    masked = [
        {},  # nothing masked
        {1: 3},  # one masked token: never an anchor
        {1: 2, 2: 2, 4: 5},  # one pair of positives
        {1: 1, 2: 2, 3: 3, 4: 4},  # masked, but no positives; scope all: distinct ids too
        {i: int(t) for i, t in zip(range(3, 70, 4), rand_ids(17, vocab=4))},
        {i: int(t) for i, t in zip(range(1, 130, 5), rand_ids(26, vocab=5))},
    ]
    batch = make_batch(seqs, masked)
    hidden = torch.randn(batch.num_tokens, 8, generator=g, dtype=torch.float64)
    return batch, hidden


@functools.cache
def _reference_on_case(scope):
    """(loss, anchors, d loss / d hidden) of the reference on _case(): slow, so computed once."""
    batch, hidden = _case()
    h = hidden.clone().requires_grad_(True)
    loss, anchors = reference_simreg(h, batch, 0.2, scope)
    loss.backward()
    return loss.detach(), anchors, h.grad


@pytest.mark.parametrize("scope", ["masked", "all"])
@pytest.mark.parametrize("bucket_width", [64, 4])
def test_simreg_matches_per_sequence_reference(scope, bucket_width):
    batch, hidden = _case()
    h = hidden.clone().requires_grad_(True)
    loss, anchors = simreg_loss(h, batch, temperature=0.2, scope=scope, bucket_width=bucket_width)
    ref, ref_anchors, ref_grad = _reference_on_case(scope)
    assert int(anchors) == ref_anchors > 10
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-10, atol=1e-10)
    loss.backward()
    torch.testing.assert_close(h.grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert anchors.dtype == torch.int64 and loss.dim() == 0


def test_simreg_masked_order_does_not_matter():
    batch, hidden = _case(seed=1)
    perm = torch.randperm(batch.mlm_positions.numel(), generator=torch.Generator().manual_seed(2))
    shuffled = UnpaddedBatch(
        **{**batch.__dict__, "mlm_positions": batch.mlm_positions[perm], "mlm_labels": batch.mlm_labels[perm]}
    )
    a = simreg_loss(hidden, batch, scope="masked")
    b = simreg_loss(hidden, shuffled, scope="masked")
    torch.testing.assert_close(a[0], b[0], rtol=1e-12, atol=1e-12)
    assert int(a[1]) == int(b[1])


@pytest.mark.parametrize("scope", ["masked", "all"])
def test_simreg_without_anchors_is_zero_not_nan(scope):
    # Every label distinct within its sequence; the second batch masks nothing at all.
    for batch in (make_batch([[1, 2, 3], [4, 5]], [{1: 3, 2: 0}, {1: 2}]), make_batch([[1, 2, 3], [4]], [{}, {}])):
        hidden = torch.randn(batch.num_tokens, 4, requires_grad=True)
        loss, anchors = simreg_loss(hidden, batch, scope=scope)
        assert loss.item() == 0.0 and int(anchors) == 0
        (loss + hidden.sum() * 0).backward()
        assert torch.isfinite(hidden.grad).all() and not hidden.grad.any()


def test_simreg_rows_without_candidates_give_finite_gradients():
    # The 2-token sequence shares a block with the 4-token one: its two padding rows have no
    # candidates at all. In float32 the backward pass must stay finite.
    batch = make_batch([[1, 2, 3, 1], [2, 5]], [{}, {}])
    hidden = torch.randn(batch.num_tokens, 4, generator=torch.Generator().manual_seed(4), requires_grad=True)
    loss, anchors = simreg_loss(hidden, batch, scope="all")
    loss.backward()
    assert int(anchors) == 2 and math.isfinite(loss.item()) and torch.isfinite(hidden.grad).all()
    assert hidden.grad[:4].any() and not hidden.grad[4:].any()


@pytest.mark.parametrize("scope", ["masked", "all"])
def test_simreg_gradcheck(scope):
    batch = make_batch([[1, 2, 1, 3], [2, 2, 5]], [{1: 2, 2: 2, 3: 1}, {0: 4, 2: 4}])
    hidden = torch.randn(
        batch.num_tokens, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5)
    ).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h: simreg_loss(h, batch, temperature=0.3, scope=scope)[0], (hidden,))


def test_simreg_bad_arguments():
    batch, hidden = _case()
    with pytest.raises(ValueError, match="simreg_scope"):
        simreg_loss(hidden, batch, scope="tokens")
    with pytest.raises(ValueError, match="simreg_temperature"):
        simreg_loss(hidden, batch, temperature=0.0)
    with pytest.raises(ValueError, match="hidden_states"):
        simreg_loss(hidden[:-1], batch)


# ---- MLM + NSP ---------------------------------------------------------------------------


def _heads(m=13, b=5, v=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(m, v, generator=g, dtype=torch.float64, requires_grad=True),
        torch.randint(0, v, (m,), generator=g),
        torch.randn(b, 2, generator=g, dtype=torch.float64, requires_grad=True),
        torch.randint(0, 2, (b,), generator=g),
    )


def test_pretraining_loss_is_the_mean_with_local_counts():
    mlm, mlm_y, nsp, nsp_y = _heads()
    loss, stats = pretraining_loss(mlm, mlm_y, nsp, nsp_y, 13, torch.tensor(5), with_accuracy=True)
    assert "mlm_correct" not in pretraining_loss(mlm, mlm_y, nsp, nsp_y, 13, 5)[1]
    expected = F.cross_entropy(mlm, mlm_y) + F.cross_entropy(nsp, nsp_y)
    torch.testing.assert_close(loss, expected)
    assert int(stats["mlm_correct"]) == int((mlm.argmax(-1) == mlm_y).sum())
    assert int(stats["num_masked"]) == 13 and int(stats["num_seqs"]) == 5
    torch.testing.assert_close(stats["mlm_loss_sum"], F.cross_entropy(mlm, mlm_y, reduction="sum"))


def test_pretraining_loss_does_not_depend_on_the_split():
    """Two 'ranks' holding uneven shares sum to the one-rank loss, gradients included."""
    mlm, mlm_y, nsp, nsp_y = _heads()
    whole, _ = pretraining_loss(mlm, mlm_y, nsp, nsp_y, 13, 5)
    whole.backward()
    grads = mlm.grad.clone(), nsp.grad.clone()
    mlm.grad = nsp.grad = None
    part_a, _ = pretraining_loss(mlm[:3], mlm_y[:3], nsp[:4], nsp_y[:4], torch.tensor(13), torch.tensor(5))
    part_b, _ = pretraining_loss(mlm[3:], mlm_y[3:], nsp[4:], nsp_y[4:], torch.tensor(13), torch.tensor(5))
    torch.testing.assert_close(part_a + part_b, whole)
    (part_a + part_b).backward()
    torch.testing.assert_close(mlm.grad, grads[0])
    torch.testing.assert_close(nsp.grad, grads[1])


def test_pretraining_loss_empty_and_low_precision():
    loss, _ = pretraining_loss(
        torch.zeros(0, 7),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, 2),
        torch.zeros(0, dtype=torch.long),
        0,
        torch.tensor(0),
    )
    assert float(loss) == 0.0
    mlm, mlm_y, nsp, nsp_y = _heads()
    loss, _ = pretraining_loss(mlm.detach().bfloat16(), mlm_y, nsp.detach().bfloat16(), nsp_y, 13, 5)
    assert loss.dtype == torch.float32


def test_anchor_count_on_the_host_matches_simreg_loss():
    from bert.distributed.host_counts import simreg_anchor_count
    from data.collate import collate_unpadded
    from data.samples import SampleBlock

    rng = np.random.default_rng(5)
    lens = rng.integers(2, 40, 12).astype(np.int32)
    counts = np.minimum(lens - 1, rng.integers(0, 8, 12)).astype(np.int32)
    positions = np.concatenate([np.sort(rng.choice(np.arange(1, n), c, replace=False)) for n, c in zip(lens, counts)])
    block = SampleBlock(
        input_ids=rng.integers(1, 6, lens.sum()).astype(np.int32),
        segment_ids=np.zeros(lens.sum(), np.int8),
        seq_lens=lens,
        masked_positions=positions.astype(np.int32),
        masked_ids=rng.integers(1, 6, counts.sum()).astype(np.int32),
        masked_counts=counts,
        nsp_labels=np.zeros(12, np.int8),
    )
    batch = collate_unpadded(block)
    hidden = torch.randn(batch.num_tokens, 8)
    for scope in ("masked", "all"):
        _, anchors = simreg_loss(hidden, batch, scope=scope)
        assert simreg_anchor_count(
            block.seq_lens, block.input_ids, block.masked_positions, block.masked_ids, block.masked_counts, scope
        ) == int(anchors)


@pytest.mark.parametrize("scope", ["masked", "all"])
def test_simreg_with_host_counts_is_the_same_and_reads_nothing(scope):
    from data.collate import collate_unpadded
    from data.synthetic import random_block
    from tools.device_reads import DeviceReads

    block = random_block(6, seed=4, max_seq_length=40, max_predictions=8, vocab_size=10)
    batch = collate_unpadded(block)
    hidden = torch.randn(batch.num_tokens, 16, generator=torch.Generator().manual_seed(0))
    read_back = simreg_loss(hidden, batch, 0.1, scope)
    counts = (block.masked_counts if scope == "masked" else block.seq_lens).tolist()
    with DeviceReads([hidden, *vars(batch).values()]) as reads:
        given = simreg_loss(hidden, batch, 0.1, scope, counts=counts)
    assert reads.total == 0, reads.report()
    assert torch.equal(given[0], read_back[0]) and torch.equal(given[1], read_back[1]) and given[1] > 0
    with pytest.raises(ValueError, match="counts: 5 entries for a batch of 6 sequences"):
        simreg_loss(hidden, batch, 0.1, scope, counts=counts[:5])
