"""launch/summarize.py on MLPerf logs written here (a closed-division BERT log that the
official compliance checker accepts, failed runs, fewer than 10 runs, broken logs), and
launch/run_and_time.sh producing result_N.txt for it."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import summarize
from launch.summarize import RunResult, main, olympic_score
from tests.helpers import REPO, clean_env

T0 = 1_700_000_000_000  # ms; any fixed epoch time


def mllog(key, value=None, t=T0, event="POINT_IN_TIME", **metadata):
    record = {
        "namespace": "",
        "time_ms": t,
        "event_type": event,
        "key": key,
        "value": value,
        "metadata": {"file": "test", "lineno": 1, **metadata},
    }
    return ":::MLLOG " + json.dumps(record)


def bert_log(minutes, status="success", samples=2_000_000, accuracy=0.7205, seed=1, prefix="", train_samples=True):
    """Lines of a closed-division MLPerf BERT run lasting ``minutes``: every key the 5.0.0
    rules require, 4 evals with the last at ``samples``."""
    start = T0 + 60_000
    stop = start + round(minutes * 60_000)
    lines = [
        mllog(k, v)
        for k, v in [
            ("submission_benchmark", "bert"),
            ("submission_division", "closed"),
            ("submission_org", "test"),
            ("submission_platform", "cpu"),
            ("submission_status", "onprem"),
            ("cache_clear", True),
        ]
    ]
    lines.append(mllog("init_start", t=T0, event="INTERVAL_START"))
    lines += [
        mllog(k, v, t=T0 + 10)
        for k, v in [
            ("seed", seed),
            ("global_batch_size", 448),
            ("gradient_accumulation_steps", 1),
            ("opt_base_learning_rate", 4.25e-4),
            ("opt_lamb_epsilon", 1e-6),
            ("opt_learning_rate_training_steps", 6700),
            ("opt_learning_rate_warmup_steps", 0),
            ("num_warmup_steps", 0),
            ("start_warmup_step", 0),
            ("opt_lamb_beta_1", 0.9),
            ("opt_lamb_beta_2", 0.999),
            ("opt_lamb_weight_decay_rate", 0.01),
        ]
    ]
    lines.append(mllog("init_stop", t=start - 1000, event="INTERVAL_END"))
    lines.append(mllog("run_start", t=start, event="INTERVAL_START"))
    lines.append(mllog("block_start", t=start, event="INTERVAL_START", first_epoch_num=0, epoch_count=samples))
    lines.append(mllog("epoch_start", t=start, event="INTERVAL_START", epoch_num=0))
    for i in range(1, 5):
        t = start + (stop - start) * i // 4
        acc = accuracy - 0.1 * (4 - i)
        lines.append(mllog("eval_accuracy", acc, t=t, epoch_num=samples * i // 4))
    lines.append(mllog("epoch_stop", t=stop, event="INTERVAL_END", epoch_num=samples))
    lines.append(mllog("block_stop", t=stop, event="INTERVAL_END", first_epoch_num=0))
    if train_samples:
        lines.append(mllog("train_samples", samples, t=stop))
    lines.append(mllog("eval_samples", 10000, t=stop))
    lines.append(mllog("run_stop", t=stop, event="INTERVAL_END", status=status))
    return "".join(prefix + line + "\n" for line in lines)


def write_runs(directory, minutes, failed=()):
    directory.mkdir(parents=True, exist_ok=True)
    for i, m in enumerate(minutes):
        status = "aborted" if i in failed else "success"
        (directory / f"result_{i}.txt").write_text(bert_log(m, status=status, seed=i))
    return directory


def summarize_json(tmp_path, *dirs):
    out = tmp_path / "summary.json"
    assert main([str(d) for d in dirs] + ["--no-check", "--json", str(out)]) == 0
    return json.loads(out.read_text())["directories"]


def test_ten_runs_one_failed_counts_as_slowest(tmp_path, capsys):
    # run 2 aborted: it is the one dropped as slowest, 10.5 the one dropped as fastest
    minutes = [11.2, 10.5, 9.0, 13.9, 12.4, 15.1, 11.8, 14.6, 12.9, 13.3]
    d = write_runs(tmp_path / "sys", minutes, failed={2})
    [s] = summarize_json(tmp_path, d)
    kept = sorted(m for i, m in enumerate(minutes) if i != 2)[1:]
    assert s["olympic_score_minutes"] == pytest.approx(sum(kept) / 8, abs=1e-9)
    # Not official: no compliance verdicts (--no-check), and 2M samples at batch 448 converge
    # faster than the RCP allows (the raw mean is kept, unscaled).
    assert s["official"] is False
    assert "did not succeed" in s["note"] and "compliance checker was not run" in s["note"]
    assert s["rcp"].startswith("RCP check failed") and s["rcp_factor"] == 1.0
    run = s["runs"][0]
    assert run["status"] == "success" and run["samples"] == 2_000_000
    assert run["time_to_train_s"] == pytest.approx(11.2 * 60)
    assert run["samples_per_s"] == pytest.approx(2_000_000 / (11.2 * 60))
    assert s["runs"][2]["status"] == "aborted" and run["compliance"] is None
    table = capsys.readouterr().out
    assert f"olympic score: {sum(kept) / 8:.2f} min" in table
    assert re.search(r"result_2\.txt\s+aborted\s+9\.00", table)


def test_fewer_than_ten_runs_is_not_official(tmp_path):
    five, two = write_runs(tmp_path / "five", [5, 3, 4, 6, 7]), write_runs(tmp_path / "two", [5, 3])
    s5, s2 = summarize_json(tmp_path, five, two)
    assert s5["olympic_score_minutes"] == pytest.approx(5.0) and s5["official"] is False
    assert "not an official score" in s5["note"] and "10" in s5["note"]
    assert s2["olympic_score_minutes"] is None and "at least 3" in s2["note"]


def test_two_failed_runs_give_no_score():
    runs = [RunResult(Path(f"r{i}"), "aborted" if i < 2 else "success", 60.0 * (i + 1), 10) for i in range(10)]
    score, official, note, kept = olympic_score(runs)
    assert score is None and not official and "2 of 10" in note and kept == []


def test_prefixes_samples_fallback_and_file_discovery(tmp_path):
    d = tmp_path / "runs"
    for i in (0, 1):
        (d / f"run_{i}").mkdir(parents=True)
    # mpirun --tag-output style prefixes; no train_samples: the last eval's epoch_num counts
    (d / "run_0" / "mlperf.log").write_text(
        "starting\n" + bert_log(2.0, samples=1000, prefix="[1,0]<stdout>: ", train_samples=False)
    )
    (d / "run_1" / "mlperf.log").write_text(bert_log(3.0, samples=3000))
    [s] = summarize_json(tmp_path, d)
    assert [r["samples"] for r in s["runs"]] == [1000, 3000]
    assert [Path(r["file"]).parent.name for r in s["runs"]] == ["run_0", "run_1"]
    # result_*.txt take precedence, in numeric order
    write_runs(d, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    [s] = summarize_json(tmp_path, d)
    assert [Path(r["file"]).name for r in s["runs"]][-3:] == ["result_8.txt", "result_9.txt", "result_10.txt"]


@pytest.mark.parametrize(
    "content, where, message",
    [
        (None, "", "no such directory"),
        ("", "", "no result_*.txt"),
        ("x\n" + mllog("run_start") + '\n:::MLLOG {"key": oops}\n', ":3", "cannot parse"),
        (':::MLLOG {"time_ms": 1}\n', ":1", "no 'key'"),
        (mllog("run_start", t="soon") + "\n", ":1", "time_ms"),
        (mllog("init_start") + "\n", "", "no run_start"),
        (mllog("run_start") + "\n", "", "no run_stop"),
        (mllog("run_start") + "\n" + mllog("run_stop") + "\n", ":2", "status"),
        ("just text\n", "", "no :::MLLOG lines"),
    ],
)
def test_bad_input_is_one_line_naming_the_file(tmp_path, capsys, content, where, message):
    d = tmp_path / "d"
    if content is not None:
        d.mkdir()
        if content:
            (d / "result_0.txt").write_text(content)
    assert main([str(d), "--no-check"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err
    name = str(d / "result_0.txt") if content else str(d)
    assert f"{name}{where}" in err


def test_compliance_checker_verdicts_and_cache(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlperf_logging")
    d = tmp_path / "sys"
    d.mkdir()
    (d / "result_0.txt").write_text(bert_log(4.0, accuracy=0.7213))
    (d / "result_1.txt").write_text(bert_log(5.0, status="aborted", accuracy=0.70))
    cache = tmp_path / "cache.json"
    out = tmp_path / "s.json"
    assert main([str(d), "--cache", str(cache), "--json", str(out), "--jobs", "2"]) == 0
    runs = json.loads(out.read_text())["directories"][0]["runs"]
    assert runs[0]["compliance"] == "pass"
    assert runs[1]["compliance"].startswith("fail:") and "eval_accuracy" in runs[1]["compliance"]
    assert len(json.loads(cache.read_text())) == 2
    assert list(tmp_path.glob("**/compliance_checker.log")) == []  # nothing left behind

    # The second time the verdicts come from the cache: the checker must not run.
    def no_checker(path, ruleset):
        raise AssertionError("the checker ran despite the cache")

    monkeypatch.setattr(summarize, "run_compliance_checker", no_checker)
    capsys.readouterr()
    assert main([str(d), "--cache", str(cache)]) == 0
    table = capsys.readouterr().out
    assert re.search(r"result_0\.txt .* pass$", table, re.M)
    assert re.search(r"result_1\.txt .* fail: .*eval_accuracy", table, re.M)


def test_cli_writes_json_and_png(tmp_path):
    a = write_runs(tmp_path / "a", [3, 4, 5, 6])
    b = write_runs(tmp_path / "b", [1, 2, 3], failed={0})
    png, js = tmp_path / "s.png", tmp_path / "s.json"
    proc = subprocess.run(
        [sys.executable, "-m", "launch.summarize", str(a), str(b), "--no-check", "--png", str(png), "--json", str(js)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    scores = [s["olympic_score_minutes"] for s in json.loads(js.read_text())["directories"]]
    assert scores == [pytest.approx(4.5), pytest.approx(3.0)]
    assert "olympic time to train" in proc.stdout and "(not official)" in proc.stdout
    assert not list(tmp_path.glob(".*tmp*"))


# --- launch/run_and_time.sh ----------------------------------------------------------------

# Stands in for run_pretraining.py: writes a short MLPerf log with the seed it was given.
FAKE_TRAINER = """
import argparse, json, os, sys
p = argparse.ArgumentParser()
p.add_argument("--config", required=True)
p.add_argument("--output-dir", required=True)
p.add_argument("overrides", nargs="*")
a = p.parse_args()
print("trained with", a.config, " ".join(a.overrides), "world", os.environ.get("WORLD_SIZE", "1"))
if os.environ.get("RANK", "0") != "0":
    sys.exit(0)
