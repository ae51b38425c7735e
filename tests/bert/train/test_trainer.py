"""The trainer end to end on a tiny synthetic dataset (CPU, fp32)."""

import inspect
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from bert.config import load_config
from bert.train.build import build_eval_loader
from bert.train.trainer import Trainer
from kernels import registry
from kernels.interface import VarlenLayout
from kernels.reference import reference_attention
from launch.distributed import init_distributed
from tests.batches import write_dataset
from tests.helpers import REPO, compliance_check

ROOT = str(REPO)
TINY = [
    "model.preset=tiny",
    "model.overrides.vocab_size=96",
    "model.overrides.hidden_dropout_prob=0",
    "model.overrides.attention_probs_dropout_prob=0",
    "data.max_seq_length=64",
    "train.global_batch_size=8",
    "train.device=cpu",
    "train.log_interval_steps=1",
    "eval.interval_samples=32",
    "eval.batch_size=16",
    "optim.lr=1e-3",
    "optim.warmup_steps=2",
    "log.plot=false",
    "train.seed=42",
]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("data")))


def overrides(dataset, *extra):
    train, eval_file = dataset
    return TINY + [f"data.train_dir={train}", f"data.eval_file={eval_file}", *extra]


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def run_in_process(dataset, out_dir, *extra, stop_after=None):
    cfg = load_config(None, overrides(dataset, *extra))
    trainer = Trainer(cfg, str(out_dir), init_distributed(backend="gloo"))
    if stop_after is not None:
        step = trainer.train_step

        def train_step(block):
            if trainer.state.step == stop_after:
                trainer.stop_requested = True  # what the SIGTERM handler does
            return step(block)

        trainer.train_step = train_step
    return trainer.train()


def test_run_writes_every_output(dataset, tmp_path):
    summary = run_in_process(dataset, tmp_path, "train.max_steps=6", "log.plot=true")
    assert summary["status"] == "aborted" and summary["steps"] == 6 and summary["samples"] == 48
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for key in ("samples", "loss", "lr", "seq_per_s", "tokens_per_s"):
        assert key in steps[0]
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["samples"] for r in evals] == [32, 48]  # at the interval and at the end
    saved = json.load(open(tmp_path / "summary.json"))
    for key in ("status", "samples", "train_seconds", "seq_per_s", "tokens_per_s", "eval_accuracy", "time_to_train_s"):
        assert key in saved
    assert (tmp_path / "curves.png").stat().st_size > 1000
    status, _, output = compliance_check(tmp_path / "mlperf.log")
    assert status == 0, output


@pytest.mark.slow  # three training runs
@pytest.mark.parametrize("flat", [False, True])
def test_flat_host_memory_fixes_the_mmap_threshold_only_when_asked(dataset, tmp_path, monkeypatch, flat):
    # The threshold is process-wide and costs CPU throughput (docs/reliability.md): off by default.
    import bert.train.trainer

    calls = []
    monkeypatch.setattr(bert.train.trainer, "map_large_allocations", lambda: calls.append(1))
    assert load_config(None, overrides(dataset)).train.flat_host_memory is False
    cfg = load_config(None, overrides(dataset, f"train.flat_host_memory={str(flat).lower()}"))
    Trainer(cfg, str(tmp_path), init_distributed(backend="gloo"))
    assert calls == ([1] if flat else [])


def test_the_mlperf_log_names_the_optimizer_that_runs(dataset, tmp_path):
    run_in_process(dataset, tmp_path, "train.max_steps=1", "optim.name=adamw", "eval.max_samples=8")
    lines = [json.loads(line.split(" ", 1)[1]) for line in open(tmp_path / "mlperf.log")]
    logged = {e["key"]: e["value"] for e in lines}
    assert logged["opt_name"] == "adamw" and logged["opt_adamw_weight_decay"] == 0.01
    assert not [k for k in logged if k.startswith("opt_lamb_")]


