"""HF <-> ours weight mapping, exports transformers loads, NVIDIA's MLPerf .pt, and errors."""

import os

import pytest
import torch
import transformers

from bert.checkpoint.pretrained import export_hf, load_pretrained
from bert.model.config import BertConfig
from bert.model.hf import load_hf_state_dict, read_config, to_hf_state_dict
from bert.model.pretraining import BertForPreTraining
from common.errors import CheckpointError, ConfigError
from tests.batches import random_batch
from tests.bert.model.test_model import hf_logits, hf_model

CONFIG = BertConfig(
    vocab_size=120,
    hidden_size=36,
    num_hidden_layers=2,
    num_attention_heads=3,
    intermediate_size=50,
    max_position_embeddings=64,
)


def test_round_trip_is_bit_identical():
    theirs = hf_model(CONFIG, seed=1)
    ours = BertForPreTraining(CONFIG)
    load_hf_state_dict(ours, theirs.state_dict())
    back = to_hf_state_dict(ours)
    ref = theirs.state_dict()
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k


def test_export_loads_in_transformers(tmp_path):
    torch.manual_seed(0)
    ours = BertForPreTraining(CONFIG).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out_dir = tmp_path / "hf"
    export_hf(ours, str(out_dir))
    theirs = transformers.BertForPreTraining.from_pretrained(str(out_dir), attn_implementation="eager").eval()
    batch = random_batch([3, 40, 64], CONFIG.vocab_size, seed=2)
    mlm, nsp = hf_logits(theirs, batch)
    out = ours(batch)
    assert (out.mlm_logits - mlm).abs().max() <= 1e-5
    assert (out.nsp_logits - nsp).abs().max() <= 1e-5
    # ... and our loader reads the exported directory back exactly.
    again = BertForPreTraining(CONFIG)
    load_pretrained(again, str(out_dir))
    for (n, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), n
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".export-")]


def test_transformers_directory_and_pytorch_bin(tmp_path):
    theirs = hf_model(CONFIG, seed=4)
    theirs.save_pretrained(str(tmp_path / "st"))
    ours = BertForPreTraining(CONFIG)
    load_pretrained(ours, str(tmp_path / "st"))
    assert torch.equal(to_hf_state_dict(ours)["cls.seq_relationship.weight"], theirs.cls.seq_relationship.weight)
    d = tmp_path / "bin"
    d.mkdir()
    CONFIG.to_json(str(d / "config.json"), transformers=True)
    torch.save(theirs.state_dict(), d / "pytorch_model.bin")
    other = BertForPreTraining(CONFIG)
    load_pretrained(other, str(d))
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), other.state_dict().values()))


def test_nvidia_mlperf_checkpoint(tmp_path):
    # NVIDIA's model.ckpt-28252.pt is {"model": <transformers-style state dict>, ...}; its
    # decoder weight is stored tied and the position_ids buffer may be present.
    theirs = hf_model(CONFIG, seed=5)
    sd = dict(theirs.state_dict())
    sd["bert.embeddings.position_ids"] = torch.arange(CONFIG.max_position_embeddings)[None]
    path = tmp_path / "model.ckpt-28252.pt"
    torch.save({"model": sd, "optimizer": {}, "files": [], "epoch": 0}, path)
    ours = BertForPreTraining(CONFIG)
    load_pretrained(ours, str(path))
    assert torch.equal(ours.layers[1].qkv.weight[36:72], theirs.bert.encoder.layer[1].attention.self.key.weight)


def test_mismatches_are_listed_together():
    theirs = hf_model(CONFIG, seed=1).state_dict()
    del theirs["bert.pooler.dense.bias"]
    theirs["bert.extra.weight"] = torch.zeros(1)
    theirs["cls.seq_relationship.weight"] = torch.zeros(3, 36)
    with pytest.raises(CheckpointError) as e:
        load_hf_state_dict(BertForPreTraining(CONFIG), theirs)
    msg = str(e.value)
    assert "bert.pooler.dense.bias" in msg and "bert.extra.weight" in msg
    assert "cls.seq_relationship.weight is (3, 36)" in msg


def test_config_mismatch_and_bad_files(tmp_path):
    ours = BertForPreTraining(CONFIG)
    export_hf(ours, str(tmp_path / "a"))
    bigger = BertForPreTraining(BertConfig(**{**CONFIG.to_dict(), "intermediate_size": 52}))
    with pytest.raises(CheckpointError, match="intermediate_size"):
        load_pretrained(bigger, str(tmp_path / "a"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pt"):
        load_pretrained(ours, str(tmp_path / "junk.pt"))
    (tmp_path / "empty").mkdir()
    CONFIG.to_json(str(tmp_path / "empty" / "config.json"))
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load_pretrained(ours, str(tmp_path / "empty"))


def test_a_family_without_an_adapter_is_one_line(tmp_path):
    """config.json's model_type picks the adapter (bert.checkpoint.pretrained.ADAPTERS); another family's
    config is refused naming it, not read as BERT."""
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "roberta", "hidden_size": 36}')
    with pytest.raises(ConfigError, match=r"model_type 'roberta': no transformers adapter here \(one of \['bert'"):
        read_config(str(path))
    rms = BertForPreTraining(BertConfig.preset("tiny", norm_kind="rmsnorm", norm_bias=False))
    with pytest.raises(CheckpointError, match=r"no transformers class holds this config \(norm_kind='rmsnorm'"):
        load_hf_state_dict(rms, {})
