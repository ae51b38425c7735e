"""The trainer's MLPerf run log (``:::MLLOG`` lines), written with ``mlperf_logging.mllog``.

One ``MLPerfLogger`` per process; rank 0 writes, the other ranks' calls are checked and dropped.
``epoch_num`` is training samples consumed over all ranks. The calls must come in a run's order, else
``RuntimeError``; the order and the checker: [docs/mlperf.md](../docs/mlperf.md#the-log).
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlperf_logging.mllog import constants as C
from mlperf_logging.mllog.mllog import MLLogger

from common.errors import OutputError, UserError

DIVISIONS = ("open", "closed")
RUN_STATUSES = (C.SUCCESS, C.ABORTED)  # "success", "aborted"
QUORUM_KEY = "quorum_change"  # dist.fault_tolerance: not an MLPerf key (the closed division refuses the mode)
PRECISIONS = ("fp8", "bfloat16", "fp16", "fp32")  # the rules' lowest_numerical_precision_in_* values we produce

# optim.name -> its opt_name (mllog.constants LAMB / ADAMW) and the keys of its epsilon, betas and weight decay.
# MLPerf names no StableAdamW (open division only: it logs as itself with AdamW's keys), and a poly power for LAMB only.
_OPTIMIZER_KEYS = {
    C.LAMB: (C.OPT_LAMB_EPSILON, C.OPT_LAMB_BETA_1, C.OPT_LAMB_BETA_2, C.OPT_LAMB_WEIGHT_DECAY),
    C.ADAMW: (C.OPT_ADAMW_EPSILON, C.OPT_ADAMW_BETA_1, C.OPT_ADAMW_BETA_2, C.OPT_ADAMW_WEIGHT_DECAY),
}
_OPTIMIZER_KEYS["stable_adamw"] = _OPTIMIZER_KEYS[C.ADAMW]

# Frames from the trainer's call to mllog's caller lookup (public method -> _emit -> MLLogger.event/start/end):
# each line's metadata "file"/"lineno" name the trainer's line, not this module's.
_STACK_OFFSET = 3
_REPO_ROOT = str(Path(__file__).resolve().parents[2])

# Phases of a run, worded to complete "<key> is not allowed ...".
_NEW, _INIT, _READY = "before init_start", "between init_start and init_stop", "after init_stop"
_RUNNING, _STOPPED = "after run_start", "after run_stop"


class MLPerfLogger:
    """One run's MLPerf log, written by rank 0; every rank validates the call order. ``path`` None: stdout.
    ``platform``: ``submission_platform``, ``<nodes>x<system>`` (``"1xNVIDIA DGX A100"``).
    ``resume``: append to an interrupted run's log, which must hold ``run_start`` and none of
    ``train_samples``, ``eval_samples``, ``run_stop``; a partial last line (a killed writer) is cut off."""

    def __init__(
        self,
        path: str | os.PathLike | None,
        rank: int,
        division: str,
        submitter: str = "unspecified",
        platform: str = "unspecified",
        resume: bool = False,
    ):
        if division not in DIVISIONS:
            raise ValueError(f"MLPerf log: division must be one of {DIVISIONS}, got {division!r}")
        if resume and path is None:
            raise ValueError("MLPerf log: resume needs a log file path, got None")
        self.division, self.submitter, self.platform = division, submitter, platform
        self.path = None if path is None else Path(path)

        # Resumed: after run_start on every rank (rank 0 checks the file below): the initialisation is refused.
        self._phase = _RUNNING if resume else _NEW
        self._done: set[str] = set()  # keys that passed _expect; a once-key may not pass again
        self._open: dict[str, int] = {}  # open intervals (epoch, block, eval) -> start samples
        self._samples = 0  # largest samples count logged so far, to catch counters going back

        self._logger = logging.Logger(f"{__name__}.rank{rank}")  # unregistered: no propagation
        self._mllog = None
        if rank == 0:
            if resume:
                _check_resumable(self.path)
            if self.path is None:
                handler = logging.StreamHandler(sys.stdout)
            else:
                try:
                    handler = logging.FileHandler(self.path, mode="a" if resume else "w", encoding="utf-8")
                except OSError as e:
                    raise OutputError(f"MLPerf log: cannot open {self.path} for writing: {e.strerror or e}") from e
            self._logger.addHandler(handler)
            self._mllog = MLLogger(logger=self._logger, root_dir=re.escape(_REPO_ROOT))

    def close(self) -> None:
        """Flushes and closes the log file. Further calls still validate but write nothing."""
        for handler in list(self._logger.handlers):
            self._logger.removeHandler(handler)
            handler.close()
        self._mllog = None

    def cache_clear(self, cleared: bool = True) -> None:
        """Logs whether the launcher dropped the file-system caches before the run (required once; docs/mlperf.md)."""
        self._expect(C.CACHE_CLEAR, (_NEW, _INIT, _READY), once=True)
        self._emit("event", C.CACHE_CLEAR, bool(cleared))

    def init_start(self) -> None:
        """Starts the untimed initialisation (model build, data set up, compilation)."""
        self._expect(C.INIT_START, (_NEW,))
        self._emit("start", C.INIT_START)
        self._phase = _INIT

    def submission_info(self) -> None:
        """Logs ``submission_benchmark`` (bert), ``_org``, ``_division``, ``_status``, ``_platform``."""
        self._expect("submission_info", (_INIT,), once=True)
        self._emit("event", C.SUBMISSION_BENCHMARK, C.BERT)
        self._emit("event", C.SUBMISSION_ORG, self.submitter)
        self._emit("event", C.SUBMISSION_DIVISION, self.division)
        self._emit("event", C.SUBMISSION_STATUS, "onprem")  # as in NVIDIA's logs
        self._emit("event", C.SUBMISSION_PLATFORM, self.platform)

    def hyperparameters(
        self,
        *,
        seed: int,
        global_batch_size: int,
        local_batch_size: int,
        gradient_accumulation_steps: int,
        max_sequence_length: int,
        max_predictions_per_seq: int,
        optimizer: str,
        learning_rate: float,
        betas: Sequence[float],
        epsilon: float,
        weight_decay: float,
        warmup_steps: int,
        start_warmup_step: int,
        train_steps: int,
        poly_power: float,
        schedule: str = "poly",
        decay_steps: int = 0,
        decay_shape: str = "1-sqrt",
    ) -> None:
        """Logs the run's hyper-parameters under their MLPerf keys: ``opt_name`` (``optimizer``: lamb, adamw,
        stable_adamw) and its own keys (``opt_lamb_*`` / ``opt_adamw_*``); ``local_batch_size`` (sequences per
        rank per forward pass) as ``d_batch_size``; a wsd ``schedule`` as ``opt_learning_rate_decay_schedule``
        (``wsd <decay_shape>``) and ``opt_learning_rate_decay_steps``, with no poly power."""
        self._expect("hyperparameters", (_INIT,), once=True)
        if optimizer not in _OPTIMIZER_KEYS:
            raise ValueError(f"optimizer: {optimizer!r} is not one of {sorted(_OPTIMIZER_KEYS)}")
        eps_key, beta_1_key, beta_2_key, decay_key = _OPTIMIZER_KEYS[optimizer]
        power_key = C.OPT_LAMB_LR_DECAY_POLY_POWER if optimizer == C.LAMB else "opt_learning_rate_decay_poly_power"
        beta_1, beta_2 = betas
        values: list[tuple[str, Any]] = [
            (C.SEED, _int(C.SEED, seed)),
            (C.GLOBAL_BATCH_SIZE, _int(C.GLOBAL_BATCH_SIZE, global_batch_size, least=1)),
            ("d_batch_size", _int("d_batch_size", local_batch_size, least=1)),
            (C.GRADIENT_ACCUMULATION_STEPS, _int(C.GRADIENT_ACCUMULATION_STEPS, gradient_accumulation_steps, least=1)),
            (C.MAX_SEQUENCE_LENGTH, _int(C.MAX_SEQUENCE_LENGTH, max_sequence_length, least=1)),
            ("max_predictions_per_seq", _int("max_predictions_per_seq", max_predictions_per_seq, least=1)),
            (C.OPT_NAME, optimizer),
            (C.OPT_BASE_LR, _float(C.OPT_BASE_LR, learning_rate)),
            (eps_key, _float(eps_key, epsilon)),
            # The RCP records and the rules' hyper-parameter table name it so; NVIDIA's logs carry both.
            ("opt_epsilon", _float("opt_epsilon", epsilon)),
            (beta_1_key, _float(beta_1_key, beta_1)),
            (beta_2_key, _float(beta_2_key, beta_2)),
            (decay_key, _float(decay_key, weight_decay)),
            (C.OPT_LR_TRAINING_STEPS, _int(C.OPT_LR_TRAINING_STEPS, train_steps, least=1)),
            (C.OPT_LR_WARMUP_STEPS, _int(C.OPT_LR_WARMUP_STEPS, warmup_steps)),
            (C.NUM_WARMUP_STEPS, _int(C.NUM_WARMUP_STEPS, warmup_steps)),
            (C.START_WARMUP_STEP, _int(C.START_WARMUP_STEP, start_warmup_step)),
        ]
        if schedule == "poly":
            values.append((power_key, _float(power_key, poly_power)))
        elif schedule == "wsd":
            values.append((C.OPT_LR_DECAY_SCHEDULE, f"wsd {decay_shape}"))
            values.append((C.OPT_LR_DECAY_STEPS, _int(C.OPT_LR_DECAY_STEPS, decay_steps)))
        else:
            raise ValueError(f"schedule: {schedule!r} is not one of ['poly', 'wsd']")
        for key, value in values:
            self._emit("event", key, value)

    def precision(self, *, linear: str, attention: str) -> None:
        """Logs the lowest numerical precision of the linear layers' and attention's math (``PRECISIONS``;
        training 6.0's keys, which the 5.0.0 checker passes: docs/fp8.md)."""
        values = ((C.LOWEST_NUMERICAL_PRECISION_IN_LINEAR, linear), (C.LOWEST_NUMERICAL_PRECISION_IN_ATTN, attention))
        for key, value in values:  # checked before anything is written: a refused call logs nothing
            if value not in PRECISIONS:
                raise ValueError(f"MLPerf log: {key} must be one of {list(PRECISIONS)}, got {value!r}")
        self._expect("precision", (_INIT,), once=True)
        for key, value in values:
            self._emit("event", key, value)

    def init_stop(self) -> None:
        """Ends initialisation; ``submission_info`` and ``hyperparameters`` must be logged."""
        self._expect(C.INIT_STOP, (_INIT,))
        if missing := [name for name in ("submission_info", "hyperparameters") if name not in self._done]:
            raise RuntimeError(f"MLPerf log: call {' and '.join(missing)}() before init_stop()")
        self._emit("end", C.INIT_STOP)
        self._phase = _READY

    def run_start(self) -> None:
        """Starts the timed run (the clock MLPerf's time to train is measured from)."""
        self._expect(C.RUN_START, (_READY,))
        self._emit("start", C.RUN_START)
        self._phase = _RUNNING

    def epoch_start(self, samples: int) -> None:
        """Opens the training epoch at ``samples`` trained (0 for a fresh run)."""
        samples = _int("samples", samples)
        self._start_interval("epoch", C.EPOCH_START, samples, {C.EPOCH_NUM: samples})

    def epoch_stop(self, samples: int) -> None:
        samples = _int("samples", samples)
        self._stop_interval("epoch", C.EPOCH_STOP, samples, {C.EPOCH_NUM: samples})

    def block_start(self, samples: int, block_samples: int) -> None:
        """Opens a block at ``samples`` trained (``first_epoch_num``) of ``block_samples`` (``epoch_count``, > 0)."""
        samples, count = _int("samples", samples), _int("block_samples", block_samples, least=1)
        self._start_interval("block", C.BLOCK_START, samples, {C.FIRST_EPOCH_NUM: samples, C.EPOCH_COUNT: count})

    def block_stop(self, samples: int) -> None:
        samples = _int("samples", samples)
        # As NVIDIA's v4.0 logs: block_stop carries first_epoch_num only.
        self._stop_interval("block", C.BLOCK_STOP, samples, {C.FIRST_EPOCH_NUM: self._open.get("block")})

    def eval_start(self, samples: int) -> None:
        """Opens an evaluation of the model trained on ``samples`` samples."""
        samples = _int("samples", samples)
        self._start_interval("eval", C.EVAL_START, samples, {C.EPOCH_NUM: samples}, value=samples)

    def eval_stop(self, samples: int) -> None:
        samples = _int("samples", samples)
        self._stop_interval("eval", C.EVAL_STOP, samples, {C.EPOCH_NUM: samples}, value=samples)

    def eval_accuracy(self, samples: int, accuracy: float) -> None:
        """Logs the masked-LM accuracy (a fraction in [0, 1]) after ``samples`` samples."""
        self._expect(C.EVAL_ACCURACY, (_RUNNING,))
        samples = self._advance(samples)
        accuracy = _float(C.EVAL_ACCURACY, accuracy)
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"MLPerf log: eval_accuracy must be a fraction in [0, 1], got {accuracy}")
        self._emit("event", C.EVAL_ACCURACY, accuracy, {C.EPOCH_NUM: samples})

    def quorum(self, samples: int, replicas: int, step: int) -> None:
        """dist.fault_tolerance (open division only): the step's quorum changed to ``replicas`` replicas."""
        self._expect(QUORUM_KEY, (_RUNNING,))
        metadata = {C.EPOCH_NUM: _int("samples", samples), "step": _int("step", step)}
        self._emit("event", QUORUM_KEY, _int(QUORUM_KEY, replicas, least=1), metadata)

    def train_samples(self, samples: int) -> None:
        """Logs the samples trained in the whole run (once, before ``run_stop``)."""
        self._expect(C.TRAIN_SAMPLES, (_RUNNING,), once=True)
        self._emit("event", C.TRAIN_SAMPLES, self._advance(samples))

    def eval_samples(self, count: int) -> None:
        """Logs the size of the eval set (once, before ``run_stop``; 10,000 in MLPerf)."""
        self._expect(C.EVAL_SAMPLES, (_RUNNING,), once=True)
        self._emit("event", C.EVAL_SAMPLES, _int(C.EVAL_SAMPLES, count, least=1))

    def run_stop(self, samples: int, status: str) -> None:
        """Ends the run: ``status`` is ``"success"`` (target reached) or ``"aborted"``."""
        self._expect(C.RUN_STOP, (_RUNNING,))
        if status not in RUN_STATUSES:
            raise ValueError(f"MLPerf log: run_stop status must be one of {RUN_STATUSES}, got {status!r}")
        if missing := [key for key in (C.TRAIN_SAMPLES, C.EVAL_SAMPLES) if key not in self._done]:
            raise RuntimeError(f"MLPerf log: call {'() and '.join(missing)}() before run_stop()")
        self._advance(samples)
        self._emit("end", C.RUN_STOP, None, {C.STATUS: status})  # as NVIDIA's v4.0 logs
        self._phase = _STOPPED

    def _expect(self, key: str, phases: tuple[str, ...], once: bool = False) -> None:
        if self._phase not in phases:
            raise RuntimeError(f"MLPerf log: {key} is not allowed {self._phase}")
        if once and key in self._done:
            raise RuntimeError(f"MLPerf log: {key} was already logged; MLPerf wants it once")
        self._done.add(key)

    def _advance(self, samples: int) -> int:
        samples = _int("samples", samples)
        if samples < self._samples:
            raise ValueError(f"MLPerf log: samples went back from {self._samples} to {samples}")
        self._samples = samples
        return samples

    def _start_interval(self, name: str, key: str, samples: int, metadata: dict, value: Any = None) -> None:
        self._expect(key, (_RUNNING,))
        if name in self._open:
            raise RuntimeError(f"MLPerf log: {key} while the {name} opened at {self._open[name]} samples is still open")
        self._open[name] = self._advance(samples)
        self._emit("start", key, value, metadata, frames=1)

    def _stop_interval(self, name: str, key: str, samples: int, metadata: dict, value: Any = None) -> None:
        self._expect(key, (_RUNNING,))
        if name not in self._open:
            raise RuntimeError(f"MLPerf log: {key} without an open {name}")
        self._advance(samples)
        del self._open[name]
        self._emit("end", key, value, metadata, frames=1)

    def _emit(self, kind: str, key: str, value: Any = None, metadata: dict | None = None, frames: int = 0) -> None:
        """Writes one line; ``frames``: the helper calls between the public method and here."""
        if self._mllog is None:  # not rank 0, or closed
            return
        getattr(self._mllog, kind)(key=key, value=value, metadata=metadata, stack_offset=_STACK_OFFSET + frames)


