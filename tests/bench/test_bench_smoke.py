"""The ablation and throughput benchmarks run end to end on tiny synthetic data (1-2 steps),
so they cannot rot; their numbers are not checked here (benchmarks are not timed tests)."""

import json

import pytest

from bench import ablation, throughput
from tests.batches import write_dataset

TINY = [
    "model.preset=tiny",
    "model.overrides.vocab_size=96",
    "data.max_seq_length=64",
    "train.global_batch_size=8",
    "eval.batch_size=16",
    "optim.warmup_steps=1",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_dataset(str(root), num_files=2, per_file=24, eval_samples=16)
    return root


@pytest.mark.slow  # a benchmark end to end
def test_ablation_runs_four_variants_over_seeds(data_dir, tmp_path, capsys):
    out = tmp_path / "abl"
    code = ablation.main(
        [
            "--data",
            str(data_dir),
            "--out",
            str(out),
            "--steps",
            "2",
            "--evals",
            "2",
            "--eval-samples",
            "16",
            "--spikes",
            "--spike-steps",
            "2",
            "--adagc-warmup-steps",
            "1",
            "--threads",
            "1",
            "--seeds",
            "2",
            "--arm",
            "lowlr optim.lr=1e-4",
            *TINY,
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    result = json.loads((out / "ablation.json").read_text())
    names = [*ablation.RUNS, "lowlr"]
    assert [r["arm"] for r in result["table"]] == names
    seeds = result["setup"]["seeds"]
    assert len(seeds) == 2 and seeds[1] == seeds[0] + 1
    for name in names:
        runs = result["arms"][name]
        assert len(runs) == 2
        for run in runs:
            assert run["summary"]["steps"] == 2 and run["train"]["step"] == [1, 2]
            assert len(run["eval"]["accuracy"]) == 2, name
        assert f"| {name} | 2 |" in printed
        overrides = result["setup"]["overrides"][name]
        assert ("optim.clip=adagc" in overrides) == ("adagc" in name)
        assert any(o.startswith("loss.simreg_weight=") for o in overrides) == ("simreg" in name)
        assert "debug.spike_steps=[2]" in overrides
        assert ("optim.lr=1e-4" in overrides) == (name == "lowlr")
        # The two seeds are different runs (different data order and weights).
        assert runs[0]["train"]["loss"] != runs[1]["train"]["loss"]
    row = result["table"][0]
    accs = [r["summary"]["eval_accuracy"] for r in result["arms"]["baseline"]]
    assert row["eval_accuracy"]["mean"] == pytest.approx(sum(accs) / 2)
    assert row["eval_accuracy"]["std"] == pytest.approx(abs(accs[0] - accs[1]) / 2**0.5)
    assert result["setup"]["target_accuracy"] == pytest.approx(0.9 * sum(accs) / 2)
    assert row["samples_to_target_vs_base"] == 1.0
    assert (out / "baseline" / f"seed{seeds[1]}" / "summary.json").is_file()
    assert (out / "ablation.png").stat().st_size > 1000

    # --compare on the finished runs gives the same statistics for the same target.
    cmp_out = tmp_path / "cmp"
    assert (
        ablation.main(
            [
                "--compare",
                f"base={out / 'baseline'}",
                str(out / "simreg"),
                "--out",
                str(cmp_out),
                "--target-accuracy",
                str(result["setup"]["target_accuracy"]),
            ]
        )
        == 0
    )
    compared = json.loads((cmp_out / "ablation.json").read_text())
    assert [r["arm"] for r in compared["table"]] == ["base", "simreg"]
    for key in ("eval_accuracy", "final_mlm_loss", "samples_to_target", "loss_spike_score"):
        assert compared["table"][0][key] == pytest.approx(result["table"][0][key])
        assert compared["table"][1][key] == pytest.approx(result["table"][2][key])
    assert (cmp_out / "ablation.png").stat().st_size > 1000


@pytest.mark.multiprocess
@pytest.mark.slow  # four tiny runs, two of them in spawned workers
def test_ablation_jobs_run_in_workers_and_match_one_after_another(data_dir, tmp_path, capsys):
    def run(jobs):
        out = tmp_path / f"jobs{jobs}"
        args = ["--data", str(data_dir), "--out", str(out), "--steps", "2", "--evals", "1", "--eval-samples", "16"]
        args += ["--runs", "baseline,simreg", "--threads", "1", "--jobs", str(jobs), *TINY]
        assert ablation.main(args) == 0
        return json.loads((out / "ablation.json").read_text())

    one, two = run(1), run(2)
    assert "2 job(s) x 1 thread(s)" in capsys.readouterr().out
    for name in ("baseline", "simreg"):
        # Same seed, one thread each: a run in a worker process is the run in this one, bit for bit.
        assert two["arms"][name][0]["train"]["loss"] == one["arms"][name][0]["train"]["loss"]
        assert two["arms"][name][0]["eval"] == one["arms"][name][0]["eval"]
    assert one["arms"]["baseline"][0]["train"]["loss"] != one["arms"]["simreg"][0]["train"]["loss"]


@pytest.mark.multiprocess
@pytest.mark.slow  # spawned workers
def test_ablation_a_failed_run_in_a_worker_is_one_line(data_dir, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    args = ["--data", str(data_dir), "--out", str(tmp_path / "out"), "--steps", "2", "--evals", "1"]
    args += ["--eval-samples", "16", "--runs", "baseline", "--arm", f"bad data.train_dir={empty}", "--jobs", "2", *TINY]
    assert ablation.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: run bad/seed42 failed (exit 2): ") and str(empty) in err[0]


def test_samples_to_target_interpolates_between_evals():
    evals = {"samples": [100, 200, 300], "accuracy": [0.1, 0.3, 0.5]}
    assert ablation.samples_to_target(evals, 0.05) == 100
    assert ablation.samples_to_target(evals, 0.4) == pytest.approx(250)
    assert ablation.samples_to_target(evals, 0.6) is None


def test_compare_bad_dir_is_one_line(tmp_path, capsys):
    assert ablation.main(["--compare", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --compare:")


def test_ablation_bad_data_is_one_line(tmp_path, capsys):
    assert ablation.main(["--data", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --data:")


def tiny_throughput_args(data_dir, out) -> list[str]:
    """bench.throughput on the tiny model, one batch, one round, no warm-up, one thread."""
    return [
        "--data",
        str(data_dir),
        "--model",
        "tiny",
        "--vocab-size",
        "96",
        "--batch-size",
        "4",
        "--batches",
        "1",
        "--rounds",
        "1",
        "--warmup-rounds",
        "0",
        "--threads",
        "1",
        "--json",
        str(out),
    ]


@pytest.mark.slow  # a benchmark end to end
def test_throughput_runs_every_cpu_variant(data_dir, tmp_path, capsys):
    out = tmp_path / "tp.json"
    code = throughput.main(
        [
            *tiny_throughput_args(data_dir, out),
        ]
    )
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
    code = throughput.main(
        [
            *tiny_throughput_args(data_dir, out),
            "--variants",
            "unpadded/padded",
            "packed/reference",
        ]
    )
    assert code == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"unpadded/padded", "packed/reference"}
    assert rows["packed/reference"]["check_loss"] == pytest.approx(rows["unpadded/padded"]["check_loss"], rel=1e-4)
    assert all(r["seq_per_s"] > 0 and r["vs_transformers"] is None for r in rows.values())


def test_throughput_asked_for_backend_that_cannot_run_is_an_error(data_dir, tmp_path, capsys):
    code = throughput.main(
        [
            "--data",
            str(data_dir),
            "--model",
            "tiny",
            "--vocab-size",
            "96",
            "--variants",
            "unpadded/no_such_backend",
            "--json",
            str(tmp_path / "x.json"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unpadded/no_such_backend" in err[0]


def test_throughput_against_modernbert(data_dir, tmp_path):
    """A ModernBERT preset is measured against transformers' ModernBertForMaskedLM, from the
    same weights (the benchmark checks the first batch's loss)."""
    out = tmp_path / "tp.json"
    args = tiny_throughput_args(data_dir, out)
    args[args.index("tiny")] = "modernbert_tiny"
    code = throughput.main([*args, "--variants", "transformers", "unpadded/padded", "packed/reference"])
    assert code == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    for name in ("unpadded/padded", "packed/reference"):
        assert rows[name]["check_loss"] == pytest.approx(rows["transformers"]["check_loss"], rel=1e-4)
        assert rows[name]["seq_per_s"] > 0


def test_throughput_on_wikitext2_article_lengths_with_windows(tmp_path):
    """--lengths wikitext2: batches of the shipped article lengths cut at --context (no --data),
    --layers keeps the first layers and their types; the sdpa backend's windowed loss is
    transformers'."""
    out = tmp_path / "tp.json"
    args = tiny_throughput_args("unused", out)[2:]
    args[args.index("tiny")] = "modernbert_tiny"
    code = throughput.main(
        [
            *args,
            "--lengths",
            "wikitext2",
            "--context",
            "80",
            "--layers",
            "2",
            "--variants",
            "transformers",
            "unpadded/sdpa",
        ]
    )
    assert code == 0
    res = json.loads(out.read_text())
    assert res["setup"]["model"]["layer_types"] == ["global", "local"]
    assert res["setup"]["seq_len"] == 80 and 4 * 3 <= res["real_tokens"] <= 4 * 80
    rows = {r["variant"]: r for r in res["rows"]}
    assert rows["unpadded/sdpa"]["check_loss"] == pytest.approx(rows["transformers"]["check_loss"], rel=1e-4)


@pytest.mark.multiprocess
@pytest.mark.slow  # two benchmark processes
def test_compare_revisions_runs_both_trees_and_reports_each_variants_ratio(data_dir, tmp_path, capsys):
    from bench import compare_revisions

    out = tmp_path / "ratios.json"
    passthrough = tiny_throughput_args(data_dir, tmp_path / "unused.json")[2:-2]  # no --data, no --json
    code = compare_revisions.main(
        [
            "--data",
            str(data_dir),
            "--base-tree",
            str(compare_revisions.REPO),
            "--pairs",
            "1",
            "--json",
            str(out),
            "--",
            *passthrough,
            "--variants",
            "unpadded/reference",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result) == {"unpadded/reference"}
    r = result["unpadded/reference"]
    assert len(r["ratios"]) == 1 and r["ratio_median"] > 0
    assert "(new first)" in printed


def test_compare_revisions_alternates_which_tree_goes_first(monkeypatch, tmp_path):
    """The pairs' order (the real runs are the test above): new first, then base first, and so
    on; each pair's ratio is new over base, whichever ran first."""
    from pathlib import Path

    from bench import compare_revisions

    calls = []
    rates = iter([4.0, 2.0, 3.0, 6.0, 8.0, 2.0])  # per run in call order: new, base, base, new, new, base

    def fake_run(tree, args, out):
        calls.append(tree.name)
        return {"v": next(rates)}

    monkeypatch.setattr(compare_revisions, "run_tree", fake_run)
    lines = []
    got = compare_revisions.compare(Path("new"), Path("base"), 3, [], log=lines.append)
    assert calls == ["new", "base", "base", "new", "new", "base"]
    assert got["v"]["ratios"] == [2.0, 2.0, 4.0] and got["v"]["ratio_median"] == 2.0
    assert ["(new first)" in line for line in lines] == [True, False, True]


def test_interleave_alternates_start_and_round_order_and_takes_each_pairs_median(tmp_path):
    """--interleave: pair 1 starts new then base and its rounds run new, base / base, new / ...;
    pair 2 starts base first; a round's ratio is base seconds / new seconds, a pair's the median."""
    from pathlib import Path

    from bench import compare_revisions

    events = []
    seconds = {"new": iter([1.0, 1.0, 2.0, 1.0, 1.0, 1.0]), "base": iter([2.0, 3.0, 2.0, 1.0, 2.0, 4.0])}

    class FakeWorker:
        def __init__(self, tree, args, log_dir, label):
            self.label, self.sequences = tree.name, 8
            events.append(f"start {self.label}")

        def round(self):
            events.append(self.label)
            return {"v": next(seconds[self.label])}

        def close(self):
            events.append(f"close {self.label}")

    lines = []
    got = compare_revisions.interleave(Path("new"), Path("base"), 2, [], 3, log=lines.append, start=FakeWorker)
    assert events == [
        "start new", "start base", "new", "base", "base", "new", "new", "base", "close new", "close base",
        "start base", "start new", "base", "new", "new", "base", "base", "new", "close base", "close new",
    ]  # fmt: skip
    # pair 1: rounds 2/1, 3/1, 2/2 -> median 2; pair 2: rounds 1/1, 2/1, 4/1 -> median 2
    assert got["v"]["ratios"] == [2.0, 2.0] and got["v"]["ratio_median"] == 2.0
    assert got["v"]["new_seq_per_s_median"] == 8.0 and got["v"]["base_seq_per_s_median"] == 4.0
    assert ["(new first" in line for line in lines] == [True, False]


def test_an_interleave_worker_times_one_round_of_its_tree_per_command(data_dir, tmp_path):
    """The worker's side, in this process: the tree's own variants built and checked, one
    ready line (this tree, the round's sequences), then one reply a command, until EOF."""
    import io

    from bench import compare_revisions

    replies = io.StringIO()
    args = tiny_throughput_args(data_dir, tmp_path / "unused.json") + ["--variants", "unpadded/reference"]
    assert compare_revisions.worker(args, commands=io.StringIO("round\nround\n"), replies=replies) == 0
    lines = [json.loads(line) for line in replies.getvalue().splitlines()]
    assert lines[0] == {"ready": str(compare_revisions.REPO), "sequences": 4}
    assert len(lines) == 3 and all(set(line["seconds"]) == {"unpadded/reference"} for line in lines[1:])
    assert all(line["seconds"]["unpadded/reference"] > 0 for line in lines[1:])
    assert not (tmp_path / "unused.json").exists()  # the tree's report is never reached


@pytest.mark.multiprocess
@pytest.mark.slow  # two pairs of benchmark processes
def test_interleave_runs_both_trees_and_refuses_a_worker_that_imported_another_tree(data_dir, tmp_path, capsys):
    from bench import compare_revisions

    passthrough = tiny_throughput_args(data_dir, tmp_path / "unused.json")[2:-2]
    common = ["--data", str(data_dir), "--pairs", "1", "--interleave", "2"]
    out = tmp_path / "ratios.json"
    tail = ["--", *passthrough, "--variants", "unpadded/reference"]
    code = compare_revisions.main([*common, "--base-tree", str(compare_revisions.REPO), "--json", str(out), *tail])
    assert code == 0 and "median of 1 pairs of processes, 2 rounds each" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["unpadded/reference"]["ratios"]) == 1
    # A "tree" without bench/: its worker imports this checkout's (the editable install) instead.
    not_a_tree = tmp_path / "empty"
    not_a_tree.mkdir()
    assert compare_revisions.main([*common, "--base-tree", str(not_a_tree), *tail]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {not_a_tree}: its worker imported bench/throughput.py from")


def test_compare_revisions_names_a_base_git_cannot_check_out(data_dir, capsys):
    from bench import compare_revisions

    code = compare_revisions.main(["--data", str(data_dir), "--base", "no-such-revision-xyz", "--pairs", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: --base no-such-revision-xyz:")
