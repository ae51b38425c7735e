"""MLPerf v5.0 closed-division rules the checker cannot see: seeds, the clock, the eval
interval, and the config guards of log.division=closed (CPU, tiny model)."""

import json
import os

import pytest

import data.hdf5io
import run_pretraining
from bert.config import load_config, mlperf_eval_interval
from bert.report.mlperf_log import MLPerfLogger
from bert.train import build as components
from bert.train import trainer as trainer_module
from common.errors import ConfigError
from tests.bert.train.test_trainer import dataset, losses, run_in_process  # noqa: F401 - dataset is a fixture


def log_events(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "mlperf.log")) as f:
        return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in f if ":::MLLOG " in line]


@pytest.mark.parametrize("batch, samples", [(448, 150_000), (768, 150_000), (3072, 175_000), (4608, 200_000)])
def test_eval_interval_by_the_rule(batch, samples):
    assert mlperf_eval_interval(batch) == samples
    cfg = load_config(None, [f"train.global_batch_size={batch}"])
    assert cfg.eval.interval_samples == "auto"


# A closed-division config that passes every guard (the paths are not read at config time).
CLOSED = ["log.division=closed", "log.submitter=tests", "checkpoint.init=/phase1/model.ckpt-28252.pt"]


def test_a_closed_config_with_the_rules_values_is_accepted():
    cfg = load_config(None, CLOSED + ["eval.interval_samples=150000", "model.overrides.hidden_dropout_prob=0.1"])
    assert cfg.log.division == "closed"


