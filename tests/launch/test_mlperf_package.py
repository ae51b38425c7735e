"""launch.package, launch.system_desc and the summarizer's MLPerf scoring, judged by
mlperf_logging's own package, system-description and RCP checkers: ten tiny runs of this
trainer, and logs written here in the style of another submitter (NVIDIA's v4.0 H200 logs)."""

import json
import re

import pytest

from launch import package, summarize, system_desc
from tests.bert.train.test_trainer import dataset, run_in_process  # noqa: F401 - dataset is a fixture

pytest.importorskip("mlperf_logging")

T0 = 1_715_252_818_435  # ms, as in NVIDIA's logs
STATUS = "Available on-premise"


def nvidia_style_log(
    seed: int, samples: int, batch: int = 768, minutes: float = 5.2, division: str = "closed", status: str = "success"
) -> str:
    """A closed-division BERT log as NVIDIA's v4.0 H200 logs are written: their namespace, source
    file names, keys and numbering (one block, first_epoch_num 1; eval epoch_num = samples)."""
    lines = []

    def log(key, value=None, t=T0, event="POINT_IN_TIME", lineno=1277, **metadata):
        lines.append(
            ":::MLLOG "
            + json.dumps(
                {
                    "namespace": "",
                    "time_ms": t,
                    "event_type": event,
                    "key": key,
                    "value": value,
                    "metadata": {"file": "/workspace/bert/run_pretraining.py", "lineno": lineno, **metadata},
                }
            )
        )

    log("cache_clear", True, lineno=3)
    log("init_start", event="INTERVAL_START", lineno=1270)
    for key, value in [
        ("submission_benchmark", "bert"),
        ("submission_org", "Acme"),
        ("submission_division", division),
        ("submission_status", "onprem"),
        ("submission_platform", "1xAcme H200"),
    ]:
        log(key, value)
    log("seed", seed, lineno=1279)  # the same line in every run, as the seed checker compares
    for key, value in [
        ("global_batch_size", batch),
        ("d_batch_size", batch // 8),
        ("gradient_accumulation_steps", 1),
        ("max_predictions_per_seq", 76),
        ("opt_learning_rate_training_steps", 3680.0),
        ("num_warmup_steps", 0),
        ("opt_base_learning_rate", 0.00096),
        ("opt_lamb_epsilon", 1e-06),
        ("opt_epsilon", 1e-06),
        ("opt_lamb_beta_1", 0.60466),
        ("opt_lamb_beta_2", 0.85437),
        ("opt_lamb_weight_decay_rate", 0.1),
        ("opt_learning_rate_warmup_steps", 0),
        ("opt_lamb_learning_rate_decay_poly_power", 1.0),
        ("start_warmup_step", 0),
    ]:
        log(key, value, t=T0 + 1000)
    start = T0 + 40_000
    log("init_stop", t=start - 1, event="INTERVAL_END", lineno=1621)
    log("run_start", t=start, event="INTERVAL_START", lineno=1621)
    log("epoch_start", t=start, event="INTERVAL_START", lineno=1639, epoch_num=0)
    log("block_start", t=start, event="INTERVAL_START", lineno=1641, first_epoch_num=1, epoch_count=1)
    stop = start + round(minutes * 60_000)
    evals = [150_336 * i for i in range(1, samples // 150_336 + 1)] + [samples]
    for i, at in enumerate(evals):
        t = start + (stop - start) * (i + 1) // len(evals)
        accuracy = 0.7205 if at == samples and status == "success" else 0.70
        log("eval_start", at, t=t - 5, event="INTERVAL_START", lineno=1856, epoch_num=at)
        log("eval_stop", at, t=t - 1, event="INTERVAL_END", lineno=1862, epoch_num=at)
        log("eval_accuracy", accuracy, t=t, lineno=1866, epoch_num=at)
    log("block_stop", t=stop, event="INTERVAL_END", lineno=1985, first_epoch_num=1)
    log("epoch_stop", t=stop, event="INTERVAL_END", lineno=1988, epoch_num=samples)
    log("train_samples", samples, t=stop, lineno=1990)
    log("eval_samples", 10000, t=stop, lineno=1993)
    log("run_stop", t=stop, event="INTERVAL_END", lineno=1996, status=status)
    return "".join(line + "\n" for line in lines)


def their_system_desc(path, status=STATUS):
    desc = {name: "" for name in system_desc.FIELDS}
    desc.update(
        submitter="Acme",
        division="closed",
        status=status,
        system_name="Acme H200 (8x H200)",
        number_of_nodes="1",
        accelerators_per_node="8",
        accelerator_model_name="H200-SXM5-141GB",
        host_processor_core_count="56",
        framework="PyTorch 23.09",
        other_software_stack={"cuda_version": "12.2", "nccl_version": "2.18.5"},
    )
    path.write_text(json.dumps(desc))
    return path


def write_logs(directory, samples, seeds=None, **kw):
    directory.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(samples):
        (directory / f"result_{i}.txt").write_text(nvidia_style_log(seeds[i] if seeds else 1000 + i, n, **kw))
    return directory


# Samples to converge of ten made-up runs at batch 768 (RCP: interpolated, mean 2,443,934).
SLOWER = [2_398_552, 2_547_243, 2_401_034, 2_699_309, 2_548_073, 2_550_140, 2_548_840, 2_249_099, 2_398_630, 2_547_991]
FASTER = [
    2_350_000,
    2_340_000,
    2_400_000,
    2_330_000,
    2_360_000,
    2_300_000,
    2_450_000,
    2_320_000,
    2_380_000,
    2_390_000,
]  # olympic mean 2,358,750: faster than the RCP mean, within its speed-up


def pack(tmp_path, logs, *extra, name="pkg"):
    out = tmp_path / name
    code = package.main(
        ["--org", "Acme", "--system", "acme_h200", "--division", "closed", "--output", str(out), *extra, str(logs)]
    )
    return code, out / "Acme"


def test_another_submitters_logs_package_into_a_tree_the_checker_passes(tmp_path, capsys):
    logs = write_logs(tmp_path / "theirs", SLOWER)
    desc = their_system_desc(tmp_path / "desc.json")
    code, tree = pack(tmp_path, logs, "--system-desc", str(desc))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "package checker: PASS" in out and "RCP checker: PASS" in out and "RCP Interpolation" in out
    results = tree / "results" / "acme_h200" / "bert"
    assert sorted(p.name for p in results.iterdir()) == [f"result_{i}.txt" for i in range(10)]
    assert (results / "result_3.txt").read_text() == (logs / "result_3.txt").read_text()
    assert json.loads((tree / "systems" / "acme_h200.json").read_text())["status"] == STATUS
    impl = tree / "benchmarks" / "bert" / "implementations" / package.DEFAULT_IMPLEMENTATION
    assert (impl / "README.md").is_file() and (impl / "run_pretraining.py").is_file()
    assert not list(tmp_path.glob(".pkg.tmp*"))  # built under a temporary name, renamed

    # The same set scored: official (the checker run on it), no RCP scaling; 5.20 min each.
    summary = tmp_path / "s.json"
    assert summarize.main([str(results), "--no-cache", "--json", str(summary)]) == 0
    [s] = json.loads(summary.read_text())["directories"]
    assert s["official"] is True and s["rcp_factor"] == 1.0
    assert s["olympic_score_minutes"] == pytest.approx(5.2)


def test_a_set_faster_than_the_rcp_mean_is_scaled(tmp_path, capsys):
    logs = write_logs(tmp_path / "fast", FASTER)
    code, tree = pack(tmp_path, logs, "--system-desc", str(their_system_desc(tmp_path / "desc.json")))
    assert code == 0, capsys.readouterr().out
    kept = sorted(FASTER)[1:-1]
    factor = 2_443_934 / (sum(kept) / len(kept))
    scaling = json.loads((tree / "results" / "acme_h200" / "bert" / "scaling.json").read_text())
    assert scaling["scaling_factor"] == pytest.approx(factor, rel=1e-5)
    # The summarizer normalises as rcp_checker / result_summarizer do.
    summary = tmp_path / "s.json"
    assert summarize.main([str(logs), "--no-check", "--json", str(summary)]) == 0
    [s] = json.loads(summary.read_text())["directories"]
    assert s["rcp_factor"] == pytest.approx(factor, rel=1e-5)
    assert s["olympic_score_minutes"] == pytest.approx(5.2 * factor, rel=1e-5)
    assert s["raw_olympic_score_minutes"] == pytest.approx(5.2)
    assert s["official"] is False and "compliance checker was not run" in s["note"]


def test_repeated_seeds_fail_the_package_checker(tmp_path, capsys):
    logs = write_logs(tmp_path / "same", SLOWER, seeds=[7] * 10)
    code, _ = pack(tmp_path, logs, "--system-desc", str(their_system_desc(tmp_path / "desc.json")))
    out = capsys.readouterr().out
    assert code == 1 and "package checker: FAIL" in out and "Seed checker failed" in out
    summary = tmp_path / "s.json"
    assert summarize.main([str(logs), "--no-check", "--json", str(summary)]) == 0
    assert "seeds are not unique" in json.loads(summary.read_text())["directories"][0]["note"]


@pytest.mark.parametrize(
    "problem, message",
    [
        ("status", "status: 'onprem' is not one the 5.0.0 checker accepts"),
        ("division", "submission_division is 'open', but --division is 'closed'"),
        ("not a log", "no :::MLLOG lines"),
        ("exists", "already exists and is not empty"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, problem, message):
    logs = write_logs(tmp_path / "logs", SLOWER[:2], division="open" if problem == "division" else "closed")
    if problem == "not a log":
        (logs / "result_1.txt").write_text("hello\n")
    desc = their_system_desc(tmp_path / "desc.json", status="onprem" if problem == "status" else STATUS)
    if problem == "exists":
        (tmp_path / "pkg").mkdir()
        (tmp_path / "pkg" / "x").write_text("")
    code, _ = pack(tmp_path, logs, "--system-desc", str(desc))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


@pytest.fixture(scope="module")
def many_evals(tmp_path_factory):
    """The tiny data set with 400 eval samples (~2,000 masked tokens): even an untrained model
    gets some right, so every run reaches a tiny target and converges."""
    from tests.batches import write_dataset

    return write_dataset(str(tmp_path_factory.mktemp("data")), eval_samples=400)


@pytest.mark.slow  # ten trainings in a row
def test_ten_tiny_runs_of_this_trainer(many_evals, tmp_path, capsys):
    runs = tmp_path / "runs"
    for i in range(10):
        run_in_process(
            many_evals,
            runs / f"run_{i}",
            "train.max_steps=1",
            f"train.seed={101 + i}",
            "model.attention=padded",
            "eval.target_accuracy=0.001",
            "eval.batch_size=200",
            "log.submitter=tests",
        )
    capsys.readouterr()
    out_dir = tmp_path / "pkg"
    code = package.main(
        ["--org", "tests", "--system", "cpu", "--division", "open", "--output", str(out_dir), str(runs)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "package checker: PASS" in out
    # No reference convergence point at global batch 8: the RCP checker names it; the open
    # division needs none.
    assert re.search(r"RCP checker: PASS\n  Missing RCP, please submit RCP with BS = 8\n  RCP missing: ", out), out
    desc = json.loads((out_dir / "tests" / "systems" / "cpu.json").read_text())
    assert desc["division"] == "open" and desc["status"] in system_desc.STATUSES
    assert desc["framework"].startswith("PyTorch ") and desc["number_of_nodes"] == "1"


def test_system_desc_cli(tmp_path, capsys):
    from mlperf_logging.system_desc_checker.system_desc_checker import check_system_desc

    out = tmp_path / "box.json"
    assert (
        system_desc.main(
            ["--output", str(out), "--field", "submitter=tests", "--field", "system_name=box", "--field", "cooling=air"]
        )
        == 0
    )
    desc = json.loads(out.read_text())
    assert list(desc) == list(system_desc.FIELDS) and desc["cooling"] == "air"
    assert desc["host_processor_vcpu_count"] and desc["host_memory_capacity"].endswith("GB")
    assert desc["operating_system"] and desc["other_software_stack"].startswith("Python ")
    valid, name, _, _ = check_system_desc(str(out), "training", "5.0.0")
    assert valid and name == "box"
    assert not list(tmp_path.glob(".*tmp*"))
    capsys.readouterr()
    for bad, message in (
        (["--field", "status=onprem"], "status: 'onprem'"),
        (["--field", "nonsense=1"], "--field nonsense: not a system-description field"),
        (["--field", "novalue"], "expected key=value"),
        ([], "submitter: empty"),
    ):
        fields = ["--field", "submitter=tests", "--field", "system_name=box"] if bad else []
        assert system_desc.main(["--output", str(tmp_path / "x.json"), *fields, *bad]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err
