"""Pretrain BERT: parse the config, initialise distributed, build the trainer, train.

    python run_pretraining.py --config launch/configs/cpu_demo.yaml --output-dir DIR [section.field=value ...]

Several ranks: torchrun, mpirun or srun (launch/). ``--help`` lists every configuration field. Exit status: 0 when the
run ends (success, aborted at its limits, or SIGTERM after a checkpoint); 2 for bad input (configuration, data,
checkpoint); 1 when the run fails on the way (a lost peer, a checkpoint or file that cannot be written); each as one
line naming what and where (``common.errors.UserError``, the only exception caught here). A traceback means a bug.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from bert.config import describe, load_config
from common.errors import UserError
from launch.versions import too_old


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="MLPerf-style BERT pretraining on unpadded batches.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="configuration fields (override any as section.field=value):\n" + describe(),
    )
    parser.add_argument("--config", help="YAML file in launch/configs/")
    parser.add_argument("--output-dir", required=True, help="mlperf.log, metrics, summary, checkpoints go here")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")
    # Intermixed: overrides may sit before, between or after the options.
    return parser.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if old := too_old():
            print(f"error: {old}", file=sys.stderr)
            return 2
        # Imported after the config is valid, so a typo is reported before torch loads.
        from bert.distributed.collectives import CollectiveError, announce_exit, hold_store
        from bert.distributed.fault_tolerance import FaultToleranceError
        from bert.train.trainer import Trainer
        from data.rebalance.exchange import RebalanceError
        from launch.distributed import destroy, init_distributed

        info = init_distributed(None, cfg.dist.timeout_s)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_status
    broken = False  # a failed collective leaves the process group unusable: do not tear it down
    store = None  # set when this rank stops on its own error and told the others why
    try:
        trainer = Trainer(cfg, args.output_dir, info)
        if info.rank == 0:
            print(
                f"config: {args.config or '(defaults)'}  ranks: {info.world_size}  device: {trainer.device}  "
                f"model: {cfg.model.preset if not cfg.model.config_file else cfg.model.config_file} "
                f"({sum(p.numel() for p in trainer.model.parameters()) / 1e6:.1f}M parameters, "
                f"attention {cfg.model.attention})  layout: {cfg.data.layout}  "
                f"global batch: {cfg.train.global_batch_size}  precision: {cfg.train.precision}"
                + (f", FP8 GEMMs ({cfg.train.fp8})" if cfg.train.fp8 != "off" else ""),
                flush=True,
            )
        summary = trainer.train()
    except UserError as e:
        # A failed collective (or quorum) names the rank, the collective and the ranks that did
        # not answer; it and a failed exchange leave the process group unusable.
        lost = isinstance(e, (CollectiveError, FaultToleranceError))
        broken = lost or isinstance(e, RebalanceError)
        print(f"error{'' if lost else f' (rank {info.rank})'}: {e}", file=sys.stderr, flush=True)
        if not lost:
            store = announce_exit(info.rank, info.world_size, str(e))
        return e.exit_status
    finally:
        if not broken:
            destroy()  # its connections close when this process ends; the others' watchers read why first
        if store is not None and info.rank == 0:
            hold_store(store, info.rank, info.world_size, 5.0)  # rank 0 serves it: keep it up while they look
    if summary.get("error"):
        if info.rank == 0:
            print(f"error: {summary['error']}", file=sys.stderr, flush=True)
        return 1
    return 0 if summary["status"] in ("success", "aborted", "interrupted") else 1


def exit_process(code: int) -> NoReturn:
    """End the process with ``code`` once ``main`` has returned (everything written and closed), skipping the
    interpreter's teardown; MPI is finalized after a finished run only (docs/reliability.md, "Ending the process")."""
    mpi = sys.modules.get("mpi4py.MPI")
    if code == 0 and mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
