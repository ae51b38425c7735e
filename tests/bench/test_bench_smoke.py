"""The ablation and throughput benchmarks run end to end on tiny synthetic data (1-2 steps),
so they cannot rot; their numbers are not checked here (benchmarks are not timed tests)."""

import json

import pytest

from bench import ablation, throughput
from tests.batches import write_dataset

TINY = ["model.preset=tiny", "model.vocab_size=96", "data.max_seq_length=64", "train.global_batch_size=8",
        "eval.batch_size=16", "optim.warmup_steps=1"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_dataset(str(root), num_files=2, per_file=24, eval_samples=16)
    return root


@pytest.mark.slow  # a benchmark end to end
def test_ablation_runs_four_variants(data_dir, tmp_path, capsys):
    out = tmp_path / "abl"
    code = ablation.main(["--data", str(data_dir), "--out", str(out), "--steps", "2", "--evals", "1",
                          "--eval-samples", "16", "--spikes", "--spike-steps", "2", "--adagc-warmup-steps", "1", "--threads", "1",
                          *TINY])
    printed = capsys.readouterr().out
    assert code == 0
    result = json.loads((out / "ablation.json").read_text())
    assert [r["run"] for r in result["table"]] == list(ablation.RUNS)
    for name in ablation.RUNS:
        run = result["runs"][name]
        assert run["summary"]["steps"] == 2 and run["train"]["step"] == [1, 2]
        assert run["eval"]["accuracy"], name
        assert f"| {name} |" in printed
        overrides = result["setup"]["overrides"][name]
        assert ("optim.clip=adagc" in overrides) == ("adagc" in name)
        assert any(o.startswith("loss.simreg_weight=") for o in overrides) == ("simreg" in name)
        assert "debug.spike_steps=[2]" in overrides
    assert result["table"][0]["delta_accuracy"] == 0.0
    assert (out / "ablation.png").stat().st_size > 1000


def test_ablation_bad_data_is_one_line(tmp_path, capsys):
    assert ablation.main(["--data", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --data:")


@pytest.mark.slow  # a benchmark end to end
def test_throughput_runs_every_cpu_variant(data_dir, tmp_path, capsys):
    out = tmp_path / "tp.json"
    code = throughput.main(["--data", str(data_dir), "--model", "tiny", "--vocab-size", "96", "--batch-size", "4",
                            "--batches", "1", "--rounds", "1", "--warmup-rounds", "0", "--threads", "1", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    for name in ("transformers", "padded", "unpadded/reference"):
        assert rows[name]["seq_per_s"] > 0 and rows[name]["skipped"] is None
        # The same weights and batch give the same loss (checked by the benchmark, re-checked here).
        assert rows[name]["check_loss"] == pytest.approx(rows["transformers"]["check_loss"], rel=1e-4)
    assert rows["transformers"]["vs_transformers"] == 1.0
    # Listed by default; without a GPU (or Triton's interpreter) it is reported, not timed.
    flashmask = rows["packed/flashmask"]
    assert flashmask.get("seq_per_s", 0) > 0 or flashmask["skipped"]
    assert result["padding_limit"] > 1.0
    assert set(result["goals"]) == {"unpadded_vs_padded", "unpadded_vs_transformers"}
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "padding limit" in capsys.readouterr().out


def test_throughput_packed_and_padded_attention_without_transformers(data_dir, tmp_path):
    out = tmp_path / "tp.json"
    code = throughput.main(["--data", str(data_dir), "--model", "tiny", "--vocab-size", "96", "--batch-size", "4",
                            "--batches", "1", "--rounds", "1", "--warmup-rounds", "0", "--threads", "1", "--json", str(out),
                            "--variants", "unpadded/padded", "packed/reference"])
    assert code == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"unpadded/padded", "packed/reference"}
    assert rows["packed/reference"]["check_loss"] == pytest.approx(rows["unpadded/padded"]["check_loss"], rel=1e-4)
    assert all(r["seq_per_s"] > 0 and r["vs_transformers"] is None for r in rows.values())


def test_throughput_asked_for_backend_that_cannot_run_is_an_error(data_dir, tmp_path, capsys):
    code = throughput.main(["--data", str(data_dir), "--model", "tiny", "--vocab-size", "96",
                            "--variants", "unpadded/no_such_backend", "--json", str(tmp_path / "x.json")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unpadded/no_such_backend" in err[0]