seed = 42
for o in a.overrides:
    if o.startswith("train.seed="):
        value = o.split("=", 1)[1]
        # null: the real trainer draws a seed from the OS
        seed = int(value) if value != "null" else 1000 + int.from_bytes(os.urandom(2), "big")
os.makedirs(a.output_dir, exist_ok=True)
def line(key, value=None, **metadata):
    return ":::MLLOG " + json.dumps({"namespace": "", "time_ms": 1000, "event_type": "POINT_IN_TIME",
                                     "key": key, "value": value, "metadata": metadata}) + "\\n"
with open(os.path.join(a.output_dir, "mlperf.log"), "w") as f:
    f.write(line("seed", seed) + line("run_start") + line("train_samples", 64)
            + line("run_stop", status="success"))
"""


def run_and_time(tmp_path, args=(), **env):
    trainer = tmp_path / "trainer.py"
    trainer.write_text(FAKE_TRAINER)
    full_env = {k: v for k, v in clean_env().items() if k not in ("SEED", "RUN_INDEX")}
    full_env.update(
        CONFIG="launch/configs/cpu_demo.yaml",
        TRAIN_SCRIPT=str(trainer),
        PYTHON=sys.executable,
        CLEAR_CACHES="0",
        OUTPUT_DIR=str(tmp_path / "res"),
        **env,
    )
    return subprocess.run(
        ["bash", "launch/run_and_time.sh", *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=120
    )


def test_run_and_time_writes_result_files_and_result_lines(tmp_path):
    first = run_and_time(tmp_path, ["optim.lr=1e-3"], SEED="123")
    second = run_and_time(tmp_path)
    for proc in (first, second):
        assert proc.returncode == 0, proc.stderr
    res = tmp_path / "res"
    assert (res / "result_0.txt").read_text() == (res / "run_0" / "mlperf.log").read_text()
    assert (res / "result_1.txt").is_file()
    assert "optim.lr=1e-3 train.seed=123" in first.stdout or "train.seed=123 optim.lr=1e-3" in first.stdout
    pattern = r"^RESULT,bert,{},\d+,[^,]+,\d{{4}}-\d\d-\d\d .+$"
    assert re.search(pattern.format(123), first.stdout, re.M)
    # Without SEED the trainer drew one (train.seed=null); the RESULT line reads it back from the log.
    assert "train.seed=null" in second.stdout
    drawn = re.search(r'"key": "seed", "value": (\d+)', (res / "result_1.txt").read_text()).group(1)
    assert int(drawn) >= 1000 and re.search(pattern.format(drawn), second.stdout, re.M)
    [s] = summarize_json(tmp_path, res)
    assert [r["samples"] for r in s["runs"]] == [64, 64] and "2 run(s)" in s["note"]


def test_run_and_time_needs_run_index_with_several_ranks(tmp_path):
    proc = run_and_time(tmp_path, WORLD_SIZE="2", RANK="1")
    assert proc.returncode == 2 and "RUN_INDEX" in proc.stderr
    proc = run_and_time(tmp_path, RUN_INDEX="x")
    assert proc.returncode == 2 and "RUN_INDEX" in proc.stderr


@pytest.mark.slow
def test_run_and_time_starts_ranks_itself_with_nproc_per_node(tmp_path):
    proc = run_and_time(tmp_path, NPROC_PER_NODE="2", RUN_INDEX="3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("world 2") == 2
    assert (tmp_path / "res" / "result_3.txt").is_file()
    assert len(re.findall(r"^RESULT,bert,\d+,", proc.stdout, re.M)) == 1