@pytest.mark.parametrize(
    "override, field",
    [
        ("log.submitter=", "log.submitter"),
        ("optim.name=adamw", "optim.name"),
        ("optim.clip=adagc", "optim.clip"),
        ("optim.clip=none", "optim.clip"),
        ("optim.max_grad_norm=2.0", "optim.max_grad_norm"),
        ("loss.simreg_weight=0.1", "loss.simreg_weight"),
        ("model.overrides.hidden_dropout_prob=0.0", "model.overrides.hidden_dropout_prob"),
        ("model.overrides.attention_probs_dropout_prob=0.2", "model.overrides.attention_probs_dropout_prob"),
        ("model.preset=base", "model.preset"),
        ("model.overrides.vocab_size=32000", "model.overrides.vocab_size"),
        ("data.max_seq_length=128", "data.max_seq_length"),
        ("checkpoint.init=null", "checkpoint.init"),
        ("eval.interval_samples=100000", "eval.interval_samples"),
        ("eval.max_samples=1000", "eval.max_samples"),
        ("eval.at_start=true", "eval.at_start"),
        ("eval.target_accuracy=0.5", "eval.target_accuracy"),
        ("debug.spike_steps=[3]", "debug.spike_steps"),
    ],
)
def test_closed_division_refuses_each_forbidden_setting(tmp_path, capsys, override, field):
    with pytest.raises(ConfigError, match=rf"^{field}: .*closed division"):
        load_config(None, CLOSED + [override])
    # From the command line: one line naming the field, exit status 2, nothing done yet.
    out = tmp_path / "out"
    assert run_pretraining.main(["--output-dir", str(out), *CLOSED, override]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: {field}: ")
    assert not out.exists()
    # The open division allows it.
    load_config(None, [o for o in CLOSED if not o.startswith("log.division")] + [override])


def test_closed_division_checks_a_config_file_is_bert_large(tmp_path):
    small = tmp_path / "bert_config.json"
    small.write_text(
        json.dumps(
            {
                "hidden_size": 256,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "intermediate_size": 1024,
                "vocab_size": 30522,
            }
        )
    )
    with pytest.raises(ConfigError, match=r"^model.config_file: .*hidden_size 256"):
        load_config(None, CLOSED + [f"model.config_file={small}"])


def test_the_clock_and_the_seed(dataset, tmp_path, monkeypatch):  # noqa: F811 - the fixture
    """init_start < model build < warm-up < init_stop < run_start < first dataset read; a run
    without train.seed draws one from the OS and logs it; the log's other keys tell the truth."""
    order = []
    emit = MLPerfLogger._emit

    def recording_emit(self, kind, key, *args, **kw):
        order.append(key)
        return emit(self, kind, key, *args, **kw)

    model_init = components.BertForPreTraining.__init__

    def recording_build(self, *args, **kw):
        order.append("model build")
        model_init(self, *args, **kw)

    opened = data.hdf5io.open_hdf5

    def recording_open(path):
        order.append("dataset read")
        return opened(path)

    warm_up = trainer_module.Trainer.warm_up

    def recording_warm_up(self):
        order.append("warm-up")
        warm_up(self)

    monkeypatch.setattr(MLPerfLogger, "_emit", recording_emit)
    monkeypatch.setattr(components.BertForPreTraining, "__init__", recording_build)
    monkeypatch.setattr(data.hdf5io, "open_hdf5", recording_open)
    monkeypatch.setattr(trainer_module.Trainer, "warm_up", recording_warm_up)
    monkeypatch.setenv(trainer_module.CACHE_CLEARED_ENV, "1")
    fast = ["model.attention=padded", "eval.max_samples=8"]
    run_in_process(dataset, tmp_path / "a", "train.max_steps=1", "train.seed=null", *fast)
    first = order.index
    assert (
        first("init_start")
        < first("model build")
        < first("warm-up")
        < first("init_stop")
        < first("run_start")
        < first("dataset read")
    )

    monkeypatch.delenv(trainer_module.CACHE_CLEARED_ENV)
    run_in_process(dataset, tmp_path / "b", "train.max_steps=1", "train.seed=null", *fast)
    a, b = log_events(tmp_path / "a"), log_events(tmp_path / "b")
    seeds = [[e["value"] for e in events if e["key"] == "seed"] for events in (a, b)]
    assert len(seeds[0]) == len(seeds[1]) == 1 and seeds[0] != seeds[1]
    by_key = {e["key"]: e for e in a}
    assert by_key["init_start"]["time_ms"] <= by_key["init_stop"]["time_ms"] <= by_key["run_start"]["time_ms"]
    assert by_key["cache_clear"]["value"] is True and {e["key"]: e for e in b}["cache_clear"]["value"] is False
    assert by_key["submission_platform"]["value"] == "1xcpu"
    assert by_key["opt_epsilon"]["value"] == by_key["opt_lamb_epsilon"]["value"]
    # NVIDIA's v4.0 numbering: one block, first_epoch_num 1, evals at the samples trained.
    assert by_key["block_start"]["metadata"]["first_epoch_num"] == 1
    assert by_key["block_start"]["metadata"]["epoch_count"] == 1
    assert by_key["eval_accuracy"]["metadata"]["epoch_num"] == by_key["train_samples"]["value"] == 8


def test_the_warm_up_does_not_change_training(dataset, tmp_path, monkeypatch):  # noqa: F811
    dropout = [
        "model.overrides.hidden_dropout_prob=0.1",
        "model.overrides.attention_probs_dropout_prob=0.1",
        "train.max_steps=2",
        "model.attention=padded",
        "eval.max_samples=8",
    ]
    run_in_process(dataset, tmp_path / "warm", *dropout)
    monkeypatch.setattr(trainer_module.Trainer, "warm_up", lambda self: None)
    run_in_process(dataset, tmp_path / "cold", *dropout)
    assert losses(tmp_path / "warm") == losses(tmp_path / "cold")  # bitwise


def test_closed_division_refuses_an_eval_set_that_is_not_10000(dataset, tmp_path):  # noqa: F811
    """Checked when the data opens, after run_start (the file cannot be read before)."""
    from bert.config import load_config as load
    from bert.train.trainer import Trainer
    from launch.distributed import init_distributed
    from tests.bert.train.test_trainer import overrides

    trainer = Trainer(load(None, overrides(dataset)), str(tmp_path), init_distributed(backend="gloo"))
    assert trainer.train_loader is None and trainer.eval_loader is None  # nothing read yet
    trainer.cfg.log.division = "closed"  # as if the config had passed the guards
    with pytest.raises(
        ConfigError,
        match=r"^data.eval_file: the closed division evaluates on exactly 10,000 "
        r"samples; .* holds 40$",
    ):
        trainer._open_data()
    assert trainer.train_loader is None  # closed by build_loaders when the check failed
