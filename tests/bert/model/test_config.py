import json
import os

import pytest

from bert.model.config import PRESETS, BertConfig
from bert.model.hf import read_config
from common.errors import ConfigError


def test_large_preset_is_mlperf_bert_large():
    c = BertConfig.preset("large")
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size, c.vocab_size) == (
        24,
        1024,
        16,
        4096,
        30522,
    )
    assert c.hidden_dropout_prob == c.attention_probs_dropout_prob == 0.1
    assert BertConfig.preset("base").hidden_size == 768
    assert BertConfig.preset("tiny", vocab_size=99).vocab_size == 99


def test_json_round_trip_bert_and_transformers(tmp_path):
    c = BertConfig.preset("tiny", hidden_act="relu")
    for transformers in (False, True):
        path = tmp_path / f"c{transformers}.json"
        c.to_json(str(path), transformers=transformers)
        assert read_config(str(path)) == c
    # BERT's original bert_config.json has no layer_norm_eps: the default applies.
    bert_json = {
        "attention_probs_dropout_prob": 0.1,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 4096,
        "max_position_embeddings": 512,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "type_vocab_size": 2,
        "vocab_size": 30522,
    }
    (tmp_path / "bert_config.json").write_text(json.dumps(bert_json))
    assert read_config(str(tmp_path / "bert_config.json")) == BertConfig.preset("large")


def test_transformers_written_config_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.BertConfig(
        hidden_size=12, num_attention_heads=3, num_hidden_layers=1, intermediate_size=20, vocab_size=50
    ).save_pretrained(str(tmp_path))
    c = read_config(str(tmp_path / "config.json"))
    assert (c.hidden_size, c.num_attention_heads, c.vocab_size) == (12, 3, 50)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"hidden_size": 100, "num_attention_heads": 3}, "hidden_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"hidden_dropout_prob": 1.0}, "hidden_dropout_prob"),
        ({"attention_probs_dropout_prob": -0.1}, "attention_probs_dropout_prob"),
        ({"hidden_act": "swish"}, "hidden_act"),
        ({"vocab_size": "30522"}, "vocab_size"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        BertConfig.preset("tiny", **overrides)


def test_unknown_field_is_named(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**BertConfig.preset("tiny").to_dict(), "hiden_size": 3}))
    with pytest.raises(ConfigError, match="hiden_size"):
        read_config(str(path))
    with pytest.raises(ConfigError, match="preset"):
        BertConfig.preset("huge")


def test_an_unknown_activation_is_a_config_error_not_relu():
    """The model has no fallback: an activation it does not know is refused, naming the field,
    even in a config built around BertConfig's own check."""
    import torch.nn.functional as F

    from bert.model.pretraining import BertForPreTraining, activation

    assert activation("relu") is F.relu and activation("gelu") is F.gelu
    with pytest.raises(ConfigError, match=r"^hidden_act: 'swish' is not one of"):
        activation("swish")
    config = BertConfig.preset("tiny")
    object.__setattr__(config, "hidden_act", "swish")  # past __post_init__
    with pytest.raises(ConfigError, match=r"^hidden_act: 'swish'"):
        BertForPreTraining(config)


def test_a_config_file_with_an_unknown_activation_is_found_when_the_config_is_checked(tmp_path, capsys):
    import run_pretraining
    from bert.config import load_config

    path = tmp_path / "bert_config.json"
    path.write_text(json.dumps({**BertConfig.preset("tiny").to_dict(), "hidden_act": "swish"}))
    with pytest.raises(ConfigError, match=rf"^model.config_file: {path}: hidden_act: 'swish'"):
        load_config(None, [f"model.config_file={path}"])
    # From the command line: one line naming the file and the field, exit status 2, nothing done yet.
    out = tmp_path / "out"
    assert run_pretraining.main(["--output-dir", str(out), f"model.config_file={path}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: model.config_file: {path}: hidden_act: ")
    assert not out.exists()


MODERN = {"model_type": "modernbert", "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 96}


@pytest.mark.parametrize(
    "values, message",
    [
        ({**MODERN, "global_attn_every_n_layers": 0}, "global_attn_every_n_layers: must be a positive integer"),
        ({**MODERN, "rope_parameters": [1, 2]}, "rope_parameters: expected a mapping"),
        ({**MODERN, "global_rope_theta": "big"}, "rope_theta_global: must be a finite number, got 'big'"),
        ({**MODERN, "global_rope_theta": 10**400}, "rope_theta_global: must be a finite number"),
        ({**MODERN, "num_hidden_layers": 10**9}, "fp32 parameters alone take"),
        (
            {"hidden_size": 128, "num_attention_heads": 2, "initializer_range": float("nan")},
            "initializer_range: must be",
        ),
        ({"hidden_size": 10**9, "num_attention_heads": 1}, "fp32 parameters alone take"),
        ({"vocab_size": 10**9}, "fp32 parameters alone take"),
        ({"max_position_embeddings": 2e8}, "max_position_embeddings: must be an integer"),
        ({"num_hidden_layers": True}, "num_hidden_layers: must be an integer"),
        ({"layer_norm_eps": float("inf")}, "layer_norm_eps: must be a finite number"),
    ],
)
def test_hostile_config_json_is_one_line_naming_the_field(tmp_path, values, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))  # NaN and Infinity as Python's json writes them
    with pytest.raises(ConfigError) as e:
        read_config(str(path))
    text = str(e.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text and len(text) < 400, text


def test_unreadable_config_json_is_one_line(tmp_path):
    digits = tmp_path / "digits.json"
    digits.write_text('{"vocab_size": ' + "9" * 5001 + "}")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, message in ((digits, "not a JSON model config"), (deep, "not a JSON model config"), (fifo, "regular")):
        with pytest.raises(ConfigError) as e:
            read_config(str(path))
        assert str(e.value).startswith(f"{path}: ") and message in str(e.value) and "\n" not in str(e.value)


def test_the_parameter_estimate_is_the_model_s_count():
    """The memory check counts what BertForPreTraining allocates, for every preset's parts
    (at tiny sizes), without building it."""
    from dataclasses import replace

    from bert.model.pretraining import BertForPreTraining

    for name, preset in PRESETS.items():
        config = replace(preset, hidden_size=32, num_attention_heads=2, intermediate_size=48, vocab_size=97)
        model = BertForPreTraining(config)
        real = sum(p.numel() for p in model.parameters())
        real += sum(b.numel() for n, b in model.named_buffers() if "rotary" in n)
        assert config.parameter_count() == real, name
