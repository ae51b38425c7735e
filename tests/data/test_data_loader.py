"""PretrainingLoader and EvalLoader: global batches independent of the number of ranks,
disjoint ranks covering each epoch, mostly distinct files per rank, prefetch, exact resume
(also on another world size), and the eval slices."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from common.errors import DataError
from data.hdf5io import read_file, write_fixed
from data.loader import EvalLoader, PretrainingLoader, default_lanes, eval_slice
from data.samples import SampleBlock
from data.synthetic import random_block, write_shards

SIZES = [37, 50, 23, 61, 9, 44, 30]  # uneven, one smaller than a lane's batch
G, LANES, SEED = 12, 4, 3


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    write_shards(d, SIZES, seed=1, max_seq_length=32, max_predictions=5)
    return d


def _take(loader, n):
    return list(itertools.islice(iter(loader), n))


def _all_samples(shards):
    """(file, row) -> the sample, read directly from the files."""
    files = sorted(shards.iterdir())
    return [read_file(f) for f in files]


def test_global_batches_do_not_depend_on_world_size(shards):
    with PretrainingLoader(shards, G, 0, 1, seed=SEED, lanes=LANES) as ref:
        steps = 2 * ref.steps_per_epoch + 3  # crosses two epoch boundaries
        want = _take(ref, steps)
    for w in (2, 3, 4, 6, 12):
        loaders = [PretrainingLoader(shards, G, r, w, seed=SEED, lanes=LANES) for r in range(w)]
        iters = [iter(x) for x in loaders]
        for t in range(steps):
            parts = [next(i) for i in iters]
            assert all(len(p) == G // w for p in parts)
            assert SampleBlock.concat(parts).equals(want[t]), (w, t)
        for x in loaders:
            x.close()
    with PretrainingLoader(shards, G, 1, 3, seed=SEED, lanes=LANES) as x:
        assert x.global_batch(5).equals(want[5])
        assert x.global_batch(steps - 1).equals(want[steps - 1])


def test_samples_are_the_ones_named_and_an_epoch_covers_every_sample_once(shards):
    direct = _all_samples(shards)
    w = 4
    loaders = [PretrainingLoader(shards, G, r, w, seed=SEED, lanes=LANES) for r in range(w)]
    spe = loaders[0].steps_per_epoch
    assert spe == sum(SIZES) // G
    seen = []
    for x in loaders:
        blocks = _take(x, spe)
        for t, b in enumerate(blocks):
            ids = x.sample_ids(t)
            expect = SampleBlock.concat([direct[f].select([row]) for f, row in ids])
            assert b.equals(expect)
            seen.extend(map(tuple, ids))
        x.close()
    # Ranks are disjoint and, together, see each sample at most once; all but the N mod G
    # left over appear.
    assert len(seen) == len(set(seen)) == spe * G
    assert sum(SIZES) - len(seen) == sum(SIZES) % G
    # The next epoch reorders: other samples are left over, the order differs.
    ref = PretrainingLoader(shards, G, 0, 1, seed=SEED, lanes=LANES, prefetch=False)
    e1 = [tuple(x) for t in range(spe, 2 * spe) for x in ref.sample_ids(t)]
    assert len(set(e1)) == len(e1) and e1 != [tuple(x) for t in range(spe) for x in ref.sample_ids(t)]


def test_seed_changes_the_order(shards):
    a = PretrainingLoader(shards, G, seed=1, prefetch=False).sample_ids(0)
    b = PretrainingLoader(shards, G, seed=2, prefetch=False).sample_ids(0)
    assert not np.array_equal(a, b)


def test_ranks_read_mostly_distinct_files(tmp_path):
    sizes = [40] * 24
    write_shards(tmp_path, sizes, seed=4, max_seq_length=16, max_predictions=3)
    w = lanes = 8
    loader = PretrainingLoader(tmp_path, 16, 0, w, seed=0, lanes=lanes, prefetch=False)
    reads = [loader.files_read(0, rank=r) for r in range(w)]
    counts = np.bincount(np.concatenate(reads), minlength=len(sizes))
    # Every file is read, none by more than the two ranks whose lanes meet in it.
    assert counts.min() >= 1 and counts.max() <= 2
    assert counts.sum() <= len(sizes) + (lanes - 1)
    # A rank reads about 1/W of the files, not all of them.
    assert max(len(r) for r in reads) <= len(sizes) // w + 2


@pytest.mark.timeout(60)
def test_prefetch_reads_ahead_in_a_thread_and_matches_synchronous_reads(shards, monkeypatch):
    import data.loader

    reader_threads = set()
    real = data.loader.read_file

    def spy(*a, **k):
        reader_threads.add(threading.current_thread().name)
        return real(*a, **k)

    monkeypatch.setattr(data.loader, "read_file", spy)
    with PretrainingLoader(shards, G, 1, 2, seed=SEED, lanes=LANES, prefetch=True) as a:
        got = _take(a, 25)
        assert len(a._loaded) <= len(a._plan.parts) + a.prefetch_files + 1  # shards are dropped after use
    assert reader_threads and all(n.startswith("data-prefetch") for n in reader_threads)
    reader_threads.clear()
    b = PretrainingLoader(shards, G, 1, 2, seed=SEED, lanes=LANES, prefetch=False)
    for x, y in zip(got, _take(b, 25)):
        assert x.equals(y)
    assert reader_threads == {threading.main_thread().name}


@pytest.mark.parametrize("resume_w", [2, 1, 3, 6])
def test_exact_resume_on_any_world_size(shards, resume_w):
    w = 2
    first = [PretrainingLoader(shards, G, r, w, seed=SEED, lanes=LANES) for r in range(w)]
    iters = [iter(x) for x in first]
    stop = first[0].steps_per_epoch + 2  # resume inside the second epoch
    for _ in range(stop):
        for i in iters:
            next(i)
    state = first[0].state_dict()
    assert state["step"] == stop and all(x.state_dict() == state for x in first)
    continued = [SampleBlock.concat([next(i) for i in iters]) for _ in range(6)]
    for x in first:
        x.close()
    resumed = [PretrainingLoader(shards, G, r, resume_w, seed=SEED, lanes=LANES) for r in range(resume_w)]
    for x in resumed:
        x.load_state_dict(state)
    riters = [iter(x) for x in resumed]
    for t in range(6):
        assert SampleBlock.concat([next(i) for i in riters]).equals(continued[t]), t
    for x in resumed:
        x.close()


def test_resume_refuses_another_sample_order(shards):
    a = PretrainingLoader(shards, G, seed=SEED, lanes=LANES, prefetch=False)
    state = a.state_dict()
    for kw, key in ((dict(seed=SEED + 1, lanes=LANES), "seed"), (dict(seed=SEED, lanes=2), "lanes")):
        b = PretrainingLoader(shards, G, prefetch=False, **kw)
        with pytest.raises(DataError, match=f"loader state: {key} differs"):
            b.load_state_dict(state)
    c = PretrainingLoader(sorted(shards.iterdir())[:-1], G, seed=SEED, lanes=LANES, prefetch=False)
    with pytest.raises(DataError, match="loader state: files differs"):
        c.load_state_dict(state)


def test_varlength_shards_load_the_same_batches(shards, tmp_path):
    from data.prepare.convert import convert_file

    for f in shards.iterdir():
        convert_file(f, tmp_path / f.name, "varlength")
    a = PretrainingLoader(shards, G, 0, 2, seed=SEED, prefetch=False)
    b = PretrainingLoader(tmp_path, G, 0, 2, seed=SEED, prefetch=False)
    for x, y in zip(_take(a, 8), _take(b, 8)):
        assert x.equals(y)


def test_argument_checks(shards):
    with pytest.raises(ValueError, match="world_size 5 must divide global_batch_size 12"):
        PretrainingLoader(shards, 12, 0, 5)
    with pytest.raises(ValueError, match="lanes 5 must divide global_batch_size 12"):
        PretrainingLoader(shards, 12, lanes=5)
    with pytest.raises(DataError, match="cannot fill one global batch of 1000"):
        PretrainingLoader(shards, 1000)
    with pytest.raises(ValueError, match="backend 'jax'"):
        PretrainingLoader(shards, 12, backend="jax")
    assert default_lanes(448) == 16 and default_lanes(56) == 14 and default_lanes(7) == 7 and default_lanes(34) == 2


def test_eval_loader_gives_contiguous_slices(tmp_path):
    blk = random_block(103, seed=9, max_seq_length=32, max_predictions=5)
    path = tmp_path / "part_eval_10k.hdf5"
    write_fixed(path, blk, 32, 5)
    for w in (1, 4, 7):
        got = []
        for r in range(w):
            ev = EvalLoader(path, batch_size=6, rank=r, world_size=w)
            start, stop = eval_slice(103, r, w)
            assert (ev.start, ev.stop) == (start, stop) and ev.num_samples == stop - start
            batches = list(ev)
            assert len(batches) == len(ev) and all(len(b) == 6 for b in batches[:-1])
            got.append(SampleBlock.concat(batches))
        assert SampleBlock.concat(got).equals(blk)
    capped = [EvalLoader(path, 5, r, 3, max_samples=50) for r in range(3)]
    assert all(e.total_samples == 50 for e in capped)
    assert SampleBlock.concat([SampleBlock.concat(list(e)) for e in capped]).equals(blk.select(np.arange(50)))
    assert EvalLoader(path, 5, max_samples=1000).total_samples == 103
    sizes = [eval_slice(10, r, 16) for r in range(16)]
    assert sum(b - a for a, b in sizes) == 10 and EvalLoader(path, 4, 0, 200).num_samples == 0
