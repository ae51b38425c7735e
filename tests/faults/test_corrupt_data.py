"""A training shard that turns out corrupt in the middle of an epoch: data.on_corrupt=fail stops
the run naming file and sample; skip replaces the bad samples by the next valid ones of the
stream, counts them, and every rank (and any number of ranks) trains on the same batches."""

from __future__ import annotations

import os
import re

import h5py
import numpy as np
import pytest

import run_pretraining
from common.errors import DataError
from data.loader import PretrainingLoader
from data.rebalance.exchange import check_block
from tests.batches import write_dataset
from tests.faults.common import losses, metrics, run_args, run_in_process, spawn_ranks, summary

G, SEED, VOCAB = 8, 42, 96  # global batch, train.seed and model.overrides.vocab_size of the tiny runs
STEPS = ["train.max_steps=16", "train.seed=42"]
USED_AT = (12, 14)  # 0-based steps whose first sample is made corrupt: trained at steps 13 and 15


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory):
    """16 shards of 12 samples: lane 0 reads one shard in steps 0-11 and the next in steps 12-23,
    so that second shard is first needed in the middle of the epoch. Two of its samples are
    damaged: one holds an out-of-vocabulary token, in the other the bytes of input_mask are
    overwritten on disk. Returns (dataset, the shard's path, the damaged rows)."""
    root = str(tmp_path_factory.mktemp("corrupt"))
    train, eval_file = write_dataset(root, num_files=16, per_file=12)
    loader = PretrainingLoader(train, G, seed=SEED, prefetch=False)
    first = {e.file: e.first for e in loader._plan.entries(0)}
    target = int(loader.sample_ids(USED_AT[0], world_size=1)[0, 0])
    assert first[target] == USED_AT[0]
    rows = [int(loader.sample_ids(s, world_size=1)[0, 1]) for s in USED_AT]
    assert all(int(loader.sample_ids(s, world_size=1)[0, 0]) == target for s in USED_AT)
    path = str(loader.files[target])
    with h5py.File(path, "r+") as f:
        ids = f["input_ids"][rows[0]]
        ids[1] = 30000
        f["input_ids"][rows[0]] = ids
        mask = f["input_mask"]
        offset, width = mask.id.get_offset(), mask.shape[1]
    with open(path, "r+b") as raw:  # damage the file's bytes, as a bad disk would
        raw.seek(offset + rows[1] * width + 3)
        raw.write(b"\x07\x07\x07")
    return (train, eval_file), path, sorted(rows)