def test_eval_at_start_scores_the_initial_weights_and_changes_nothing(dataset, tmp_path):
    run_in_process(dataset, tmp_path / "plain", "train.max_steps=2")
    run_in_process(dataset, tmp_path / "at_start", "train.max_steps=2", "eval.at_start=true")
    assert losses(tmp_path / "at_start") == losses(tmp_path / "plain")
    records = [json.loads(line) for line in open(tmp_path / "at_start" / "metrics.jsonl")]
    assert records[0]["samples"] == 0 and set(records[0]) == {"step", "samples", "eval_at_start_accuracy"}
    # The same number as evaluating a freshly built model with the same seed.
    fresh = Trainer(load_config(None, overrides(dataset)), str(tmp_path / "fresh"), init_distributed(backend="gloo"))
    fresh.eval_loader = build_eval_loader(fresh.cfg, fresh.rank, fresh.world, fresh.model_config.vocab_size)
    assert records[0]["eval_at_start_accuracy"] == fresh.evaluate()

    # Not an MLPerf evaluation: the log has the plain run's eval_accuracy events only.
    def evals(d):
        return sum('"key": "eval_accuracy"' in line for line in open(d / "mlperf.log"))

    assert evals(tmp_path / "at_start") == evals(tmp_path / "plain")


@pytest.mark.slow  # three training runs and the compliance checker
def test_resume_is_bitwise_identical(dataset, tmp_path):
    whole = tmp_path / "whole"
    run_in_process(
        dataset,
        whole,
        "train.max_steps=8",
        "model.overrides.hidden_dropout_prob=0.1",
        "model.overrides.attention_probs_dropout_prob=0.1",
    )
    parts = tmp_path / "parts"
    first = run_in_process(
        dataset,
        parts,
        "train.max_steps=8",
        "model.overrides.hidden_dropout_prob=0.1",
        "model.overrides.attention_probs_dropout_prob=0.1",
        stop_after=3,
    )
    assert first["status"] == "interrupted" and first["steps"] == 4
    assert os.listdir(parts / "checkpoints") == ["step_00000004.pt"]
    second = run_in_process(
        dataset,
        parts,
        "train.max_steps=8",
        "model.overrides.hidden_dropout_prob=0.1",
        "model.overrides.attention_probs_dropout_prob=0.1",
    )
    assert second["steps"] == 8
    assert losses(parts) == losses(whole)  # bitwise: the same floats
    status, _, output = compliance_check(parts / "mlperf.log")
    assert status == 0, output


def test_grad_accumulation_gives_the_same_losses(dataset, tmp_path):
    run_in_process(dataset, tmp_path / "a", "train.max_steps=3")
    run_in_process(dataset, tmp_path / "b", "train.max_steps=3", "train.grad_accum_steps=4")
    assert losses(tmp_path / "a") == pytest.approx(losses(tmp_path / "b"), rel=1e-5)


def cli(*args, timeout=300, **kw):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "run_pretraining.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        **kw,
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=-1", "optim.lr: must be positive"),
        ("train.precision=fp8", "train.precision: 'fp8' is not one of"),
        ("optim.lrr=1", "optim.lrr: unknown field"),
        ("train.grad_accum_steps=3", "train.global_batch_size: 8 is not divisible"),
        ("data.eval_file=/nonexistent.hdf5", "data.eval_file: '/nonexistent.hdf5' does not exist"),
        ("model.overrides.vocab_size=50", "outside the vocabulary"),
        ("model.attention=flashmask", "model.attention: flashmask needs data.layout=packed"),
        ("model.attention=nonexistent", "model.attention: 'nonexistent' is not one of"),
    ],
)
def test_bad_config_is_one_line(dataset, tmp_path, override, message):
    r = cli("--output-dir", str(tmp_path / "out"), *overrides(dataset, "train.max_steps=2", override))
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


CALLS = []


def counted_reference(q, k, v, layout, dropout_p, training):
    """A new backend, defined outside the application: ``reference`` that counts its calls."""
    CALLS.append(q.shape[0])
    return reference_attention(q, k, v, layout, dropout_p, training)