def _int(name: str, value: Any, least: int = 0) -> int:
    try:
        number = operator.index(value)  # accepts int-like (numpy, 0-d int tensors), not 2.5
    except TypeError:
        raise TypeError(f"MLPerf log: {name} must be an integer, got {value!r}") from None
    if number < least:
        raise ValueError(f"MLPerf log: {name} must be >= {least}, got {number}")
    return number


def _float(name: str, value: Any) -> float:
    number = float(value)  # mllog writes an error line instead of failing on a tensor
    if not math.isfinite(number):
        raise ValueError(f"MLPerf log: {name} must be finite, got {number}")
    return number


def _check_resumable(path: Path) -> None:
    """Checks that ``path`` holds a run that started and has not begun to end."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"MLPerf log: cannot resume {path}: {e.strerror or e}") from e
    if data and not data.endswith(b"\n"):
        # Killed while writing a line: drop the fragment, which the checker cannot parse.
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
        data = data[: data.rfind(b"\n") + 1]
    lines = data.decode("utf-8", errors="replace").splitlines()
    keys = {json.loads(line.partition(":::MLLOG ")[2])["key"] for line in lines if ":::MLLOG " in line}
    if C.RUN_START not in keys:
        raise UserError(f"MLPerf log: cannot resume {path}: it has no run_start")
    if ended := sorted(keys & {C.TRAIN_SAMPLES, C.EVAL_SAMPLES, C.RUN_STOP}):
        raise UserError(f"MLPerf log: cannot resume {path}: the run already ended (it has {', '.join(ended)})")
