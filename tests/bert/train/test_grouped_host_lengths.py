"""The grouped attention plan comes from the collator's host-side lengths (issue 24).

``UnpaddedBatch.host_seqlens`` (the collator's lengths, with the static-shape padding
sequence appended) is what ``triton_grouped`` plans from: the plan equals the one read from
``cu_seqlens``, and a forward and backward through the model with them reads nothing back
from the device (``tools.device_reads``); without them the plan reads ``cu_seqlens``.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from bert.model.config import BertConfig  # noqa: E402
from bert.model.pretraining import BertForPreTraining  # noqa: E402
from data.collate import collate_unpadded  # noqa: E402
from data.static_shapes import StaticShapes  # noqa: E402
from data.synthetic import random_block  # noqa: E402
from kernels.grouped import cached_plan, host_seqlens, note_host_seqlens, plan_groups  # noqa: E402
from tools.device_reads import DeviceReads  # noqa: E402

BUCKETS = (8, 16, 32)


def _same_plan(a, b) -> bool:
    same_order = (a.order is None and b.order is None) or (
        a.order is not None and b.order is not None and torch.equal(a.order, b.order)
    )
    return same_order and a.groups == b.groups


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(n=st.integers(1, 12), seed=st.integers(0, 10_000), static=st.booleans())
def test_the_plan_from_host_lengths_is_the_plan_from_cu_seqlens(n, seed, static):
    batch = collate_unpadded(random_block(n, seed, max_seq_length=48, max_predictions=6, vocab_size=50, min_len=5))
    if static:  # the padding sequence is one more host length
        batch = StaticShapes(token_bucket=64, masked_bucket=16, max_seqlen=64).pad(batch)
    assert batch.host_seqlens is not None and len(batch.host_seqlens) == batch.num_sequences
    assert list(batch.host_seqlens) == batch.seqlens.tolist()
    read = cached_plan(batch.cu_seqlens.clone(), batch.max_seqlen, BUCKETS)  # nothing noted: read from the tensor
    cu = batch.cu_seqlens.clone()
    note_host_seqlens(cu, batch.host_seqlens)
    assert host_seqlens(cu) == list(batch.host_seqlens)
    assert _same_plan(cached_plan(cu, batch.max_seqlen, BUCKETS), read)
    assert _same_plan(plan_groups(batch.host_seqlens, BUCKETS), read)


def test_noted_lengths_are_forgotten_once_cu_seqlens_changes():
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    note_host_seqlens(cu, (3, 7))
    cu.copy_(torch.tensor([0, 5, 10], dtype=torch.int32))  # a new version: read it again
    assert host_seqlens(cu) == [5, 5]
    with pytest.raises(ValueError, match="host_seqlens: 3 lengths for the 2 sequences"):
        note_host_seqlens(cu, (3, 3, 4))


@pytest.mark.parametrize("static", [False, True])
def test_grouped_attention_with_host_lengths_reads_nothing(static):
    """The forward reads nothing; the backward reads nothing for the plan. (The backward's one
    count is the dropout seed's ``.tolist()`` in ``_bwd_impl``: a CPU tensor on a GPU too, but
    an op's output, so counted by DeviceReads' taint rule; the device-side RNG removes it.)"""
    torch.manual_seed(0)
    config = BertConfig.preset("tiny", vocab_size=64, num_hidden_layers=1)
    model = BertForPreTraining(config, attention="triton_grouped", attention_options={"buckets": BUCKETS})
    batch = collate_unpadded(random_block(5, 3, max_seq_length=40, max_predictions=6, vocab_size=64, min_len=5))
    if static:
        batch = StaticShapes(token_bucket=64, masked_bucket=16, max_seqlen=64).pad(batch)
    counted = {}
    for name, lengths in (("host", batch.host_seqlens), ("none", None)):
        fresh = dataclasses.replace(batch, cu_seqlens=batch.cu_seqlens.clone(), host_seqlens=lengths)  # no plan cached
        with DeviceReads(list(model.parameters())) as reads:
            moved = fresh.to("cpu")  # .to marks the batch's tensors device tensors
            out = model(moved)
            forward = list(reads.log)
            loss = F.cross_entropy(out.mlm_logits, moved.mlm_labels) + F.cross_entropy(out.nsp_logits, moved.nsp_labels)
            loss.backward()
        counted[name] = (forward, [where for _, where in reads.log if where.startswith("grouped.py")])
    assert counted["host"] == ([], []), counted["host"]
    # Without them the forward copies cu_seqlens back to plan (and, on the CPU only, to check max_seqlen).
    assert counted["none"][1] and counted["none"][0][0][0] == "tolist", counted["none"]
