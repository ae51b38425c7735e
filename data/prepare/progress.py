"""Progress bars and worker processes for long data work (preparation, conversion, checksums):
tqdm with rate and ETA on a terminal, silent when the stream is not one (logs, CI, tests), so
output files stay clean; a pool of processes kept for every stage, with a per-process cache."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager
from multiprocessing import get_context


def progress(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it", stream=None):
    """A ``tqdm`` bar on ``stream`` (default stderr), disabled unless it is a terminal; ``unit="B"`` scales to kB/MB."""
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        file=stream,
        disable=not stream.isatty(),
        dynamic_ncols=True,
        leave=False,
        mininterval=0.5,
    )


worker_cache: dict = {}


def cached(key, make):
    """``make()``, once per worker process and ``key``."""
    if key not in worker_cache:
        worker_cache[key] = make()
    return worker_cache[key]


class Pool(AbstractContextManager):
    """``workers`` processes, started on first use and kept for every stage (1 worker or 1 task: run here)."""

    def __init__(self, workers: int = 1):
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def imap(self, fn, tasks: list):
        """``fn`` over ``tasks``, results in order as they come."""
        if self.workers == 1 or len(tasks) <= 1:
            return map(fn, tasks)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=get_context("spawn"), initializer=_init_worker)
        return self._pool.map(fn, tasks)

    def map(self, fn, tasks: list, desc: str):
        """``fn`` over ``tasks`` (results in order), with a progress bar on a terminal."""
        from tqdm import tqdm

        return list(tqdm(self.imap(fn, tasks), total=len(tasks), desc=desc, unit="file", disable=None))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __exit__(self, *exc):
        self.close()


def _init_worker() -> None:
    # Parallelism comes from --workers; the tokenizer's own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
