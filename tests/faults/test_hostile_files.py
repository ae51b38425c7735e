"""Files made to attack the application: checkpoints whose unpickling would run code (a payload
that writes a marker file), tensors that do not fit the model, sizes that would exhaust memory.
Each is refused with one line, or passed over for the previous checkpoint; the marker is never
written; nothing raises a traceback.

Every payload is first shown to work: ``torch.load(weights_only=False)``, what the trainer
used to call, writes the marker. So a test here cannot pass because its payload is a dud.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import zipfile

import pytest
import torch

import run_pretraining
from bert.checkpoint import training as train_checkpoint
from bert.checkpoint.pretrained import export_hf, load_pretrained
from bert.model.config import BertConfig
from bert.model.hf import to_hf_state_dict
from bert.model.pretraining import BertForPreTraining
from common.errors import CheckpointError
from tests.faults.common import losses, run_args, run_in_process

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
BASE = ("train.max_steps=4", "checkpoint.interval_steps=2")  # one good checkpoint: step 2


class Payload:
    """Unpickling this calls open(marker, "w"): the marker file appears."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def payload_works(path, marker) -> bool:
    """The unsafe load the trainer used to do runs the payload (then the marker is removed)."""
    torch.load(path, map_location="cpu", weights_only=False)
    ran = os.path.exists(marker)
    if ran:
        os.remove(marker)
    return ran


def with_trailer(body: bytes) -> bytes:
    """``body`` as a checkpoint file whose checksum verifies (the documented trailer)."""
    return body + f"\nBERT-CHECKPOINT sha256={hashlib.sha256(body).hexdigest()} size={len(body):016d}\n".encode()


