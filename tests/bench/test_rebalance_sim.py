"""bench/rebalance_sim.py: reading lengths from prepared HDF5 (both layouts), byte counts, CLI."""

import json

import h5py
import numpy as np
import pytest

from bench import rebalance_sim as sim
from data.rebalance.plan import assign


def write_fixed(path, lengths, masked):
    n = len(lengths)
    mask = (np.arange(512)[None, :] < np.asarray(lengths)[:, None]).astype(np.int8)
    pos = np.zeros((n, 76), np.int16)
    for i, m in enumerate(masked):
        pos[i, :m] = np.arange(1, m + 1)
    with h5py.File(path, "w") as f:
        f["input_ids"] = mask.astype(np.int16) * 7
        f["input_mask"] = mask
        f["segment_ids"] = np.zeros((n, 512), np.int8)
        f["masked_lm_positions"] = pos
        f["masked_lm_ids"] = pos
        f["next_sentence_labels"] = np.zeros(n, np.int8)


def write_varlength(path, lengths, masked):
    with h5py.File(path, "w") as f:
        ids = f.create_dataset("input_ids", (len(lengths),), dtype=h5py.vlen_dtype(np.int16))
        pos = f.create_dataset("masked_lm_positions", (len(lengths),), dtype=h5py.vlen_dtype(np.int16))
        for i, (n, m) in enumerate(zip(lengths, masked)):
            ids[i] = np.full(n, 7, np.int16)
            pos[i] = np.arange(1, m + 1, dtype=np.int16)
        f["next_sentence_labels"] = np.zeros(len(lengths), np.int8)


@pytest.mark.parametrize("writer", [write_fixed, write_varlength])
def test_lengths_from_dir(tmp_path, writer):
    lengths = [[512, 3, 97], [1, 200]]
    masked = [[76, 1, 15], [0, 30]]
    for k, (L, m) in enumerate(zip(lengths, masked)):
        writer(tmp_path / f"part_{k:05d}_of_00002.hdf5", L, m)
    L, m = sim.lengths_from_dir(str(tmp_path))
    assert L.tolist() == [512, 3, 97, 1, 200] and m.tolist() == [76, 1, 15, 0, 30]


def test_bad_data_dir_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="not a directory"):
        sim.lengths_from_dir(str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match="no .hdf5 files"):
        sim.lengths_from_dir(str(tmp_path))
    with h5py.File(tmp_path / "x.hdf5", "w") as f:
        f["other"] = np.zeros(3)
    with pytest.raises(SystemExit, match="neither input_mask"):
        sim.lengths_from_dir(str(tmp_path))


def test_bytes_received():
    L = np.array([[300, 290], [10, 20]])
    words = L + 1
    assert sim.bytes_received("none", assign(L, "none"), words).tolist() == [0, 0]
    # all-gather: each rank receives the other rank's samples
    assert sim.bytes_received("stripe", assign(L, "stripe"), words).tolist() == [4 * 32, 4 * 592]
    plan = assign(L, "balanced")
    incoming = [[int(words[s, i]) for s, i in zip(plan.src_rank[r], plan.src_index[r]) if s != r] for r in range(2)]
    expected = [4 * (2 * (7 + 2) + sum(x)) for x in incoming]
    assert plan.moved > 0 and sim.bytes_received("balanced", plan, words).tolist() == expected


def test_cli_writes_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert (
        sim.main(["--world-sizes", "8", "16", "--batch", "12", "--steps", "2", "--json", str(out), "--png", str(png)])
        == 0
    )
    records = json.loads(out.read_text())
    assert {(r["world_size"], r["strategy"], r["group_size"]) for r in records} == {
        (w, s, None) for w in (8, 16) for s in ("none", "stripe", "balanced")
    } | {(16, "balanced", 8)}
    for r in records:
        assert {"world_size", "strategy", "imbalance", "bytes_per_rank", "assign_ms"} <= r.keys()
        assert r["imbalance"] >= 1.0
    by = {(r["world_size"], r["strategy"], r["group_size"]): r for r in records}
    assert by[(16, "balanced", None)]["imbalance"] < by[(16, "stripe", None)]["imbalance"]
    assert png.stat().st_size > 0
    assert "balanced/g8" in capsys.readouterr().out


def test_articles_are_cut_at_the_context_like_prepare_does():
    from bench.article_lengths import sequence_lengths

    # 1 token: [CLS] t [SEP]; 8190: exactly one full piece; 8191: a full piece and one token; 20000: 2 full + 3620
    assert sequence_lengths(np.array([1, 8190, 8191, 20000]), 8192).tolist() == [3, 3, 3622] + [8192] * 4
    with pytest.raises(ValueError, match="context 2"):
        sequence_lengths(np.array([5]), 2)


def test_the_shipped_wikitext2_article_lengths():
    from bench.article_lengths import load

    a = load()
    assert len(a) == 122 and a.min() >= 1 and a.max() > 8192 and 2000 < np.median(a) < 4000


def test_long_document_cli(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["--lengths", "wikitext2", "--model", "modernbert-base", "--world-sizes", "8", "64"]
    assert sim.main([*args, "--batch", "16", "--steps", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "WikiText-2 articles cut at 8192" in printed and "b_local=0.000195 window=128" in printed
    by = {(r["world_size"], r["strategy"], r["group_size"]): r for r in json.loads(out.read_text())}
    for w in (8, 64):
        assert by[(w, "balanced", None)]["imbalance"] < by[(w, "stripe", None)]["imbalance"]
        assert by[(w, "stripe", None)]["imbalance"] < by[(w, "none", None)]["imbalance"]
    assert sim.main([*args[:-1], "--batch", "4", "--steps", "1", "--cost", "1", "1e-4", "2e-4", "128"]) == 0
    assert "cost a=1 b=0.0001 b_local=0.0002 window=128" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        sim.main([*args, "--cost", "1", "1e-4", "2e-4"])
    assert e.value.code == 2 and "--cost: cost: expected (a, b) or (a, b, b_local, window)" in capsys.readouterr().err


def test_modernbert_base_cost_from_flops():
    c = sim.MODERNBERT_BASE_COST
    # 8 global and 14 local layers share 4h per key seen; the linear part is 22 (8h^2 + 6hI)
    assert c.a == 1.0 and c.window == 128 and c.b_local / c.b == pytest.approx(14 / 8)
    assert 1 / c.b == pytest.approx(22 * (8 * 768 + 6 * 1152) / (8 * 4), rel=1e-12)
