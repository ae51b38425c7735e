import os

import pytest
import torch

from tests.batches import write_dataset
from tests.faults.common import REFERENCE_STEPS, losses, run_in_process


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    """In-process runs on one thread: on a shared 2-core machine, torch's default of one
    thread per core spends more time waiting for cores than computing."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def dataset(tmp_path_factory):
    """The tiny synthetic training set and eval file of tests/bert/train/test_trainer.py."""
    return write_dataset(str(tmp_path_factory.mktemp("faults-data")))


@pytest.fixture(scope="package")
def reference(dataset, tmp_path_factory):
    """Losses of the uninterrupted run (12 steps, a checkpoint every 4), in this process;
    2 ranks train exactly what 1 rank trains."""
    out = tmp_path_factory.mktemp("reference")
    run_in_process(dataset, out, *REFERENCE_STEPS)
    return losses(out)


@pytest.fixture(scope="package")
def good_run(dataset, tmp_path_factory):
    """A run of 4 steps stopped (as by SIGTERM) after step 2, leaving its checkpoint; the
    hostile-checkpoint tests put newer ones beside it in a copy."""
    out = tmp_path_factory.mktemp("good-run")
    steps = ("train.max_steps=4", "checkpoint.interval_steps=2")
    assert run_in_process(dataset, out, *steps, stop_after=1)["status"] == "interrupted"
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000002.pt"]
    return out
