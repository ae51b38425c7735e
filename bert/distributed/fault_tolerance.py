"""Per-step fault tolerance on torchft (``dist.fault_tolerance=torchft``): a lost replica costs one step.

Each process is a replica: ``FaultTolerance`` joins each step's quorum (a replica behind heals there),
averages over the live replicas and commits; ``ReplicaPlanner`` gives it its share of the whole global
batch. torchft is imported when a ``FaultTolerance`` is built. docs/reliability.md, "Per-step fault tolerance".
"""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

from bert.distributed.host_counts import StepCounts, local_counts
from common.errors import ConfigError, RunFailure
from data.rebalance.exchange import ExchangeStats
from data.rebalance.plan import assign
from data.samples import SampleBlock
from launch.distributed import chosen_interface, interface_address

# torchft's own variables (its Manager reads the two timeouts too; they take precedence there).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_ENV = "REPLICA_GROUP_ID"
TIMEOUT_ENV = "TORCHFT_TIMEOUT_SEC"  # a silent replica fails the step after this long, and is left out
QUORUM_TIMEOUT_ENV = "TORCHFT_QUORUM_TIMEOUT_SEC"  # no quorum within this long ends the replica (unset: dist.timeout_s)
DEFAULT_TIMEOUT_S = 10


class FaultToleranceError(RunFailure):
    """The replica cannot go on (no quorum: the Lighthouse is gone or unreachable); one line."""


def replica_number() -> int:
    """$REPLICA_GROUP_ID (torchft's name for it), else 0."""
    value = os.environ.get(REPLICA_ENV, "0")
    if not value.isdigit():
        raise ConfigError(f"{REPLICA_ENV}={value!r} is not a replica number (an integer >= 0)")
    return int(value)


def settings(env=os.environ) -> tuple[str, int, int]:
    """(Lighthouse address, step timeout s, quorum timeout s or 0: dist.timeout_s) from torchft's
    own variables (whole seconds, as torchft reads them); ConfigError names one that is missing or wrong."""
    address = env.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise ConfigError(
            f"dist.fault_tolerance=torchft needs a Lighthouse: set {LIGHTHOUSE_ENV}=http://HOST:PORT "
            "(launch/run_torchrun.sh starts one with FT_REPLICAS)"
        )
    values = []
    for name, default in ((TIMEOUT_ENV, DEFAULT_TIMEOUT_S), (QUORUM_TIMEOUT_ENV, 0)):
        text = env.get(name, str(default))
        values.append(int(text) if text.isdigit() else -1)
        if values[-1] < 0 or (values[-1] == 0 and name == TIMEOUT_ENV):
            raise ConfigError(f"{name}={text!r}: expected a whole number of seconds > 0")
    return address, values[0], values[1]


@dataclass(frozen=True)
class Quorum:
    """This replica's place in one step's quorum."""

    rank: int  # 0..size-1
    size: int  # live replicas taking part in the step
    quorum_id: int
    changed: bool  # another quorum than the previous step's
    seconds: float  # host time spent getting it (and healing, when this replica healed)