def test_a_new_backend_is_its_function_and_its_registry_line(dataset, tmp_path, monkeypatch):
    """CONTRIBUTING's recipe: registered from a test module, the config accepts it and the real
    trainer trains with it, to the loss ``reference`` gives."""
    line = registry.Backend("counted", f"{__name__}:counted_reference", (VarlenLayout,), frozenset({"window"}))
    monkeypatch.setitem(registry.BACKENDS, "counted", line)
    CALLS.clear()
    run = ("train.max_steps=1", "eval.max_samples=8")
    run_in_process(dataset, tmp_path / "new", "model.attention=counted", *run)
    assert CALLS, "the registered backend never ran"
    run_in_process(dataset, tmp_path / "ref", "model.attention=reference", *run)
    assert losses(tmp_path / "new") == losses(tmp_path / "ref")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, triton runs")
def test_a_backend_this_machine_cannot_run_is_a_config_error(dataset, tmp_path):
    """Found when the model is built (the config may be meant for another machine): one line, exit 2."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = cli("--output-dir", str(tmp_path / "out"), *overrides(dataset, "model.attention=triton"), env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1
    assert "model.attention=triton" in r.stderr and "TRITON_INTERPRET=1" in r.stderr


def test_unwritable_output_dir(dataset, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = cli("--output-dir", str(blocker / "out"), *overrides(dataset))
    assert r.returncode == 2 and "--output-dir" in r.stderr and "Traceback" not in r.stderr


def test_help_lists_every_field():
    r = cli("--help")
    assert r.returncode == 0
    for key in (
        "model.preset",
        "data.layout",
        "train.grad_accum_steps",
        "optim.start_warmup_step",
        "checkpoint.init",
        "log.division",
        "eval.target_accuracy",
    ):
        assert key in r.stdout


@pytest.mark.slow  # four training runs, one in the Triton interpreter
def test_layouts_and_dali_backend_train_the_same(dataset, tmp_path):
    # Two steps: the second's loss is after an update, so each layout's gradients are checked too.
    run_in_process(dataset, tmp_path / "unpadded", "train.max_steps=2")
    run_in_process(dataset, tmp_path / "padded", "train.max_steps=2", "data.layout=padded")
    run_in_process(dataset, tmp_path / "dali", "train.max_steps=2", "data.backend=dali")
    run_in_process(dataset, tmp_path / "packed", "train.max_steps=2", "data.layout=packed", "model.attention=flashmask")
    ref = losses(tmp_path / "unpadded")
    assert losses(tmp_path / "padded") == pytest.approx(ref, rel=1e-5)
    assert losses(tmp_path / "packed") == pytest.approx(ref, rel=1e-5)
    assert losses(tmp_path / "dali") == ref


def test_bf16_autocast_on_cpu(dataset, tmp_path):
    summary = run_in_process(dataset, tmp_path, "train.max_steps=3", "train.precision=bf16")
    assert summary["steps"] == 3
    assert all(math.isfinite(x) for x in losses(tmp_path))


def test_non_finite_steps_are_skipped_then_abort(dataset, tmp_path):
    summary = run_in_process(dataset, tmp_path / "a", "train.max_steps=6", "debug.nonfinite_steps=[2]")
    assert summary["status"] == "aborted" and summary["skipped_steps"] == 1 and summary["steps"] == 6
    summary = run_in_process(
        dataset,
        tmp_path / "b",
        "train.max_steps=20",
        "train.max_nonfinite_steps=3",
        "debug.nonfinite_steps=[2,3,4,5,6]",
    )
    assert summary["status"] == "aborted" and summary["steps"] == 4 and summary["skipped_steps"] == 3
    log = open(tmp_path / "b" / "mlperf.log").read()
    assert '"key": "run_stop"' in log and '"status": "aborted"' in log


@pytest.mark.slow  # a training subprocess
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(dataset, tmp_path):
    import signal as sig
    import time

    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "run_pretraining.py"),
            "--output-dir",
            str(tmp_path),
            *overrides(dataset, "train.max_steps=100000"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "metrics.jsonl").exists():
        time.sleep(0.2)
    proc.send_signal(sig.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "SIGTERM" in out and len(os.listdir(tmp_path / "checkpoints")) == 1


def tiny_triton_dropout(tmp_path, seq_len=32):
    """Overrides for the cheapest run of the Triton attention kernel in the interpreter: one
    layer of hidden 32, sequences of at most ``seq_len`` tokens, 2 a step; attention dropout
    only, so the kernel's Philox state draws every mask."""
    train, eval_file = write_dataset(str(tmp_path / "data"), num_files=1, per_file=16, eval_samples=4, seq_len=seq_len)
    shape = dict(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    (tmp_path / "bert_config.json").write_text(json.dumps(dict(shape, max_position_embeddings=64)))
    return [
        *TINY,
        f"data.train_dir={train}",
        f"data.eval_file={eval_file}",
        f"model.config_file={tmp_path / 'bert_config.json'}",
        "model.attention=triton",
        "model.overrides.attention_probs_dropout_prob=0.1",
        f"data.max_seq_length={seq_len}",
        "train.global_batch_size=2",
        "train.max_steps=2",
        "eval.interval_samples=1000",
        "eval.batch_size=4",
    ]


def _run_recording_philox(extra, out_dir, stop_after=None):
    """A run in this process; returns (summary, the kernels' Philox state after each step)."""
    trainer = Trainer(load_config(None, extra), str(out_dir), init_distributed(backend="gloo"))
    states, step = [], trainer.train_step

    def train_step(block):
        if trainer.state.step == stop_after:
            trainer.stop_requested = True  # what the SIGTERM handler does
        result = step(block)
        states.append(trainer.philox.tolist())  # a test's read, after the step
        return result

    trainer.train_step = train_step
    return trainer.train(), states


def test_triton_dropout_is_reproducible_from_the_seed_and_resumes_bitwise(tmp_path):
    """The Triton kernel's masks come from the device Philox state the trainer seeds at every
    step from (train.seed, step, rank) alone and the launches advance: another seed gives
    another state, and a fresh run of the same seed, interrupted after step 1 and resumed,
    the first run's states and losses, bitwise (nothing of the state is saved). The masks as
    a function of the state (and another seed's masks): tests/kernels/test_dropout_rng.py."""
    from bert.state import step_seed

    extra = tiny_triton_dropout(tmp_path)
    _, whole = _run_recording_philox([*extra, "train.seed=5"], tmp_path / "a")
    # One draw per attention forward (1 layer, 1 micro-batch a step), from the step's seed.
    assert whole == [[step_seed(5, step, 0, stream=1), 1] for step in (0, 1)]
    _, other = _run_recording_philox([*extra, "train.seed=6", "train.max_steps=1"], tmp_path / "other")
    assert other == [[step_seed(6, 0, 0, stream=1), 1]] and other[0][0] != whole[0][0]
    # A fresh run of the same seed: step 1 again, then resumed from its checkpoint, step 2.
    first, before = _run_recording_philox([*extra, "train.seed=5"], tmp_path / "parts", stop_after=0)
    assert first["status"] == "interrupted" and first["steps"] == 1
    _, after = _run_recording_philox([*extra, "train.seed=5"], tmp_path / "parts")
    assert before + after == whole
    assert len(losses(tmp_path / "a")) == 2
    assert losses(tmp_path / "parts") == losses(tmp_path / "a")  # bitwise: the same floats


def test_the_trainer_s_constructor_stays_short():
    # Issue 32: `Trainer.__init__` reads as the list of the run's parts, at most 40 lines.
    lines = len(inspect.getsource(Trainer.__init__).splitlines())
    assert lines <= 40, f"Trainer.__init__ is {lines} lines; move a part's set-up into a helper"
