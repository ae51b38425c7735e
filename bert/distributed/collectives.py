"""The trainer's collectives, wrapped so that a failure says which one, at which step, and who is missing.

``Collectives.guard(what, step)`` turns a backend's error into one ``CollectiveError`` line naming the
collective, the step and the ranks that did not report through the rendezvous store (with their hosts).
A rank that stops on its own error leaves its message there (``announce_exit``, ``hold_store``) and a
watcher thread ends the others with that cause: [docs/reliability.md](../docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from common.errors import RunFailure

# What backends put in the messages of communication failures (gloo raises plain RuntimeErrors);
# "pair closure": gloo, on a rank whose peer in the same process timed out first.
_COMM_ERROR = re.compile("gloo|Connection closed|Connection reset|Timed out|timed out|NCCL|Broken pipe|pair closure")
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")
WATCH_AFTER_S = 1.0  # a guarded block waiting this long makes the watcher look at the store
WATCH_EVERY_S = 0.5
EXIT_KEY = "fault/exit"  # "<rank>:<message>" of the first rank that stopped on its own error


class CollectiveError(RunFailure):
    """A collective failed (timeout, or a peer went away); the message names it, the step and the ranks."""


def is_comm_error(e: BaseException) -> bool:
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    if type(e).__name__ == "RebalanceError":  # its own failures (bad input) are not; what it wraps may be
        return e.__cause__ is not None and is_comm_error(e.__cause__)
    return isinstance(e, RuntimeError) and _COMM_ERROR.search(str(e)) is not None


def backend_reason(e: BaseException) -> str:
    """The first sentence of a backend error, without its source-file prefix."""
    if type(e).__name__ == "RebalanceError" and e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _SOURCE_PREFIX.sub("", text).split(". ")[0]


class Collectives:
    """All-reduce and guards for the default process group; ``timeout_s``, its collective timeout, is
    quoted in messages (a fifth of it, 2 to 10 s, is how long a failing rank waits for the others' reports)."""

    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.report_window_s = min(10.0, max(2.0, timeout_s / 5))
        self.hostname = socket.gethostname()
        self._waiting: tuple[str, float] | None = None  # the guarded block running now: (where, start)
        if world_size > 1 and dist.is_initialized():
            # Read back only after a failure, to name the host of ranks that went silent.
            dist.distributed_c10d._get_default_store().set(f"host/{rank}", self.hostname)
            threading.Thread(target=self._watch, name="collective-watcher", daemon=True).start()

    @contextlib.contextmanager
    def guard(self, what: str, step: int):
        """Turn a communication failure inside the block into a CollectiveError."""
        where, start = f"{what} at step {step}" if step >= 0 else what, time.monotonic()
        outer, self._waiting = self._waiting, (where, start)
        try:
            yield
        except CollectiveError:
            raise
        except Exception as e:
            self._waiting = None  # this rank reports the failure itself: the watcher stays out of it
            if self.world_size == 1 or not is_comm_error(e):
                raise
            raise CollectiveError(
                f"rank {self.rank}: {where} failed after {time.monotonic() - start:.1f} s "
                f"(dist.timeout_s={self.timeout_s:g}): {self._missing_ranks(where)}; "
                f"{dist.get_backend() if dist.is_initialized() else 'backend'}: {backend_reason(e)}"
            ) from e
        finally:
            self._waiting = outer

    def _watch(self) -> None:
        """While a guarded block waits long, end this rank if another announced its exit."""
        while True:
            time.sleep(WATCH_EVERY_S)
            waiting = self._waiting
            if waiting is None or time.monotonic() - waiting[1] < WATCH_AFTER_S:
                continue
            try:
                store = dist.distributed_c10d._get_default_store()
                if not store.check([EXIT_KEY]):
                    continue
                rank, _, message = store.get(EXIT_KEY).decode(errors="replace").partition(":")
            except Exception:  # noqa: BLE001 - no store (rank 0 gone): the collective fails by itself
                continue
            if self._waiting is not waiting or int(rank) == self.rank:
                continue
            where, start = waiting
            with contextlib.suppress(Exception):  # tells the stopped rank that this one has seen it
                store.set(f"fault/{self.rank}", f"failed:{where}")
            print(
                f"error: rank {self.rank}: {where} failed after {time.monotonic() - start:.1f} s "
                f"(dist.timeout_s={self.timeout_s:g}): rank {rank} stopped first: {message}; "
                f"still waiting for rank {rank} when it stopped",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)  # as run_pretraining ends after a failed collective: the group is unusable

    def all_reduce(self, t: torch.Tensor, what: str, step: int, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``t`` over ranks in place (no-op on one rank)."""
        if self.world_size > 1:
            with self.guard(what, step):
                dist.all_reduce(t, op=op)
        return t

    def _missing_ranks(self, where: str) -> str:
        """Ask the store what the other ranks reported: who stopped first, and who is silent."""
        reports: dict[int, str] = {}
        others = [r for r in range(self.world_size) if r != self.rank]
        # A launcher that saw a rank die sends SIGTERM to the others and SIGKILL soon after
        # (mpirun): stop waiting at SIGTERM and report what is known by then.
        on_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _stop_waiting) if on_main else None
        try:
            store = _store(self.report_window_s)
            store.set(f"fault/{self.rank}", f"failed:{where}")
            deadline = time.monotonic() + self.report_window_s
            while True:
                for r in others:
                    if r not in reports and store.check([f"fault/{r}"]):
                        reports[r] = store.get(f"fault/{r}").decode(errors="replace")
                if len(reports) == len(others) or time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
        except _StopWaiting:
            pass
        except Exception:  # noqa: BLE001 - the store is served by rank 0; no answer means rank 0 is gone
            if self.rank == 0:
                return "the rendezvous store did not answer"
            return "the rendezvous store on rank 0 does not answer: rank 0 was killed, stopped or hangs"
        finally:
            if on_main:
                signal.signal(signal.SIGTERM, previous)
        exits = [(r, text) for r, text in sorted(reports.items()) if text.startswith("exit:")][:3]
        parts = [f"rank {r} stopped first: {text[len('exit:') :]}" for r, text in exits]
        by_host: dict[str, list[int]] = {}
        for r in [r for r in others if r not in reports]:  # silent
            by_host.setdefault(self._host_of(store, r), []).append(r)
        for host, ranks in sorted(by_host.items(), key=lambda item: item[1][0])[:4]:
            names = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
            remote = f" on host {host} (unreachable, " if host not in ("", self.hostname) else " ("
            parts.append(f"no report from rank{'s' if len(ranks) > 1 else ''} {names}{remote}killed, stopped or hung)")
        return "; ".join(parts) or "every other rank reported the same failure (a network problem?)"

    @staticmethod
    def _host_of(store, rank: int) -> str:
        try:
            return store.get(f"host/{rank}").decode(errors="replace") if store.check([f"host/{rank}"]) else ""
        except Exception:  # noqa: BLE001 - the host is a detail of the message; the ranks are what matter
            return ""


class _StopWaiting(Exception):
    pass


def _stop_waiting(signum, frame):
    raise _StopWaiting


def _store(timeout_s: float):
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def hold_store(store, rank: int, world_size: int, most_s: float) -> None:
    """On the rank serving the store (0) after ``announce_exit``: wait until every other rank has
    reported (it saw the message) or ``most_s`` passed, so that the store outlives their reading."""
    others = [f"fault/{r}" for r in range(world_size) if r != rank]
    deadline = time.monotonic() + most_s
    while time.monotonic() < deadline:
        try:
            if store.check(others):
                time.sleep(0.5)  # they read the cause (and the hosts) right after reporting
                return
        except Exception:  # noqa: BLE001 - the store is this process's: nothing to wait for
            return
        time.sleep(0.1)


def announce_exit(rank: int, world_size: int, message: str):
    """Leave ``message`` (why this rank stops) where the other ranks' post-mortem finds it; returns the
    store (or None). Rank 0 serves it: holding the returned object for a few seconds after the process
    group is torn down lets the others read the message."""
    if world_size == 1 or not dist.is_initialized():
        return None
    try:
        store = _store(2.0)
        store.set(f"fault/{rank}", f"exit:{message}")
        store.compare_set(EXIT_KEY, "", f"{rank}:{message}")  # the first rank to stop is the cause
        return store
    except Exception:  # noqa: BLE001 - best effort: the others still report this rank as silent
        return None
