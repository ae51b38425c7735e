"""Trains a tiny run and counts the host's reads of device tensors in its steady-state steps.

    python tests/bert/train/device_reads_worker.py OUT_JSON OUTPUT_DIR FIRST_STEP [section.field=value ...]

(under torchrun for several ranks). Every step from FIRST_STEP (1-based) on is counted from
the start of ``train_step`` to the end of ``optimizer_step`` (micro-batches, forward,
backward, clipping, the optimizer and the schedule) with ``tools.device_reads``; the model's
parameters and buffers and the optimizer's, schedule's and clipper's tensors are the device
tensors. Rank 0 writes {step: [reads, "kind: where" ...]} to OUT_JSON. The trainer's
interface used (``train_step``, ``optimizer_step``) is the one it has had since before the
no-read step, so the same worker counts the reads of earlier code.
"""

from __future__ import annotations

import json
import sys

import torch

from bert.config import load_config
from bert.train.trainer import Trainer
from launch.distributed import destroy, init_distributed
from run_pretraining import exit_process
from tools.device_reads import DeviceReads


def device_tensors(trainer) -> list[torch.Tensor]:
    found = list(trainer.model.parameters()) + list(trainer.model.buffers())
    for state in trainer.optimizer.state.values():
        found += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for group in trainer.optimizer.param_groups:
        found += [v for v in group.values() if isinstance(v, torch.Tensor)]
    found += [trainer.philox] if hasattr(trainer, "philox") else []  # the kernels' dropout state
    for part in (trainer.schedule, trainer.adagc, getattr(trainer, "counters", None)):
        found += [v for v in vars(part).values() if isinstance(v, torch.Tensor)] if part is not None else []
    return found


def instrument(trainer, first_step: int) -> dict[int, list]:
    """Wrap the trainer's steps; returns the dict the counts of each measured step land in."""
    seen: dict[int, list] = {}
    train_step, optimizer_step = trainer.train_step, trainer.optimizer_step
    active: list[DeviceReads] = []

    def counted_train_step(block):
        if trainer.state.step + 1 >= first_step:
            reads = DeviceReads(device_tensors(trainer))
            reads.__enter__()
            active.append(reads)
        return train_step(block)

    def counted_optimizer_step():
        try:
            return optimizer_step()
        finally:
            if active:
                reads = active.pop()
                reads.__exit__(None, None, None)
                seen[trainer.state.step + 1] = [reads.total] + [f"{k}: {w}" for k, w in reads.log]

    trainer.train_step, trainer.optimizer_step = counted_train_step, counted_optimizer_step
    return seen


def main(argv: list[str]) -> int:
    out, output_dir, first_step, overrides = argv[0], argv[1], int(argv[2]), argv[3:]
    dist_info = init_distributed(backend="gloo")
    trainer = Trainer(load_config(None, overrides), output_dir, dist_info)
    seen = instrument(trainer, first_step)
    trainer.train()
    if dist_info.rank == 0:
        with open(out, "w") as f:
            json.dump(seen, f)
    destroy()
    return 0


if __name__ == "__main__":
    # As run_pretraining.py ends: the interpreter's teardown with the trainer's threads still
    # alive once aborted a rank ("terminate called without an active exception").
    exit_process(main(sys.argv[1:]))