def rezip(src: str, dst: str, patch_pickle=None, compression=zipfile.ZIP_STORED, data=None) -> bytes:
    """The torch.save archive ``src`` rewritten: its data.pkl patched, its records compressed,
    or its first tensor record replaced; returns the new archive's bytes."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w", compression=compression) as out:
        for name in z.namelist():
            content = z.read(name)
            if name.endswith("data.pkl") and patch_pickle:
                content = patch_pickle(content)
            if name.endswith("/data/0") and data is not None:
                content = data
            out.writestr(name, content)
    with open(dst, "rb") as f:
        return f.read()


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


# ---- training checkpoints, as files ------------------------------------------------------------


def test_payload_under_a_valid_checksum_never_runs(tmp_path):
    marker = tmp_path / "MARKER"
    path = train_checkpoint.write(str(tmp_path), 8, {"counters": {"step": 8}, "evil": Payload(marker)}, keep=2)
    train_checkpoint.verify_checksum(path)  # the checksum is valid: it detects damage, not intent
    with pytest.raises(CheckpointError) as e:
        train_checkpoint.read(path)
    assert one_line(str(e.value)) == (
        f"{path}: refers to io.open, which is not plain data (only tensors, numbers, "
        f"strings, lists and dicts are loaded); refused without running it"
    )
    assert not marker.exists()
    assert payload_works(path, marker)


def test_a_value_that_is_not_plain_data_is_refused(tmp_path):
    path = train_checkpoint.write(
        str(tmp_path), 3, {"counters": {"step": 3}, "optimizer": {"dtype": torch.float16}}, keep=2
    )
    with pytest.raises(CheckpointError, match=r"state\.optimizer\.dtype holds a torch\.dtype; only tensors"):
        train_checkpoint.read(path)


def test_save_refuses_a_state_that_read_would_refuse(tmp_path):
    with pytest.raises(TypeError, match=r"checkpoint state of step 3: state\.x\[1\] holds a .*Payload"):
        train_checkpoint.save(str(tmp_path), 3, {"counters": {}, "x": [1, Payload(tmp_path / "m")]}, keep=2)
    assert os.listdir(tmp_path) == []


def _storage_numel_huge(pkl: bytes) -> bytes:
    # ('storage', FloatStorage, '0', 'cpu', 4): the element count 4 becomes 2**30.
    at = pkl.index(b"K\x04t")
    return pkl[:at] + b"J" + struct.pack("<i", 2**30) + b"t" + pkl[at + 3 :]


@pytest.mark.parametrize("kind", ["trailer-size", "storage-size", "compressed-record"])
def test_huge_declared_sizes_are_refused_without_allocating(tmp_path, kind):
    plain = tmp_path / "plain.pt"
    torch.save({"counters": {"step": 5}, "w": torch.zeros(4)}, plain)
    path = tmp_path / "step_00000005.pt"
    if kind == "trailer-size":  # the trailer claims 10 PB of state
        body = plain.read_bytes()
        raw = with_trailer(body).replace(f"size={len(body):016d}".encode(), b"size=9999999999999999")
        message = "the trailer records 9999999999999999 bytes of state"
    elif kind == "storage-size":  # a tensor's storage claims 4 GiB in a 16-byte record
        raw = with_trailer(rezip(str(plain), str(tmp_path / "z"), patch_pickle=_storage_numel_huge))
        message = "cannot be loaded (RuntimeError: record size (16 bytes) does not match expected size"
    else:  # 64 MiB of zeros deflated to 64 KiB: torch would inflate it into memory
        raw = with_trailer(
            rezip(str(plain), str(tmp_path / "z"), compression=zipfile.ZIP_DEFLATED, data=bytes(64 << 20))
        )
        message = "is compressed ("
    path.write_bytes(raw)
    with pytest.raises(CheckpointError) as e:
        train_checkpoint.read(str(path))
    assert str(e.value).startswith(f"{path}: ") and message in one_line(str(e.value))


# ---- training checkpoints, resumed by the trainer ---------------------------------------------


def _hostile_state(kind: str, good: dict, marker) -> dict:
    state = {**good, "model": dict(good["model"]), "optimizer": dict(good["optimizer"])}
    name = "layers.0.ffn_in.weight"
    if kind == "payload":
        state["counters"] = {**good["counters"], "note": Payload(marker)}
    elif kind == "shapes":
        state["model"][name] = good["model"][name].t().contiguous()
    elif kind == "dtypes":
        state["model"][name] = good["model"][name].double()
    elif kind == "optimizer-shapes":
        moments = {i: dict(m) for i, m in good["optimizer"]["state"].items()}
        first = next(iter(moments))
        moments[first]["exp_avg"] = torch.zeros(3)
        state["optimizer"]["state"] = moments
    return state


HOSTILE_STATES = {
    "payload": "refers to io.open, which is not plain data",
    "shapes": (
        "the model weights do not fit this model (layers.0.ffn_in.weight is torch.float32 (128, 512), "
        "the model has torch.float32 (512, 128))"
    ),
    "dtypes": "layers.0.ffn_in.weight is torch.float64 (512, 128), the model has torch.float32 (512, 128)",
    "optimizer-shapes": "the optimizer's exp_avg of parameter 0 is torch.float32 (3,)",
}


def test_hostile_newer_checkpoints_are_passed_over(dataset, good_run, tmp_path, capsys):
    """One hostile checkpoint of each kind, newer than the good one (one run tries them all)."""
    out, marker = tmp_path / "out", tmp_path / "MARKER"
    shutil.copytree(good_run, out)
    good = train_checkpoint.read(str(out / "checkpoints" / "step_00000002.pt"))
    bad = {
        kind: train_checkpoint.write(str(out / "checkpoints"), step, _hostile_state(kind, good, marker), keep=9)
        for step, kind in enumerate(HOSTILE_STATES, start=3)
    }
    capsys.readouterr()
    s = run_in_process(dataset, out, *BASE)
    printed = capsys.readouterr().out
    warnings = [line for line in printed.splitlines() if line.startswith("warning:")]
    assert len(warnings) == len(bad), warnings
    for kind, path in bad.items():
        named = [w for w in warnings if w.startswith(f"warning: {path}: ")]
        assert len(named) == 1 and HOSTILE_STATES[kind] in named[0], (kind, warnings)
        assert named[0].endswith("; trying the previous checkpoint")
    assert "resumed from step 2" in printed and s["steps"] == 4
    assert not marker.exists()
    assert payload_works(bad["payload"], marker)


def test_only_hostile_checkpoints_stop_the_cli_with_one_line(dataset, tmp_path, capsys):
    marker = tmp_path / "MARKER"
    os.makedirs(tmp_path / "out" / "checkpoints")
    bad = train_checkpoint.write(
        str(tmp_path / "out" / "checkpoints"), 2, {"counters": {"step": 2}, "x": Payload(marker)}, keep=2
    )
    code = run_pretraining.main(["--output-dir", str(tmp_path / "out"), *run_args(dataset, *BASE)])
    err = one_line(capsys.readouterr().err)
    assert code == 2 and err.startswith(
        f"error (rank 0): every checkpoint in {tmp_path / 'out' / 'checkpoints'} "
        f"is damaged or refused ({bad}: refers to io.open"
    )
    assert not marker.exists()


@pytest.mark.parametrize("shard", ["none", "1"], ids=["unsharded", "sharded"])
def test_a_checkpoint_of_the_previous_code_resumes(dataset, tmp_path, shard):
    """fixtures/run_v1_micro is a run directory the trainer wrote before weights-only loading
    (commit 59dbb48): BERT of hidden 16 and 1 layer with AdaGC, stopped after step 2 of 4.
    Resuming it trains steps 3 and 4 as that code did (the losses it printed then), also
    into a sharded run (optim.shard: the single file's tensors cut into this rank's shards)."""
    micro = tmp_path / "micro.json"
    micro.write_text(
        json.dumps(
            {
                "hidden_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 32,
                "max_position_embeddings": 64,
                "vocab_size": 96,
            }
        )
    )
    shutil.copytree(os.path.join(FIXTURES, "run_v1_micro"), tmp_path / "out")
    s = run_in_process(
        dataset,
        tmp_path / "out",
        *BASE,
        "optim.clip=adagc",
        "optim.adagc.warmup_steps=1",
        f"model.config_file={micro}",
        f"optim.shard={shard}",
    )
    assert s["steps"] == 4
    assert losses(tmp_path / "out") == pytest.approx(
        [5.263164520263672, 5.243893623352051, 5.257051467895508, 5.270761013031006], rel=1e-5
    )


# ---- initial checkpoints (checkpoint.init) -----------------------------------------------------

CONFIG = BertConfig(
    vocab_size=40,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=32,
)


def _model(seed=0):
    torch.manual_seed(seed)
    return BertForPreTraining(CONFIG)


def test_initial_checkpoint_payload_never_runs(tmp_path):
    marker = tmp_path / "MARKER"
    nvidia = tmp_path / "model.ckpt-28252.pt"
    torch.save({"model": to_hf_state_dict(_model()), "args": Payload(marker)}, nvidia)
    hf = tmp_path / "hf"
    export_hf(_model(), str(hf))
    os.remove(hf / "model.safetensors")
    torch.save({**to_hf_state_dict(_model()), "extra": Payload(marker)}, hf / "pytorch_model.bin")
    for path, file in ((nvidia, nvidia), (hf, hf / "pytorch_model.bin")):
        model = _model(seed=1)
        before = [p.clone() for p in model.parameters()]
        with pytest.raises(CheckpointError) as e:
            load_pretrained(model, str(path))
        assert one_line(str(e.value)).startswith(f"{file}: refers to io.open, which is not plain data")
        assert not marker.exists() and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert payload_works(file, marker)


def test_safetensors_is_preferred_to_a_pickle_beside_it(tmp_path):
    marker = tmp_path / "MARKER"
    export_hf(_model(seed=2), str(tmp_path / "hf"))
    torch.save({"x": Payload(marker)}, tmp_path / "hf" / "pytorch_model.bin")
    model = _model(seed=3)
    load_pretrained(model, str(tmp_path / "hf"))
    assert torch.equal(model.layers[0].qkv.weight, _model(seed=2).layers[0].qkv.weight)
    assert not marker.exists()


def test_initial_checkpoint_that_does_not_fit_is_one_line(tmp_path):
    sd = to_hf_state_dict(_model())
    bad = {
        **sd,
        "bert.pooler.dense.weight": sd["bert.pooler.dense.weight"].to(torch.int32),
        "cls.seq_relationship.weight": torch.zeros(3, 16),
    }
    torch.save({"model": bad}, tmp_path / "m.pt")
    with pytest.raises(CheckpointError) as e:
        load_pretrained(_model(), str(tmp_path / "m.pt"))
    assert "not floating-point tensors: bert.pooler.dense.weight (torch.int32)" in one_line(str(e.value))
    torch.save({"model": {**sd, "cls.seq_relationship.weight": torch.zeros(3, 16)}}, tmp_path / "m.pt")
    with pytest.raises(CheckpointError) as e:
        load_pretrained(_model(), str(tmp_path / "m.pt"))
    assert "shape mismatch: cls.seq_relationship.weight is (3, 16), model expects (2, 16)" in one_line(str(e.value))


def test_initial_checkpoint_huge_declared_sizes(tmp_path):
    # safetensors: an 8-byte header length of 2**60
    st = tmp_path / "big.safetensors"
    st.write_bytes(struct.pack("<Q", 2**60) + b"{}")
    with pytest.raises(CheckpointError) as e:
        load_pretrained(_model(), str(st))
    assert one_line(str(e.value)).startswith(f"{st}: cannot read safetensors")
    # torch: a deflated record that would inflate to 64 MiB
    torch.save({"model": {"w": torch.zeros(4)}}, tmp_path / "plain.pt")
    rezip(str(tmp_path / "plain.pt"), str(tmp_path / "bomb.pt"), compression=zipfile.ZIP_DEFLATED, data=bytes(64 << 20))
    with pytest.raises(CheckpointError, match="is compressed"):
        load_pretrained(_model(), str(tmp_path / "bomb.pt"))


def test_hostile_initial_checkpoint_through_the_cli(dataset, tmp_path, capsys):
    marker = tmp_path / "MARKER"
    torch.save({"model": {}, "x": Payload(marker)}, tmp_path / "init.pt")
    code = run_pretraining.main(
        ["--output-dir", str(tmp_path / "out"), *run_args(dataset, *BASE, f"checkpoint.init={tmp_path / 'init.pt'}")]
    )
    err = one_line(capsys.readouterr().err)
    assert code == 2 and err.startswith(f"error (rank 0): {tmp_path / 'init.pt'}: refers to io.open")
    assert not marker.exists()


# ---- configuration files -----------------------------------------------------------------------


def test_a_config_with_a_python_tag_is_refused(dataset, tmp_path, capsys):
    marker = tmp_path / "MARKER"
    config = tmp_path / "evil.yaml"
    config.write_text(f"train:\n  max_steps: !!python/object/apply:builtins.open ['{marker}', 'w']\n")
    code = run_pretraining.main(["--config", str(config), "--output-dir", str(tmp_path / "out"), *run_args(dataset)])
    err = one_line(capsys.readouterr().err)
    assert code == 2 and err.startswith(f"error: {config}: not valid YAML (line 2: could not determine a constructor")
    # an override is YAML too: a tag there is not constructed either
    tagged = f"train.max_steps=!!python/object/apply:builtins.open ['{marker}']"
    code = run_pretraining.main(["--output-dir", str(tmp_path / "out"), *run_args(dataset, tagged)])
    err = one_line(capsys.readouterr().err)
    assert code == 2 and "train.max_steps: not valid YAML (line 1: could not determine a constructor" in err
    assert not marker.exists()
