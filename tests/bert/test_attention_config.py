"""An attention backend that cannot run is a configuration error: one line, exit 2.

A name the registry does not know, or a layout the backend does not take, is refused when
the configuration is loaded (before torch); a backend this machine cannot run (Triton on a
CPU without TRITON_INTERPRET) when the model is built. Both run ``run_pretraining.py`` as a
user does, on a tiny synthetic dataset.
"""

import os
import subprocess
import sys

import pytest
import torch

from bert.train_config import ConfigError, load_config
from tests.batches import write_dataset
from tests.helpers import REPO

TINY = [
    "model.preset=tiny",
    "model.vocab_size=96",
    "data.max_seq_length=64",
    "train.global_batch_size=8",
    "train.device=cpu",
    "train.max_steps=1",
    "log.plot=false",
]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("data")))


def run(dataset, tmp_path, *extra, env=None):
    train, eval_file = dataset
    args = [*TINY, f"data.train_dir={train}", f"data.eval_file={eval_file}", *extra]
    return subprocess.run(
        [sys.executable, str(REPO / "run_pretraining.py"), "--output-dir", str(tmp_path / "out"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )


def assert_config_error(proc, *words):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]


def test_unknown_backend_is_a_config_error(dataset, tmp_path):
    proc = run(dataset, tmp_path, "model.attention=nonexistent")
    assert_config_error(proc, "model.attention", "'nonexistent'", "reference", "flashmask")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, triton runs")
def test_triton_on_a_cpu_without_the_interpreter_is_a_config_error(dataset, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run(dataset, tmp_path, "model.attention=triton", env=env)
    assert_config_error(proc, "model.attention=triton", "TRITON_INTERPRET=1")


@pytest.mark.parametrize(
    "layout, attention, words",
    [
        ("packed", "triton", ("model.attention: triton needs data.layout=unpadded", "reference, flashmask")),
        ("padded", "torch_varlen", ("torch_varlen needs data.layout=unpadded", "reference, padded")),
        ("unpadded", "flashmask", ("model.attention: flashmask needs data.layout=packed",)),
    ],
)
def test_a_layout_the_backend_does_not_take_is_refused_when_loaded(layout, attention, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"data.layout={layout}", f"model.attention={attention}"])
    for word in words:
        assert word in str(e.value)