class FaultTolerance:
    """A torchft ``Manager`` for this replica: quorum, gradient average and commit per step.

    section: the run's ``dist`` section. device: the training device (gloo on the CPU, NCCL on CUDA).
    state_dict / load_state_dict: the training state a healing replica receives from a peer and loads.
    step: the step the replica starts at (a resumed checkpoint's), so that the quorum sees it.
    """

    def __init__(
        self,
        section,
        device: torch.device,
        state_dict: Callable[[], dict],
        load_state_dict: Callable[[dict], None],
        step: int,
    ):
        # torchft logs every quorum and commit at INFO (its Rust part by RUST_LOG, read when it loads):
        # this module prints one line per change of quorum instead. RUST_LOG=info shows them again.
        os.environ.setdefault("RUST_LOG", "warn")
        import torchft

        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        # A healing replica reads the peer's state from a read-only buffer and copies it into its own parts.
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

        self.replica = replica_number()
        self.lighthouse, timeout_s, quorum_s = settings()
        timeout = timedelta(seconds=timeout_s)
        # The store the quorum's process groups meet in; other replicas reach it by this host's name.
        ifname = chosen_interface(os.environ)
        host = interface_address(ifname) if ifname else socket.gethostname()
        self._store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        process_group = torchft.ProcessGroupBabyNCCL if device.type == "cuda" else torchft.ProcessGroupGloo
        self.manager = torchft.Manager(
            pg=process_group(timeout=timeout),
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            # The Lighthouse's --min_replicas is the smallest quorum it forms; each formed one commits.
            min_replica_size=1,
            # The step's share of the batch depends on the quorum, so the step waits for it anyway;
            # a synchronous quorum also heals before the step, so a returning replica takes part at once.
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_s or section.timeout_s),
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            store_addr=host,
            store_port=self._store.port,
            lighthouse_addr=self.lighthouse,
            replica_id=f"replica_{self.replica}",
            hostname=host,
            # Every replica builds the same initial weights from train.seed (a checked setting).
            init_sync=False,
        )
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self._last_quorum: int | None = None
        self.quorum_seconds = 0.0  # host time in quorums, over the run (reported apart from the steps)
        self.quorums = 0

    def begin_step(self, step: int) -> Quorum:
        """Join the quorum of ``step`` (0-based); a replica behind the others heals here."""
        start = time.monotonic()
        try:
            self.manager.start_quorum()
            rank, size = self.manager.participating_rank(), self.manager.num_participants()
        except Exception as e:  # noqa: BLE001 - torchft raises plain RuntimeErrors from its RPCs
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            reason = reason.split(", details:")[0]  # the RPC status and message, not its empty metadata
            raise FaultToleranceError(
                f"replica {self.replica}: the quorum of step {step + 1} failed after {time.monotonic() - start:.1f} s: "
                f"no quorum from the Lighthouse at {self.lighthouse} (killed, unreachable, or fewer replicas alive "
                f"than its --min_replicas): {reason}"
            ) from None
        seconds = time.monotonic() - start
        self.quorum_seconds += seconds
        self.quorums += 1
        quorum_id = self.manager._quorum_id  # torchft 0.2.0 (pinned) has no public accessor
        changed, self._last_quorum = quorum_id != self._last_quorum, quorum_id
        return Quorum(int(rank or 0), max(int(size), 1), quorum_id, changed, seconds)

    def average_(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` over the quorum's replicas in place, in one all-reduce. A failure (a
        replica lost mid-step) is recorded by torchft and makes ``commit`` false."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.manager.allreduce(flat).wait()
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))

    def commit(self) -> bool:
        """Whether every live replica finished the step (then the optimizer steps); False: redo it."""
        return self.manager.should_commit()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


class ReplicaPlanner:
    """The whole global batch of each step (a loader built for one rank), and this replica's share of it.

    ``block(step)``: the step's global batch, kept until the step commits (a redone step sees the same samples);
    ``counts``: its global counts; ``share``: this replica's samples, planned by ``data.rebalance`` over the live
    replicas when their number divides the batch, else a contiguous slice."""

    def __init__(self, loader, rebalance: str, cost: tuple, group_size: int | None, simreg_scope: str | None):
        self.loader, self.batches = loader, iter(loader)
        self.rebalance, self.cost, self.group_size, self.simreg_scope = rebalance, cost, group_size, simreg_scope
        self._step: int | None = None
        self._block: SampleBlock | None = None
        self._corrupt = 0

    def block(self, step: int) -> SampleBlock:
        if self._step != step:
            if self.loader.step != step:  # a healed replica jumps to the quorum's step
                self.loader.load_state_dict({**self.loader.state_dict(), "step": step})
            self._block, self._step = next(self.batches), step
            self._corrupt = self.loader.pop_substituted(step)
        return self._block

    def counts(self, step: int, stop: bool) -> StepCounts:
        """The global counts of ``step``: sums over its whole batch, the same on every replica."""
        words = local_counts(self.block(step), stop, self._corrupt, self.simreg_scope)
        masked, sequences, tokens, stop_flag, anchors, corrupt = (int(x) for x in words)
        return StepCounts(masked, sequences, tokens, stop_flag > 0, anchors, corrupt)

    def drain(self) -> None:
        """Nothing runs behind a step here (no exchange to collect)."""

    def share(self, block: SampleBlock, step: int, quorum: Quorum) -> tuple[SampleBlock, ExchangeStats | None]:
        n, r, g = quorum.size, quorum.rank, len(block)
        if self.rebalance == "none" or g % n:
            return block.select(np.arange(r * g // n, (r + 1) * g // n)), None
        t0 = time.perf_counter()
        lengths = block.seq_lens.astype(np.int64).reshape(n, g // n)  # as if each replica had drawn its slice
        group = self.group_size if self.group_size and n % self.group_size == 0 else None
        plan = assign(lengths, self.rebalance, self.cost, group_size=group)
        held = plan.src_rank[r] >= 0  # rows past a rank's count are -1 (only measured plans have them)
        mine = plan.src_rank[r][held].astype(np.int64) * (g // n) + plan.src_index[r][held]
        ms = (time.perf_counter() - t0) * 1e3
        # every replica holds the whole batch: nothing to gather or send (the collectives' fields stay 0)
        return block.select(mine), ExchangeStats(
            step=step,
            strategy=self.rebalance,
            imbalance_before=plan.imbalance_before,
            imbalance_after=plan.imbalance_after,
            samples_moved=plan.moved,
            samples_sent=int((plan.dest_rank[r] != r).sum()),
            samples_received=int((plan.src_rank[r][held] != r).sum()),
            token_share=float(block.seq_lens[mine].sum()) * n / max(int(lengths.sum()), 1),
            assign_ms=ms,
            exchange_ms=ms,
            wait_ms=ms,
        )
