"""Checkpoint save and load: the checksummed single file against the DCP directory, side by side.

    python bench/checkpoint_io.py [--preset tiny] [--vocab 8000] [--repeats 8]

Both formats of today's code on the same model and LAMB state (the demo model by default),
in one process without a process group, alternating: the single file (``train_checkpoint``'s
``write_file`` / ``read_file`` + ``load_state_dict``) and the sharded directory
(``distributed_checkpoint.save`` + ``train_checkpoint.read`` + ``load_tensors``). Prints the
median seconds of each and the directory's ratio to the file (issue 32's goal: <= 1.05).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

from bert import distributed_checkpoint as dc
from bert import train_checkpoint as tc
from bert.config import BertConfig
from bert.model import BertForPreTraining
from bert.optim import Lamb, param_groups_for


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset(args.preset, vocab_size=args.vocab))
    optimizer = Lamb(param_groups_for(model, 0.01), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    directory = tempfile.mkdtemp()

    def file_save(step):
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "counters": {"step": step}}
        tc.write_file(tc.checkpoint_path(directory, step), state)

    def dir_save(step):
        state = {"counters": {"step": step}, "optimizer_groups": dc.optimizer_groups(optimizer)}
        dc.save(directory, step, dc.training_tensors(model, optimizer), state, is_main=True)

    def file_load(step):
        state = tc.read(tc.checkpoint_path(directory, step))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def dir_load(step):
        state = tc.read(tc.checkpoint_dir(directory, step))
        dc.load_tensors(state["sharded"], dc.training_tensors(model, optimizer))

    times: dict[str, list[float]] = {k: [] for k in ("file save", "dir save", "file load", "dir load")}
    try:
        for i in range(args.repeats):
            for name, run in (
                ("file save", file_save),
                ("dir save", dir_save),
                ("file load", file_load),
                ("dir load", dir_load),
            ):
                start = time.perf_counter()
                run(i)
                times[name].append(time.perf_counter() - start)
    finally:
        shutil.rmtree(directory)
    median = {k: statistics.median(v[2:] if len(v) > 4 else v) for k, v in times.items()}
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.preset} (vocab {args.vocab}): {params:,} parameters, LAMB state")
    for name, seconds in median.items():
        print(f"  {name:10s} {seconds * 1e3:8.1f} ms")
    print(f"  save: directory / file = {median['dir save'] / median['file save']:.2f}x (goal <= 1.05)")
    print(f"  load: directory / file = {median['dir load'] / median['file load']:.2f}x (goal <= 1.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
