import json

import pytest

from bert.config import BertConfig, ConfigError


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
        assert BertConfig.from_json(str(path)) == c
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
    assert BertConfig.from_json(str(tmp_path / "bert_config.json")) == BertConfig.preset("large")


def test_transformers_written_config_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.BertConfig(
        hidden_size=12, num_attention_heads=3, num_hidden_layers=1, intermediate_size=20, vocab_size=50
    ).save_pretrained(str(tmp_path))
    c = BertConfig.from_json(str(tmp_path / "config.json"))
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
        BertConfig.from_json(str(path))
    with pytest.raises(ConfigError, match="preset"):
        BertConfig.preset("huge")
