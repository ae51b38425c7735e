"""The kernel benchmarks run on CPU (correctness mode) and read lengths from prepared data."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import json  # noqa: E402

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from bench import attention as bench_attention  # noqa: E402
from bench import train_step as bench_train_step  # noqa: E402
from bench.lengths import LengthSampler, LengthsError, builtin_lengths, data_dir_lengths  # noqa: E402


def test_builtin_distribution_is_mlperf_like():
    lengths = builtin_lengths(np.random.default_rng(0), 50_000)
    assert 1 <= lengths.min() and lengths.max() == 512
    assert 230 < lengths.mean() < 270
    assert 0.18 < (lengths == 512).mean() < 0.26


def test_lengths_from_fixed_and_varlength_shards(tmp_path):
    mask = np.zeros((3, 512), np.int8)
    for i, n in enumerate([5, 512, 77]):
        mask[i, :n] = 1
    with h5py.File(tmp_path / "part_00000_of_00002.hdf5", "w") as f:
        f["input_mask"] = mask
    with h5py.File(tmp_path / "part_00001_of_00002.hdf5", "w") as f:
        ds = f.create_dataset("input_ids", (2,), dtype=h5py.vlen_dtype(np.int16))
        ds[0] = np.arange(1, 10, dtype=np.int16)
        ds[1] = np.arange(1, 301, dtype=np.int16)
    assert data_dir_lengths(str(tmp_path)).tolist() == [5, 512, 77, 9, 300]
    sampler = LengthSampler(str(tmp_path), seed=1)
    assert set(sampler.batch(20)) <= {5, 512, 77, 9, 300}

    with h5py.File(tmp_path / "part_00002_of_00003.hdf5", "w") as f:
        f["segment_ids"] = mask
    with pytest.raises(LengthsError, match="part_00002_of_00003.hdf5: neither 'input_mask' nor 'input_ids'"):
        data_dir_lengths(str(tmp_path))
    with pytest.raises(LengthsError, match="no \\*.hdf5 files"):
        data_dir_lengths(str(tmp_path / "missing"))


def test_attention_bench_checks_correctness_on_cpu(tmp_path):
    out = tmp_path / "attention.json"
    assert bench_attention.main(["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    for name in ("padded", "triton", "triton_grouped"):
        assert report["results"][name]["status"] == "ok"
        assert report["results"][name]["max_diff_vs_reference"] < 1e-4
    assert bench_attention.main(["--data-dir", str(tmp_path / "missing")]) == 2


@pytest.mark.slow  # a benchmark end to end
def test_train_step_bench_smoke_runs_on_cpu(tmp_path):
    out = tmp_path / "train.json"
    assert bench_train_step.main(["--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert all(r["status"] == "ok" and r["seqs_per_s"] > 0 for r in results.values())
    assert set(results) == {"padded", "unpadded:reference", "packed:reference"}


def test_model_flops_count_real_tokens_only():
    from bert.model.config import BertConfig
    from tests.batches import random_batch

    config = BertConfig.preset("large")
    batch = random_batch([100, 28], config.vocab_size, seed=0)
    h, i, n = 1024, 4096, 128
    encoder = 24 * (2 * (4 * h * h + 2 * h * i) * n + 4 * h * (100**2 + 28**2))
    head = 2 * (h * h + h * config.vocab_size) * batch.mlm_positions.numel()
    assert bench_train_step.model_flops(config, batch) == 3.0 * (encoder + head)


def test_packed_variant_holds_the_same_sequences():
    from tests.batches import random_batch

    batch = random_batch([300, 200, 100, 400], 512, seed=1)
    packed = bench_train_step.to_packed(batch)
    assert packed.seq_lens.tolist() == [300, 200, 100, 400]
    flat = packed.input_ids.flatten()
    for b, start in enumerate(packed.cls_positions.tolist()):
        lo, hi = batch.cu_seqlens[b].item(), batch.cu_seqlens[b + 1].item()
        assert torch.equal(flat[start : start + hi - lo], batch.input_ids[lo:hi])
    assert torch.equal(packed.mlm_labels, batch.mlm_labels)
    assert torch.equal(flat[packed.mlm_positions], batch.input_ids[batch.mlm_positions])  # same masked tokens


def test_a_named_backend_that_cannot_run_fails_the_benchmark(monkeypatch, capsys):
    """Asked for by name (as bench/gpu_check.sh asks for triton), a backend that cannot run here
    fails the run; listed with --optional, or not named at all, it is only reported."""
    from kernels import registry
    from kernels.interface import BackendUnavailable

    real = registry.get_backend

    def get_backend(name, **options):
        if name == "triton":
            raise BackendUnavailable("model.attention=triton: no CUDA GPU here (this test)")
        return real(name, **options)

    monkeypatch.setattr(registry, "get_backend", get_backend)
    assert bench_attention.main(["--backends", "padded,triton"]) == 1
    assert "failed: triton" in capsys.readouterr().err
    assert bench_attention.main(["--backends", "padded", "--optional", "triton"]) == 0


def test_window_tile_work_is_the_band_ideal_for_the_tile_shape():
    """The kernels' own tile counts with a window: exactly the tiles that hold a band pair."""
    tiles = bench_attention.window_tiles(128, [512], torch.bfloat16, 64, torch.device("cpu"))["512"]
    for name in ("fwd", "dkdv", "dq"):
        assert tiles[name]["computed"] == pytest.approx(tiles[name]["ideal"]), name
    assert tiles["fwd"]["tiles"] == [128, 64] and tiles["fwd"]["computed"] == 14 / 32  # 3 + 4 + 4 + 3 of 4 x 8
    assert tiles["band_density"] == pytest.approx((512 * 129 - 64 * 65) / 512**2)
