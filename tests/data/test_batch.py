"""unpad/pad: hand-computed cases, round trips, and bad input naming the field."""

import numpy as np
import pytest
import torch

from data.batch import PaddedBatch, UnpaddedBatch, pad, unpad
from tests.batches import fixed_layout, random_batch


def hand_case():
    ids = np.array([[101, 7, 8, 102, 0, 0], [101, 9, 102, 0, 0, 0], [101, 0, 0, 0, 0, 0]])
    mask = (ids != 0).astype(np.int8)
    seg = np.array([[0, 0, 0, 1, 0, 0], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    mpos = np.array([[2, 1], [1, 0], [0, 0]])
    mids = np.array([[30, 31], [32, 0], [0, 0]])
    return dict(
        input_ids=ids,
        segment_ids=seg,
        input_mask=mask,
        masked_lm_positions=mpos,
        masked_lm_ids=mids,
        next_sentence_labels=np.array([1, 0, 1]),
    )


def test_unpad_hand_computed():
    b = unpad(**hand_case())
    assert b.cu_seqlens.dtype == torch.int32
    assert b.cu_seqlens.tolist() == [0, 4, 7, 8]
    assert b.max_seqlen == 4 and isinstance(b.max_seqlen, int)
    assert b.input_ids.tolist() == [101, 7, 8, 102, 101, 9, 102, 101]
    assert b.segment_ids.tolist() == [0, 0, 0, 1, 0, 1, 1, 0]
    assert b.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    # Masked positions map to flat indices: seq 0 pos 2 -> 2, pos 1 -> 1; seq 1 pos 1 -> 5.
    assert b.mlm_positions.tolist() == [2, 1, 5]
    assert b.mlm_labels.tolist() == [30, 31, 32]
    assert b.nsp_labels.tolist() == [1, 0, 1]
    b.check_values(vocab_size=200)


def test_pad_unpad_round_trip():
    arrays = fixed_layout([1, 2, 97, 128, 5], vocab_size=500, seq_len=130, seed=3)
    b = unpad(**arrays)
    p = pad(b, 130)
    assert isinstance(p, PaddedBatch)
    assert torch.equal(p.input_ids, torch.as_tensor(arrays["input_ids"]))
    assert torch.equal(p.attention_mask, torch.as_tensor(arrays["input_mask"]).bool())
    assert torch.equal(p.input_ids.view(-1)[p.mlm_positions], b.mlm_labels * 0 + b.input_ids[b.mlm_positions])
    again = unpad(
        p.input_ids,
        p.segment_ids,
        p.attention_mask.long(),
        arrays["masked_lm_positions"],
        arrays["masked_lm_ids"],
        p.nsp_labels,
    )
    for f in ("input_ids", "segment_ids", "position_ids", "cu_seqlens", "mlm_positions", "mlm_labels", "nsp_labels"):
        assert torch.equal(getattr(again, f), getattr(b, f)), f
    assert p.num_tokens == b.num_tokens == 233


def test_masked_positions_point_at_the_right_tokens():
    arrays = fixed_layout([50, 3, 77], vocab_size=1000, seed=7)
    b = unpad(**arrays)
    flat = b.input_ids
    ids = arrays["input_ids"]
    used = arrays["masked_lm_positions"] != 0
    rows = np.nonzero(used)[0]
    expect = ids[rows, arrays["masked_lm_positions"][used]]
    assert flat[b.mlm_positions].tolist() == expect.tolist()


def test_bad_dtype_is_named():
    b = random_batch([3, 4], 50)
    with pytest.raises(ValueError, match="input_ids"):
        UnpaddedBatch(**{**b.__dict__, "input_ids": b.input_ids.float()})
    with pytest.raises(ValueError, match="cu_seqlens"):
        UnpaddedBatch(**{**b.__dict__, "cu_seqlens": b.cu_seqlens.long()})
    with pytest.raises(ValueError, match="max_seqlen"):
        UnpaddedBatch(**{**b.__dict__, "max_seqlen": 4.0})
    with pytest.raises(ValueError, match="input_ids"):
        unpad(**{**hand_case(), "input_ids": hand_case()["input_ids"].astype(np.float32)})


def test_mismatched_lengths_are_named():
    b = random_batch([3, 4], 50)
    with pytest.raises(ValueError, match="segment_ids"):
        UnpaddedBatch(**{**b.__dict__, "segment_ids": b.segment_ids[:-1]})
    with pytest.raises(ValueError, match="mlm_labels"):
        UnpaddedBatch(**{**b.__dict__, "mlm_labels": b.mlm_labels[:-1]})
    with pytest.raises(ValueError, match="cu_seqlens"):
        UnpaddedBatch(**{**b.__dict__, "nsp_labels": b.nsp_labels[:1]})
    with pytest.raises(ValueError, match="next_sentence_labels"):
        unpad(**{**hand_case(), "next_sentence_labels": np.array([1, 0])})
    with pytest.raises(ValueError, match="cu_seqlens"):
        UnpaddedBatch(**{**b.__dict__, "cu_seqlens": torch.tensor([0, 3, 6], dtype=torch.int32)}).check_values()


def test_masked_position_past_sequence_end_is_named():
    case = hand_case()
    case["masked_lm_positions"] = np.array([[2, 1], [3, 0], [0, 0]])  # row 1 has 3 tokens
    with pytest.raises(ValueError, match="masked_lm_positions: row 1 slot 0 is position 3"):
        unpad(**case)
    b = random_batch([3, 4], 50)
    with pytest.raises(ValueError, match="mlm_positions"):
        UnpaddedBatch(**{**b.__dict__, "mlm_positions": b.mlm_positions + 100}).check_values()
    with pytest.raises(ValueError, match="input_mask"):
        unpad(**{**case, "input_mask": np.array([[1, 0, 1, 0, 0, 0]] * 3)})
    with pytest.raises(ValueError, match="input_ids"):
        random_batch([3, 4], 50).check_values(vocab_size=10)
