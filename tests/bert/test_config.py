"""The run configuration's loading under hostile input (issue 33, item 10) and its shape:
every refusal is one short line naming the file or key, and comes well under a second."""

from __future__ import annotations

import os
import time

import pytest

from bert.config import describe, load_config
from common.errors import ConfigError

# 376 bytes: nine levels of nine aliases, about 3.9e8 leaves if expanded.
ALIAS_BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n" for p, c in zip("abcdefgh", "bcdefghi")
)


def _refused(path, overrides=(), match=""):
    start = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    message = str(e.value)
    assert time.perf_counter() - start < 1.0
    assert "\n" not in message and len(message) < 800 and match in message, message
    return message


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(ALIAS_BOMB)
    assert bomb.stat().st_size < 400
    assert _refused(str(bomb), match="aliases").startswith(f"{bomb}: not valid YAML (line 2")


def test_deep_nesting_is_refused(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("debug:\n  spike_steps: " + "[" * 20_000 + "]" * 20_000 + "\n")
    _refused(str(deep), match="nested deeper than 32")


def test_an_override_of_a_billion_leaves_is_refused():
    leaves = "debug.spike_steps=[" + ",".join(["&a [1,1,1,1,1,1,1,1,1,1]"] + ["*a"] * 9) + "]"
    _refused(None, [leaves], match="debug.spike_steps: not valid YAML")
    _refused(None, ["debug.spike_steps=" + "[" * 20_000], match="nested deeper")
    _refused(None, ["debug.spike_steps=[" + "1," * 40_000 + "1]"], match="over 65,536")


def test_a_fifo_config_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    _refused(str(fifo), match="not a regular file")
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (2 << 20))
    _refused(str(big), match="this format allows")


def test_a_null_key_in_a_mapping_field_is_named(tmp_path):
    path = tmp_path / "null.yaml"
    path.write_text("model:\n  overrides:\n    ~: 1\n")
    _refused(str(path), match="model.overrides.None: not a BertConfig field")
    path.write_text("model:\n  attention_options:\n    ~: 1\n")
    assert "takes no such option" in _refused(str(path), match="model.attention_options.None: ")


def test_long_values_are_cut_in_messages(tmp_path):
    _refused(None, ["train.precision=" + "y" * 50_000], match="...")
    _refused(None, ["model.overrides." + "k" * 5000 + "=1"], match="not a BertConfig field")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.seed=18446744073709551616", "train.seed: 18446744073709551616 does not fit in 64 bits"),
        ("train.seed=-1", "train.seed: must be >= 0"),
        ("train.static_token_bucket=1000000000000", "train.static_token_bucket: must be <= "),
        ("dist.timeout_s=1e300", "dist.timeout_s: must be > 0 and <= 604,800"),
        ("dist.timeout_s=.nan", "dist.timeout_s: expected a finite number"),
        ("train.max_steps=true", "train.max_steps: expected an integer"),
        ("model.overrides.initializer_range=.nan", "model.overrides.initializer_range: must be a finite number"),
        ("model.overrides.hidden_size=1000000000", "the model's fp32 parameters alone take"),
        ("model.overrides.num_hidden_layers=1000000000", "the model's fp32 parameters alone take"),
        ("model.overrides.vocab_size=1000000000", "the model's fp32 parameters alone take"),
        ("model.overrides.max_position_embeddings=2e8", "max_position_embeddings: must be an integer"),
        ("model.overrides.max_position_embeddings=200000000", "the model's fp32 parameters alone take"),
        ("model.overrides.nope=1", "model.overrides.nope: not a BertConfig field"),
        ("model.attention_options.buckets=[64]", "model.attention_options.buckets: reference takes no such option"),
        ("data.rebalance_cost=[1, 2, 3]", "data.rebalance_cost: expected (a, b) or (a, b, b_local, window)"),
    ],
)
def test_out_of_bounds_values_are_refused_by_name(override, message):
    _refused(None, [override], match=message)


def test_the_schedule_is_checked_with_the_config_not_when_it_is_built():
    _refused(None, ["optim.poly_power=-1"], match="optim.poly_power: must be non-negative")
    wsd = ["optim.schedule=wsd", "optim.warmup_steps=4", "optim.decay_steps=7", "train.max_steps=10"]
    _refused(None, wsd, match="optim.decay_steps: warm-up (4) and decay (7) exceed the 10 steps")


def test_the_config_fits_on_a_page():
    """Issue 32: at most 80 fields (a mapping field counts once), each documented once in --help;
    issues 44 and 45 added one each (dist.fault_tolerance, whose torchft variables set the rest;
    dist.context_parallel, one field for the group size and its threshold)."""
    names = [line.split(" = ")[0].strip() for line in describe().splitlines() if " = " in line]
    assert len(names) <= 82 and len(set(names)) == len(names)
    assert "model.overrides" in names and "model.attention_options" in names
    cfg = load_config(
        None,
        [
            "model.overrides.vocab_size=96",
            "model.attention=triton_grouped",
            "model.attention_options.buckets=[128,512]",
        ],
    )
    assert cfg.model.overrides == {"vocab_size": 96} and cfg.model.attention_options == {"buckets": [128, 512]}
