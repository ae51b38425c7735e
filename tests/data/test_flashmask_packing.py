"""The packed layout: first-fit-decreasing packing, ``collate_packed`` (PackedBatch), NVIDIA's
packed HDF5 layout (writer, validating reader, ``data.prepare.convert --to packed``) and the loader
on packed files."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import DataError, cli_main
from data.batch import PackedBatch
from data.collate import collate_unpadded
from data.hdf5io import PACKED_KEYS, inspect, read_file, write_file, write_fixed
from data.loader import EvalLoader, PretrainingLoader
from data.packing import collate_packed, first_fit_decreasing, unpack
from data.prepare.convert import main as convert_main
from data.synthetic import random_block, write_shards

S, P, V = 64, 10, 300


def naive_ffd(lengths, capacity):
    """First-fit decreasing, spelled out: longest first (ties in order), lowest row with room."""
    free, row, offset = [], {}, {}
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, f in enumerate(free) if f >= lengths[i]), len(free))
        if r == len(free):
            free.append(capacity)
        row[i], offset[i] = r, capacity - free[r]
        free[r] -= lengths[i]
    return [row[i] for i in range(len(lengths))], [offset[i] for i in range(len(lengths))], len(free)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.integers(1, 80).flatmap(lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), max_size=60))))
def test_first_fit_decreasing_is_first_fit_decreasing(case):
    capacity, lengths = case
    row, offset, rows = first_fit_decreasing(lengths, capacity)
    assert (row.tolist(), offset.tolist(), rows) == naive_ffd(lengths, capacity)
    # Whole sequences, never past a row's end, never overlapping.
    lens = np.asarray(lengths, dtype=np.int64)
    assert bool((offset + lens <= capacity).all()) if len(lens) else rows == 0
    used = np.zeros((rows, capacity), np.int64)
    for r, o, n in zip(row, offset, lens):
        used[r, o : o + n] += 1
    assert used.max(initial=0) <= 1 and int(used.sum()) == int(lens.sum())


def test_packing_is_deterministic_and_refuses_long_sequences():
    lengths = np.random.default_rng(0).integers(1, 513, 448)
    a = first_fit_decreasing(lengths, 512)
    b = first_fit_decreasing(lengths.copy(), 512)
    assert all(np.array_equal(x, y) for x, y in zip(a[:2], b[:2])) and a[2] == b[2]
    assert a[2] >= -(-int(lengths.sum()) // 512)
    with pytest.raises(DataError, match="sample 1 has 600 tokens"):
        first_fit_decreasing([5, 600, 7], 512)
    big = np.random.default_rng(1).integers(1, 513, 50_000)  # a shard's worth: the tree keeps it fast
    row, offset, rows = first_fit_decreasing(big, 512)
    assert np.bincount(row, weights=big).max() <= 512 and rows < 0.6 * len(big)


@pytest.fixture
def block():
    return random_block(30, seed=21, max_seq_length=S, max_predictions=P, vocab_size=V, min_len=3)


def test_collate_packed_against_the_unpadded_batch(block):
    packed = collate_packed(block, S).check_values(vocab_size=V)
    unpadded = collate_unpadded(block)
    assert isinstance(packed, PackedBatch) and packed.input_ids.shape[1] == S
    assert packed.num_sequences == len(block) and packed.num_tokens == block.num_tokens
    flat = packed.input_ids.reshape(-1)
    # The same tokens, segments and positions, sequence by sequence, in sample order.
    tokens = packed.token_index()
    assert torch.equal(flat[tokens], unpadded.input_ids)
    assert torch.equal(packed.segment_ids.reshape(-1)[tokens], unpadded.segment_ids)
    assert torch.equal(packed.position_ids.reshape(-1)[tokens], unpadded.position_ids)
    assert torch.equal(packed.cls_positions, tokens[unpadded.cu_seqlens[:-1].long()])
    # Masked positions point at the same tokens, labels and NSP in the same order.
    assert torch.equal(packed.mlm_positions, tokens[unpadded.mlm_positions])
    assert torch.equal(packed.mlm_labels, unpadded.mlm_labels) and torch.equal(packed.nsp_labels, unpadded.nsp_labels)
    # The bounds are FlashMask's document mask of each row's sequences, in placement order.
    from kernels.masks import document_mask

    rows = packed.cls_positions // S
    per_row = [
        [
            int(n)
            for _, n in sorted(zip((packed.cls_positions[rows == r] % S).tolist(), packed.seq_lens[rows == r].tolist()))
        ]
        for r in range(packed.num_rows)
    ]
    assert torch.equal(packed.startend_row_indices, document_mask(per_row, S).startend_row_indices)
    # unpack() gives back the unpadded batch and where its tokens sit.
    back, index = unpack(packed)
    assert torch.equal(index, tokens)
    for field in (
        "input_ids",
        "segment_ids",
        "position_ids",
        "cu_seqlens",
        "mlm_positions",
        "mlm_labels",
        "nsp_labels",
    ):
        assert torch.equal(getattr(back, field), getattr(unpadded, field)), field
    assert back.max_seqlen == unpadded.max_seqlen
    # Deterministic.
    again = collate_packed(block, S)
    assert all(
        torch.equal(getattr(packed, f), getattr(again, f))
        for f in ("input_ids", "startend_row_indices", "cls_positions", "mlm_positions")
    )


def test_packed_batch_checks_name_the_field(block):
    packed = collate_packed(block, S)
    bad = packed.startend_row_indices.clone()
    bad[0, 0, 1, 0] += 1
    with pytest.raises(ValueError, match="startend_row_indices"):
        PackedBatch(**{**vars(packed), "startend_row_indices": bad}).check_values()
    with pytest.raises(ValueError, match="startend_row_indices: expected torch.int32"):
        PackedBatch(**{**vars(packed), "startend_row_indices": bad.long()})
    with pytest.raises(ValueError, match="cls_positions: length"):
        PackedBatch(**{**vars(packed), "cls_positions": packed.cls_positions[:-1]})
    positions = packed.position_ids.clone()
    positions[0, 0] = 7
    with pytest.raises(ValueError, match="position_ids"):
        PackedBatch(**{**vars(packed), "position_ids": positions}).check_values()
    with pytest.raises(DataError, match="empty"):
        collate_packed(block.select(np.zeros(0, np.int64)), S)


def _pack_order(block, seq_len):
    row, offset, _ = first_fit_decreasing(block.seq_lens, seq_len)
    return np.lexsort((offset, row))


def test_packed_hdf5_layout_round_trip(block, tmp_path):
    path = tmp_path / "packed.hdf5"
    write_file(path, block, "packed", S, P)
    with h5py.File(path) as f:
        assert sorted(f.keys()) == sorted(PACKED_KEYS)
        for key, dtype in (
            ("input_ids", np.int16),
            ("segment_ids", np.int8),
            ("packed_input_len", np.int16),
            ("masked_lm_positions", np.int16),
            ("masked_lm_ids", np.int16),
            ("packed_masked_lm_len", np.int16),
            ("next_sentence_labels", np.int8),
        ):
            assert h5py.check_vlen_dtype(f[key].dtype) == np.dtype(dtype), key
        packs = [
            (ids, lens, pos, mids)
            for ids, lens, pos, mids in zip(
                f["input_ids"][:], f["packed_input_len"][:], f["masked_lm_positions"][:], f["masked_lm_ids"][:]
            )
        ]
    assert all(len(ids) == int(lens.sum()) <= S for ids, lens, _, _ in packs)
    # Masked positions index the pack: the token there is the sequence's token at that slot.
    order = _pack_order(block, S)
    expect = block.select(order)
    info = inspect(path)
    assert (info.layout, info.num_samples, info.num_packs, info.max_seq_length) == ("packed", 30, len(packs), S)
    got = read_file(path, vocab_size=V)
    assert got.equals(expect)
    flat_pos = np.concatenate([p for _, _, p, _ in packs]).astype(np.int64)
    starts = np.repeat(
        np.concatenate([[0], np.cumsum([len(ids) for ids, *_ in packs])[:-1]]), [len(p) for _, _, p, _ in packs]
    )
    all_ids = np.concatenate([ids for ids, *_ in packs])
    seq_starts = np.repeat(np.concatenate([[0], np.cumsum(expect.seq_lens)[:-1]]), expect.masked_counts)
    np.testing.assert_array_equal(all_ids[starts + flat_pos], expect.input_ids[seq_starts + expect.masked_positions])
    # Ranges of samples cut across packs.
    for start, stop in ((0, 30), (3, 17), (29, 30), (11, 11)):
        assert read_file(path, start=start, stop=stop).equals(expect.select(np.arange(start, stop)))


def _rewrite(path, key, edit):
    with h5py.File(path, "a") as f:
        values = f[key][:]
        edit(values)
        dtype = f[key].dtype
        del f[key]
        f.create_dataset(key, data=values, dtype=dtype)


@pytest.mark.parametrize(
    "key,edit,want",
    [
        ("packed_input_len", lambda v: v.__setitem__(1, v[1] + np.int16(1)), "pack 1: packed_input_len sums to"),
        ("masked_lm_positions", lambda v: v.__setitem__(0, v[0] + np.int16(S)), "masked position"),
        ("next_sentence_labels", lambda v: v.__setitem__(2, v[2][:-1]), "pack 2: next_sentence_labels has"),
    ],
)
def test_bad_packed_files_name_the_pack_or_sample(block, tmp_path, key, edit, want):
    path = tmp_path / "bad.hdf5"
    write_file(path, block, "packed", S, P)
    _rewrite(path, key, edit)
    with pytest.raises(DataError, match=want) as e:
        read_file(path)
    assert str(path) in str(e.value)


def test_convert_to_packed_and_back(block, tmp_path, capsys):
    src = tmp_path / "in"
    src.mkdir()
    write_fixed(src / "part_00000_of_00001.hdf5", block, S, P)
    assert cli_main(convert_main, [str(src), str(tmp_path / "packed"), "--to", "packed"]) == 0
    packed = tmp_path / "packed" / "part_00000_of_00001.hdf5"
    assert inspect(packed).layout == "packed"
    assert cli_main(convert_main, [str(packed), str(tmp_path / "var.hdf5"), "--to", "varlength"]) == 0
    assert read_file(tmp_path / "var.hdf5").equals(block.select(_pack_order(block, S)))
    assert (
        cli_main(convert_main, [str(packed), str(tmp_path / "p2.hdf5"), "--to", "packed", "--max-seq-length", "40"])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "packing needs 1 to seq_len 40" in err


def test_loader_reads_packed_files_and_packs_each_step(tmp_path):
    src, dst = tmp_path / "fixed", tmp_path / "packed"
    src.mkdir()
    write_shards(src, [20, 33, 17], seed=5, max_seq_length=S, max_predictions=P, vocab_size=V)
    assert cli_main(convert_main, [str(src), str(dst), "--to", "packed"]) == 0
    with PretrainingLoader(dst, 8, rank=1, world_size=2, seed=3, prefetch=False, vocab_size=V) as loader:
        batches = list(zip(range(4), loader.batches(layout="packed", seq_len=S)))
        assert loader.global_batch(0).num_tokens > 0
    for _, batch in batches:
        assert isinstance(batch, PackedBatch) and batch.num_sequences == 4
        batch.check_values(vocab_size=V)
    with PretrainingLoader(dst, 8, seed=3) as loader, pytest.raises(ValueError, match="needs seq_len"):
        next(loader.batches(layout="packed"))
    ev = EvalLoader(dst / "part_00001_of_00003.hdf5", batch_size=10, rank=0, world_size=2)
    got = [b for b in ev.batches(layout="packed", seq_len=S)]
    assert sum(b.num_sequences for b in got) == ev.num_samples == 16
