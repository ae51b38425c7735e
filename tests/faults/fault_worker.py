"""``run_pretraining.py`` with faults injected from the environment; the tests in tests/faults
start it as the training script (directly, under torchrun or under mpirun).

FAULT_MARK_DIR            write ``rank<R>.pid`` there at start, so a test can signal one rank (R: the
                          launcher's rank, or a torchft replica's REPLICA_GROUP_ID)
FAULT_STEP_DELAY_S        sleep this long after each optimizer step: a window to kill or stop a
                          rank in, on a machine of any speed
FAULT_HOLD_FILE           while this file exists, wait after each optimizer step (a test holds
                          the run still while it restarts a replica)
FAULT_STALL_CHECKPOINT    when writing the checkpoint of this step (rank 0 writes it, a sharded
                          run's too), stop after its first bytes, write ``stalled`` to
                          FAULT_MARK_DIR and wait to be killed
FAULT_STOP_AT_STEP        ask the run to stop (what SIGTERM does) so that it checkpoints and
                          exits after this optimizer step
FAULT_STATE_HASH          after each optimizer step, write the SHA-256 of the weights' and the
                          optimizer state's bytes to FAULT_MARK_DIR/rank<R>.step<S> (replicas compare them)
FAULT_SLEEP_PER_TOKEN     "S0,S1,...": rank r's forward+backward sleeps Sr seconds per token of
                          its micro-batch (``TokenSleep``): ranks of known speeds, for
                          data.rebalance=measured

SIGUSR1 writes every thread's stack to stderr (``tests.helpers.Job`` sends it before killing a job
that ran past its time, so a hang on a CI machine says where it was).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _rank() -> str:
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "REPLICA_GROUP_ID"):
        if var in os.environ:
            return os.environ[var]
    return "0"


class TokenSleep:
    """Adds ``seconds`` per token to ``model``'s training forward+backward: the end of each backward
    sleeps that long for the micro-batch's tokens. Registered before the trainer's
    ``bert.train.step_timer.StepTimer`` (a parameter's hooks run in the order registered), the sleep is inside
    the interval the timer measures, and the other ranks wait for it in the gradient all-reduce, as for a
    device whose time is its tokens' work. Sleeping, not spinning: on a shared CPU a busy loop would slow
    the other ranks too, and a time that the sleep dominates hardly depends on the machine's load."""

    def __init__(self, model, seconds: float):
        self.seconds, self._tokens = seconds, None
        model.register_forward_pre_hook(lambda m, args: self._begin(args[0]) if m.training else None)
        next(p for p in model.parameters() if p.requires_grad).register_post_accumulate_grad_hook(self._sleep)

    def _begin(self, batch) -> None:
        self._tokens = int(batch.input_ids.numel())

    def _sleep(self, param) -> None:
        if self._tokens is not None:
            time.sleep(self.seconds * self._tokens)
            self._tokens = None


def _install_faults() -> None:
    mark_dir = os.environ.get("FAULT_MARK_DIR")
    rank = _rank()  # as launched: a single-rank replica's RANK becomes 0 once distributed is set up
    if mark_dir:
        with open(os.path.join(mark_dir, f"rank{_rank()}.pid"), "w") as f:
            f.write(str(os.getpid()))

    delay = float(os.environ.get("FAULT_STEP_DELAY_S", "0"))
    hold = os.environ.get("FAULT_HOLD_FILE")
    if delay or hold:
        from bert.train.trainer import Trainer

        step = Trainer.optimizer_step

        def optimizer_step(self):
            result = step(self)
            time.sleep(delay)
            while hold and os.path.exists(hold):
                time.sleep(0.05)
            return result

        Trainer.optimizer_step = optimizer_step

    stall = os.environ.get("FAULT_STALL_CHECKPOINT")
    if stall:
        from bert.checkpoint import training as train_checkpoint

        write = train_checkpoint._HashingSink.write
        name = f"step_{int(stall):08d}.pt"  # the file the sink's bytes are published as

        def stalling_write(self, data):
            n = write(self, data)
            if os.path.basename(self.path) == name and self.size > 4096:
                os.fsync(self.fd)  # the partial file is on disk, as a real kill would leave it
                open(os.path.join(mark_dir, "stalled"), "w").close()
                time.sleep(3600)
            return n

        train_checkpoint._HashingSink.write = stalling_write

    per_token = os.environ.get("FAULT_SLEEP_PER_TOKEN")
    if per_token:
        from bert.train.trainer import Trainer

        seconds = [float(x) for x in per_token.split(",")]
        build = Trainer._build_model

        def build_model(self):
            build(self)
            TokenSleep(self.model, seconds[self.rank])

        Trainer._build_model = build_model

    stop_at = os.environ.get("FAULT_STOP_AT_STEP")
    if stop_at:
        from bert.train.trainer import Trainer

        train_step = Trainer.train_step

        def stopping_train_step(self, block):
            if self.state.step == int(stop_at) - 1:
                self.stop_requested = True  # what the SIGTERM handler does; this step still runs
            return train_step(self, block)

        Trainer.train_step = stopping_train_step

    if os.environ.get("FAULT_STATE_HASH"):
        from bert.train.trainer import Trainer

        count = Trainer._count

        def hashing_count(self, *args):
            count(self, *args)
            with open(os.path.join(mark_dir, f"rank{rank}.step{self.state.step}"), "w") as f:
                f.write(state_hash(self.model, self.optimizer))

        Trainer._count = hashing_count


def state_hash(model, optimizer) -> str:
    """SHA-256 over every weight and optimizer-state tensor's bytes, in a fixed order."""
    import hashlib

    import torch

    h = hashlib.sha256()
    tensors = list(model.state_dict().items())
    for i, state in sorted(optimizer.state_dict()["state"].items()):
        tensors += [(f"{i}.{k}", v) for k, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _install_faults()
    from run_pretraining import exit_process, main

    exit_process(main())  # as run_pretraining.py ends: the exit path under test is the real one
