"""MLPerf's TensorFlow starting point read without TensorFlow, against a checkpoint that real
TensorFlow wrote (tests/bert/checkpoint/fixtures/make_tf_checkpoint.py) and TensorFlow's own reading of
it (expected.npz); conversion against transformers; NVIDIA's padded vocabulary."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from bert.checkpoint.convert_tf import main as convert_main
from bert.checkpoint.pretrained import load_pretrained
from bert.checkpoint.tf_reader import read_tf_checkpoint
from bert.model.config import BertConfig
from bert.model.hf import read_config, to_hf_state_dict
from bert.model.pretraining import BertForPreTraining
from common.errors import CheckpointError
from tests.batches import random_batch
from tests.bert.model.test_model import hf_logits, hf_model

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "tf_bert_tiny")
PREFIX = os.path.join(FIXTURE, "model.ckpt-7")
CONFIG_JSON = os.path.join(FIXTURE, "bert_config.json")


def expected():
    with np.load(os.path.join(FIXTURE, "expected.npz")) as z:
        return {k.replace("|", "/"): z[k] for k in z.files}


def test_reads_every_variable_bitwise_as_tensorflow_does():
    ours, theirs = read_tf_checkpoint(PREFIX), expected()
    assert set(ours) == set(theirs)
    assert "global_step" in ours and "bert/encoder/layer_1/output/dense/kernel/adam_v" in ours
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and ours[name].shape == value.shape, name
        assert ours[name].tobytes() == value.tobytes(), name
    assert ours["global_step"].dtype == np.int64 and int(ours["global_step"]) == 28252


def test_converted_model_matches_transformers(tmp_path):
    config = read_config(CONFIG_JSON)
    ours = BertForPreTraining(config).eval()
    load_pretrained(ours, PREFIX)  # checkpoint.init takes the prefix directly
    tf = expected()
    hf = to_hf_state_dict(ours)
    # Google's names, independently: dense kernels are [in, out] in TensorFlow.
    assert torch.equal(
        hf["bert.encoder.layer.1.attention.self.value.weight"],
        torch.from_numpy(tf["bert/encoder/layer_1/attention/self/value/kernel"].T),
    )
    assert torch.equal(hf["cls.seq_relationship.weight"], torch.from_numpy(tf["cls/seq_relationship/output_weights"]))
    assert torch.equal(hf["cls.predictions.bias"], torch.from_numpy(tf["cls/predictions/output_bias"]))
    assert torch.equal(hf["bert.embeddings.LayerNorm.weight"], torch.from_numpy(tf["bert/embeddings/LayerNorm/gamma"]))

    assert (
        convert_main(["--tf-checkpoint", PREFIX, "--bert-config", CONFIG_JSON, "--output", str(tmp_path / "hf")]) == 0
    )
    theirs = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager").eval()
    batch = random_batch([5, 32, 17], config.vocab_size, seed=3)
    with torch.no_grad():
        out = ours(batch)
        mlm, nsp = hf_logits(theirs, batch)
    assert (out.mlm_logits - mlm).abs().max() <= 1e-5
    assert (out.nsp_logits - nsp).abs().max() <= 1e-5

    assert (
        convert_main(["--tf-checkpoint", PREFIX, "--bert-config", CONFIG_JSON, "--output", str(tmp_path / "p.pt")]) == 0
    )
    again = BertForPreTraining(config)
    load_pretrained(again, str(tmp_path / "p.pt"))
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))
    assert sorted(os.listdir(tmp_path)) == ["hf", "p.pt"]  # no temporary files left


def copy_fixture(tmp_path):
    for name in os.listdir(FIXTURE):
        shutil.copy(os.path.join(FIXTURE, name), tmp_path / name)
    return str(tmp_path / "model.ckpt-7")


def test_damaged_checkpoints_give_clean_errors(tmp_path):
    prefix = copy_fixture(tmp_path)
    data = prefix + ".data-00000-of-00001"
    blob = open(data, "rb").read()

    open(data, "wb").write(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        read_tf_checkpoint(prefix)

    flipped = bytearray(blob)
    flipped[len(blob) // 3] ^= 0x40
    open(data, "wb").write(bytes(flipped))
    with pytest.raises(CheckpointError, match="checksum mismatch in .* variable"):
        read_tf_checkpoint(prefix)

    os.remove(data)
    with pytest.raises(CheckpointError, match="missing data shard"):
        read_tf_checkpoint(prefix)

    index = bytearray(open(prefix + ".index", "rb").read())
    index[10] ^= 0x01
    open(prefix + ".index", "wb").write(bytes(index))
    with pytest.raises(CheckpointError, match="checksum mismatch in the table block"):
        read_tf_checkpoint(prefix)

    os.remove(prefix + ".index")
    with pytest.raises(CheckpointError, match=r"model.ckpt-7.index: no such file"):
        read_tf_checkpoint(prefix)
    with pytest.raises(CheckpointError, match="nor a TensorFlow checkpoint prefix"):
        load_pretrained(BertForPreTraining(read_config(CONFIG_JSON)), prefix)


def test_cli_reports_one_line_and_fails(tmp_path):
    prefix = copy_fixture(tmp_path)
    os.remove(prefix + ".data-00000-of-00001")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bert.checkpoint.convert_tf",
            "--tf-checkpoint",
            prefix,
            "--bert-config",
            CONFIG_JSON,
            "--output",
            str(tmp_path / "out.pt"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "missing data shard" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out.pt").exists()


def test_nvidia_checkpoint_with_padded_vocabulary(tmp_path):
    config = BertConfig(
        vocab_size=61,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
    )
    theirs = hf_model(config, seed=7)
    sd = dict(theirs.state_dict())
    for name in (
        "bert.embeddings.word_embeddings.weight",
        "cls.predictions.bias",
        "cls.predictions.decoder.weight",
        "cls.predictions.decoder.bias",
    ):
        pad_rows = torch.randn((64 - 61, *sd[name].shape[1:]))  # NVIDIA pads 61 -> 64 rows
        sd[name] = torch.cat([sd[name], pad_rows])
    sd["cls.predictions.decoder.weight"] = sd["bert.embeddings.word_embeddings.weight"]
    sd["cls.predictions.decoder.bias"] = sd["cls.predictions.bias"]
    torch.save({"model": sd}, tmp_path / "model.ckpt-28252.pt")
    ours = BertForPreTraining(config).eval()
    load_pretrained(ours, str(tmp_path / "model.ckpt-28252.pt"))
    batch = random_batch([9, 30], config.vocab_size, seed=1)
    with torch.no_grad():
        mlm, nsp = hf_logits(theirs, batch)
        out = ours(batch)
    assert (out.mlm_logits - mlm).abs().max() <= 1e-5 and (out.nsp_logits - nsp).abs().max() <= 1e-5
    # Padding to anything but the next multiple of 8 is another vocabulary: refused.
    sd["bert.embeddings.word_embeddings.weight"] = torch.zeros(72, 16)
    torch.save({"model": sd}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="word_embeddings.weight is \\(72, 16\\)"):
        load_pretrained(BertForPreTraining(config), str(tmp_path / "other.pt"))