def test_fail_stops_mid_epoch_naming_file_and_sample(corrupt, tmp_path, capsys):
    dataset, path, rows = corrupt
    code = run_pretraining.main(["--output-dir", str(tmp_path), *run_args(dataset, *STEPS)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    m = re.match(rf"error \(rank 0\): {re.escape(path)}: sample (\d+): (.*)$", err[0])
    assert m and int(m.group(1)) in rows, err[0]
    assert m.group(2) in (
        "input_mask holds values other than 0 and 1",
        "input_ids holds 30000, outside the vocabulary's 96 entries",
    )
    assert max(r["step"] for r in metrics(tmp_path) if "loss" in r) == USED_AT[0]  # the steps before it ran


def test_skip_replaces_counts_and_reports(corrupt, tmp_path, capsys):
    dataset, path, rows = corrupt
    s = run_in_process(dataset, tmp_path, *STEPS, "data.on_corrupt=skip")
    printed = capsys.readouterr().out
    assert s["steps"] == 16 and s["corrupt_samples_skipped"] == 2
    assert re.search(
        rf"warning: {re.escape(path)}: 2 of 12 samples corrupt, skipped \(data.on_corrupt=skip\): "
        rf"sample {rows[0]}: .*; sample {rows[1]}: ",
        printed,
    ), printed
    counted = {r["step"]: r["corrupt_samples"] for r in metrics(tmp_path) if "loss" in r}
    assert [counted[i] for i in (12, 13, 14, 15, 16)] == [0, 1, 1, 2, 2]
    assert "step 13: 1 corrupt sample(s) replaced" in printed and "step 15: 1 corrupt sample(s)" in printed


def test_skip_is_the_same_for_any_number_of_ranks(corrupt):
    """The replacement depends on the stream only: W ranks' blocks put together are the
    1-rank block, every block is valid and full, and resuming gives the same blocks."""
    train, _ = corrupt[0]
    one = PretrainingLoader(train, G, seed=SEED, vocab_size=VOCAB, on_corrupt="skip", prefetch=False)
    two = [PretrainingLoader(train, G, r, 2, seed=SEED, vocab_size=VOCAB, on_corrupt="skip") for r in range(2)]
    whole, parts = iter(one), [iter(x) for x in two]
    replaced = []
    for step in range(2 * one.steps_per_epoch):
        block = next(whole)
        halves = [next(p) for p in parts]
        assert np.concatenate([h.input_ids for h in halves]).tolist() == block.input_ids.tolist()
        assert all(check_block(h, G // 2, 64)[0] == 0 for h in halves)
        assert one.global_batch(step).equals(block)
        replaced.append(one.pop_substituted(step))
        assert sum(x.pop_substituted(step) for x in two) == replaced[-1]
    # Each epoch uses every sample once: the two bad ones are replaced once per epoch.
    assert [i for i, n in enumerate(replaced[:24]) if n] == list(USED_AT) and sum(replaced) == 4
    resumed = PretrainingLoader(train, G, 1, 2, seed=SEED, vocab_size=VOCAB, on_corrupt="skip", prefetch=False)
    resumed.load_state_dict({**two[1].state_dict(), "step": 12})
    again = PretrainingLoader(train, G, 1, 2, seed=SEED, vocab_size=VOCAB, on_corrupt="skip", prefetch=False)
    it = iter(again)
    for _ in range(12):
        next(it)
    for a, b in zip(iter(resumed), [next(it) for _ in range(6)]):
        assert a.equals(b)
    for x in (one, *two, resumed, again):
        x.close()


def test_skip_leaves_out_a_file_that_cannot_be_opened(corrupt, tmp_path):
    train, _ = corrupt[0]
    files = sorted(os.listdir(train))
    broken = tmp_path / "part_99999_of_99999.hdf5"
    broken.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))
    paths = [os.path.join(train, f) for f in files] + [str(broken)]
    with pytest.raises(DataError, match=rf"^{re.escape(str(broken))}: not a readable HDF5 file"):
        PretrainingLoader(paths, G, seed=SEED)
    warnings = []
    loader = PretrainingLoader(paths, G, seed=SEED, on_corrupt="skip", warn=warnings.append)
    assert len(loader.files) == 16 and len(warnings) == 1 and "leaving the file out" in warnings[0]
    loader.close()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_skip_on_two_ranks_trains_what_one_rank_trains(corrupt, tmp_path):
    dataset = corrupt[0]
    run_in_process(dataset, tmp_path / "one", *STEPS, "data.on_corrupt=skip")
    jobs = spawn_ranks(
        2, tmp_path / "two", dataset, *STEPS, "data.on_corrupt=skip", "data.rebalance=balanced", log_dir=str(tmp_path)
    )
    try:
        for j in jobs:
            assert j.wait(120, "a rank") == 0, j.output()[-3000:]
    finally:
        for j in jobs:
            j.kill()
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    assert (
        summary(tmp_path / "two")["corrupt_samples_skipped"]
        == summary(tmp_path / "one")["corrupt_samples_skipped"]
        == 2
    )


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fail_on_two_ranks_the_other_rank_names_the_cause(corrupt, tmp_path):
    """Rank 0 reads the bad shard and stops; rank 1, blocked in the next collective, says why."""
    dataset, path, rows = corrupt
    jobs = spawn_ranks(2, tmp_path / "out", dataset, *STEPS, "data.rebalance=none", log_dir=str(tmp_path))
    try:
        codes = [j.wait(120, f"rank {r}") for r, j in enumerate(jobs)]
    finally:
        for j in jobs:
            j.kill()
    logs = [j.output() for j in jobs]
    assert codes == [2, 1], logs
    assert re.search(rf"^error \(rank 0\): {re.escape(path)}: sample \d+: ", logs[0], re.M), logs[0][-2000:]
    assert re.search(
        rf"^error: rank 1: the [\w\- ()]+ at step 13 failed .*: rank 0 stopped first: "
        rf"{re.escape(path)}: sample \d+: ",
        logs[1],
        re.M,
    ), logs[1][-2000:]
    assert "Traceback" not in logs[0] + logs[1]
