"""Cross-rank rebalancing of sequence lengths, the exchange: moves the planned samples.

Between the loader and the collator, each step: one all-gather of a fixed-size header and one int32 word per sample
(length | masked count << 16), this rank's part of the plan (``data.rebalance.plan``), then ONE variable-size
``all_to_all_single`` of the samples that change rank (``pack_samples``); the block comes back ordered by (source rank,
source index). ``Rebalancer.start`` runs the exchange in a background thread on its own gloo group, ``wait`` returns it.
docs/rebalancing.md. Shapes: W ranks, B samples per rank.
"""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from common.errors import RunFailure
from data.batch_ramp import BatchRamp
from data.rebalance.fit import OnlineModel, length_features
from data.rebalance.plan import (
    DEFAULT_COST,
    HEADER_WORDS,
    MEASURE_WORDS,
    STRATEGIES,
    Cost,
    check_cost,
    context_plan_for_rank,
    plan_for_rank,
)
from data.samples import SampleBlock, _offsets


class RebalanceError(RunFailure):
    """Bad input or a failed collective; raised identically on every rank where possible."""


_MAGIC = 0x52424C31  # "RBL1": a header that does not start with it is not ours
_MAX_MASKED = (1 << 15) - 1
_MAX_TOKEN_ID = (1 << 30) - 1  # a token word is input_id * 2 + segment_id

_ERRORS = {
    1: "its batch is empty",
    2: "holds {value} samples, expected batch_size {batch_size}",
    3: "sample {index} has length {value} (must be 1..{max_len})",
    4: "input_ids/segment_ids have {value} tokens, but seq_lens sum to another number",
    5: "sample {index} has {value} masked positions (must be 0..its length)",
    6: "masked_positions/masked_ids have {value} entries, but masked_counts sum to another number",
    7: "sample {index} has masked position {value}, outside the sample",
    8: "sample {index} has token id {value} (must be 0..2**30-1)",
    9: "sample {index} has segment id {value} (must be 0 or 1)",
    10: "sample {index} has NSP label {value} (must be 0 or 1)",
    11: "masked_counts or nsp_labels have {value} entries, not one per sample",
}


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[i], starts[i] + counts[i]) over i, vectorised."""
    counts = counts.astype(np.int64)
    return np.repeat(starts.astype(np.int64) - _offsets(counts)[:-1], counts) + np.arange(counts.sum())


def _sample_of(offsets: np.ndarray, element: int) -> int:
    return int(np.searchsorted(offsets, element, side="right") - 1)


def check_block(block: SampleBlock, batch_size: int, max_len: int) -> tuple[int, int, int]:
    """(error code, sample index, value) of the first problem in ``block``; (0, 0, 0) if none."""
    n = len(block)
    if n == 0:
        return 1, 0, 0
    if n != batch_size:
        return 2, 0, n
    if len(block.masked_counts) != n or len(block.nsp_labels) != n:
        return 11, 0, len(block.masked_counts) if len(block.masked_counts) != n else len(block.nsp_labels)
    L = block.seq_lens.astype(np.int64)
    if len(bad := np.flatnonzero((L < 1) | (L > max_len))):
        return 3, int(bad[0]), int(L[bad[0]])
    if L.sum() != len(block.input_ids) or L.sum() != len(block.segment_ids):
        return 4, 0, len(block.input_ids)
    m = block.masked_counts.astype(np.int64)
    if len(bad := np.flatnonzero((m < 0) | (m > L) | (m > _MAX_MASKED))):
        return 5, int(bad[0]), int(m[bad[0]])
    if m.sum() != len(block.masked_positions) or m.sum() != len(block.masked_ids):
        return 6, 0, len(block.masked_positions)
    pos = block.masked_positions.astype(np.int64)
    if len(bad := np.flatnonzero((pos < 0) | (pos >= np.repeat(L, m)))):
        return 7, _sample_of(_offsets(m), bad[0]), int(pos[bad[0]])
    tok_off = _offsets(L)
    for code, values, hi in ((8, block.input_ids, _MAX_TOKEN_ID), (9, block.segment_ids, 1)):
        v = values.astype(np.int64)
        if len(bad := np.flatnonzero((v < 0) | (v > hi))):
            return code, _sample_of(tok_off, bad[0]), int(v[bad[0]])
    nsp = block.nsp_labels.astype(np.int64)
    if len(bad := np.flatnonzero((nsp < 0) | (nsp > 1))):
        return 10, int(bad[0]), int(nsp[bad[0]])
    return 0, 0, 0


def pack_samples(block: SampleBlock, idx: np.ndarray) -> np.ndarray:
    """int32 words of samples ``idx``, each [nsp, L x (id*2 + segment), m positions, m ids]."""
    sel = block.select(idx)
    L, m = sel.seq_lens.astype(np.int64), sel.masked_counts.astype(np.int64)
    starts = _offsets(1 + L + 2 * m)
    out = np.empty(int(starts[-1]), dtype=np.int32)
    starts = starts[:-1]
    out[starts] = sel.nsp_labels
    out[_ranges(starts + 1, L)] = sel.input_ids.astype(np.int32) * 2 + sel.segment_ids
    pos_at = _ranges(starts + 1 + L, m)
    out[pos_at] = sel.masked_positions
    out[pos_at + np.repeat(m, m)] = sel.masked_ids
    return out


def unpack_samples(
    words: np.ndarray, seq_lens: np.ndarray, masked_counts: np.ndarray, like: SampleBlock
) -> SampleBlock:
    """Inverse of ``pack_samples`` given each sample's length and masked count; dtypes of ``like``."""
    L, m = seq_lens.astype(np.int64), masked_counts.astype(np.int64)
    starts = _offsets(1 + L + 2 * m)
    if int(starts[-1]) != len(words):
        raise RebalanceError(f"received {len(words)} words, the plan expects {int(starts[-1])}")
    starts = starts[:-1]
    tok = words[_ranges(starts + 1, L)]
    pos_at = _ranges(starts + 1 + L, m)
    return SampleBlock(
        input_ids=(tok >> 1).astype(like.input_ids.dtype),
        segment_ids=(tok & 1).astype(like.segment_ids.dtype),
        seq_lens=seq_lens.astype(like.seq_lens.dtype),
        masked_positions=words[pos_at].astype(like.masked_positions.dtype),
        masked_ids=words[pos_at + np.repeat(m, m)].astype(like.masked_ids.dtype),
        masked_counts=masked_counts.astype(like.masked_counts.dtype),
        nsp_labels=words[starts].astype(like.nsp_labels.dtype),
    )


@dataclass
class ExchangeStats:
    """One step of rebalancing; metrics.jsonl carries its fields (``bert.report.metrics.REBALANCE_FIELDS``)."""

    step: int
    strategy: str
    imbalance_before: float
    imbalance_after: float  # planned, with group_size (see RankPlan)
    samples_moved: int | None  # over all ranks; None with group_size (each rank plans its group)
    samples_sent: int  # this rank
    samples_received: int
    token_share: float  # this rank's tokens after the exchange over the mean rank's
    assign_ms: float
    exchange_ms: float  # gather, assign and all-to-all, start to finish
    wait_ms: float  # how long the caller blocked for the result
    # The collectives' share (0 where the plan is made from a batch every replica holds: ReplicaPlanner)
    gather_bytes_received: int = 0  # the all-gathered headers and lengths, this rank
    payload_bytes_sent: int = 0  # the all-to-all, this rank
    payload_bytes_received: int = 0
    gather_ms: float = 0.0
    all_to_all_ms: float = 0.0
    hidden_fraction: float = 0.0  # 1 - wait_ms / exchange_ms, in [0, 1]
    fit: dict = field(default_factory=dict)  # measured: the cost and speeds the next plan uses


class Rebalancer:
    """Balances sequence lengths across the ranks, one exchange per step.

    strategy: one of ``STRATEGIES``; cost: a ``data.rebalance.plan.Cost`` or its tuple.
    batch_size: samples every rank brings per step (``measured`` may hand one back fewer or more); with
        ``ramp`` (a ``data.batch_ramp.BatchRamp``) step s holds ``ramp.batch_size(s) / world_size`` instead.
    max_len: the longest allowed sequence. world_size: how many ranks this rank expects (default: the
        group's size); a rank expecting another number is named in the error.
    group_size, cross_rounds, tol: see ``assign``; with group_size each rank plans only its group's part.
    timeout_s: the timeout of the exchange's own gloo group: a rank that stops calling the exchange
        turns into a ``RebalanceError`` on the others, never a hang. Constructing a Rebalancer is
        collective: every rank, in the same order relative to other ``new_group`` calls.
    measured: (window steps, bound, rate) of the ``OnlineModel``; ``timer`` (a
        ``bert.train.step_timer.StepTimer``, set by the caller) feeds it; without one it plans as ``balanced``.
    max_share, min_samples: ``measured`` with unequal speeds: a rank ends a step holding from min_samples
        (e.g. its micro-batches) to max_share times batch_size samples; 1: swaps only (``assign``'s max_samples).
    context: (N, threshold) of dist.context_parallel: the plan is ``place_context``'s (balanced only)."""

    def __init__(
        self,
        strategy: str = "balanced",
        cost: Cost | tuple = DEFAULT_COST,
        *,
        batch_size: int,
        max_len: int = 512,
        world_size: int | None = None,
        timeout_s: float = 120.0,
        tol: float = 1e-3,
        group_size: int | None = None,
        cross_rounds: int = 3,
        ramp: BatchRamp | None = None,
        measured: tuple = (32, 4.0, 0.1),
        max_share: float = 2.0,
        min_samples: int = 1,
        context: tuple[int, int] | None = None,
    ):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
        if not 1 <= max_len <= 0xFFFF:
            raise ValueError(f"max_len: expected 1..65535, got {max_len}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
        if not (1 <= max_share < float("inf") and 1 <= min_samples <= batch_size):
            raise ValueError(
                f"max_share, min_samples: expected >= 1 and 1..{batch_size}, got {max_share}, {min_samples}"
            )
        cost = check_cost(cost)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Rebalancer: torch.distributed is not initialised (call launch.distributed first)")
        self.strategy, self.cost, self.tol, self.ramp = strategy, cost, tol, ramp
        self.batch_size, self.max_len, self.timeout_s = batch_size, max_len, timeout_s
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.group, self.rank, self.world_size = group, dist.get_rank(group), dist.get_world_size(group)
        self.expected_world_size = self.world_size if world_size is None else int(world_size)
        if group_size is not None and (group_size < 1 or self.world_size % group_size):
            raise ValueError(f"group_size: {group_size} does not divide the world size {self.world_size}")
        if cross_rounds < 0:
            raise ValueError(f"cross_rounds: expected >= 0, got {cross_rounds}")
        self.group_size, self.cross_rounds = group_size, cross_rounds
        self.measured, self.timer = tuple(measured), None
        self.max_share, self.min_samples = float(max_share), int(min_samples)
        self.context = tuple(context) if context is not None else None
        if self.context is not None and (strategy != "balanced" or self.world_size % self.context[0]):
            raise ValueError(f"context: {self.context} needs strategy balanced and N dividing the world size")
        self.online = OnlineModel(cost, self.world_size, *measured)  # the cost and speeds the plans use
        self._delivered: dict[int, tuple] = {}  # this rank's blocks' length features, by step
        self._snapshot = None  # the state the pending exchange started from (state_dict)
        self._next_step, self._result = 0, None
        self._thread: threading.Thread | None = None
        self._check_settings_agree()

    # -- collectives -------------------------------------------------------------------------
    def _collective(self, what: str, step: int, fn):
        try:
            return fn()
        except Exception as e:  # gloo reports timeouts and lost peers as RuntimeError
            raise RebalanceError(
                f"rebalance step {step}: rank {self.rank}: {what} failed (group timeout "
                f"{self.timeout_s:g} s; did another rank stop calling the exchange?): {e}"
            ) from e

    def _all_gather(self, words: np.ndarray, step: int, what: str) -> np.ndarray:
        mine = torch.from_numpy(np.ascontiguousarray(words, dtype=np.int32))
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._collective(what, step, lambda: dist.all_gather(parts, mine, group=self.group))
        return torch.stack(parts).numpy()  # [W, len(words)]

    def _check_settings_agree(self) -> None:
        # Ranks with different settings would compute different plans; catch it once, here.
        settings = (*self.cost, self.tol, self.group_size, self.cross_rounds, self.ramp, self.measured)
        settings += (self.max_share, self.min_samples)
        crc = zlib.crc32(repr(settings).encode()) & 0x7FFFFFFF
        mine = [_MAGIC, STRATEGIES.index(self.strategy), crc, self.batch_size, self.max_len, self.expected_world_size]
        allv = self._all_gather(np.array(mine, dtype=np.int32), -1, "the settings check")
        problems = []
        for r in range(self.world_size):
            if allv[r, 0] != _MAGIC:
                problems.append(f"rank {r}: sent a header that is not a Rebalancer's")
                continue
            if allv[r, 1] != allv[0, 1]:
                problems.append(
                    f"rank {r}: strategy {STRATEGIES[allv[r, 1]]!r} differs from rank 0's {STRATEGIES[allv[0, 1]]!r}"
                )
            if allv[r, 2] != allv[0, 2]:
                problems.append(
                    f"rank {r}: cost, tol, group_size, cross_rounds, the batch ramp, measured, max_share or "
                    "min_samples differ from rank 0's"
                )
            for f, name in ((3, "batch_size"), (4, "max_len")):
                if allv[r, f] != allv[0, f]:
                    problems.append(f"rank {r}: {name} {allv[r, f]} differs from rank 0's {allv[0, f]}")
            if allv[r, 5] != self.world_size:
                problems.append(f"rank {r}: expects world size {allv[r, 5]}, the group has {self.world_size} ranks")
        if problems:
            raise RebalanceError("rebalance settings: " + "; ".join(problems))

    # -- one step ----------------------------------------------------------------------------
    def batch_size_at(self, step: int) -> int:
        """Samples per rank in ``step``: ``batch_size``, or the ramp's share of the step's batch."""
        return self.batch_size if self.ramp is None else self.ramp.batch_size(step) // self.world_size

    def _header(self, block: SampleBlock, step: int, measure) -> np.ndarray:
        code, index, value = check_block(block, self.batch_size_at(step), self.max_len)
        words = np.zeros(HEADER_WORDS + self.batch_size_at(step), dtype=np.int64)
        words[:HEADER_WORDS] = (_MAGIC, step, self.expected_world_size, len(block), code, index, value)
        if code == 0:
            words[HEADER_WORDS:] = block.seq_lens.astype(np.int64) | (block.masked_counts.astype(np.int64) << 16)
        words = words.astype(np.int32)
        if self.strategy != "measured":
            return words
        # The measured step (-1: none yet), then its seconds and length features as float64 bits.
        m = np.full(MEASURE_WORDS, -1, np.int32)
        if measure is not None:
            m[0], m[1:] = measure[0], np.array(measure[1:], np.float64).view(np.int32)
        return np.concatenate([words[:HEADER_WORDS], m, words[HEADER_WORDS:]])

    def _raise_bad_input(self, hdr: np.ndarray, step: int) -> None:
        problems = []
        for r in range(self.world_size):
            if hdr[r, 0] != _MAGIC:
                problems.append(f"rank {r}: sent a header that is not a Rebalancer's")
            elif hdr[r, 2] != self.world_size:
                problems.append(f"rank {r}: expects world size {hdr[r, 2]}, the group has {self.world_size} ranks")
            elif hdr[r, 4] != 0:
                text = _ERRORS.get(int(hdr[r, 4]), "error code {code}")
                facts = dict(index=hdr[r, 5], value=hdr[r, 6], code=hdr[r, 4], max_len=self.max_len)
                problems.append(f"rank {r}: " + text.format(**facts, batch_size=self.batch_size_at(step)))
        steps = hdr[:, 1].tolist()
        if len(set(steps)) > 1:
            problems.append(
                "ranks disagree on the step: " + ", ".join(f"rank {r} at step {s}" for r, s in enumerate(steps))
            )
        if problems:
            more = f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
            raise RebalanceError(f"rebalance step {step}: " + "; ".join(problems[:4]) + more)

    def _exchange(self, block: SampleBlock, step: int, measure) -> tuple[SampleBlock, ExchangeStats]:
        W, B, me = self.world_size, self.batch_size_at(step), self.rank
        t0 = time.perf_counter()
        hdr = self._all_gather(self._header(block, step, measure), step, "the length all-gather")
        t1 = time.perf_counter()
        self._raise_bad_input(hdr, step)
        at = HEADER_WORDS + (MEASURE_WORDS if self.strategy == "measured" else 0)
        words = hdr[:, at:].astype(np.int64)  # [W, B]
        lengths, masked = words & 0xFFFF, words >> 16
        opts = dict(tol=self.tol, group_size=self.group_size, cross_rounds=self.cross_rounds)
        if self.strategy == "measured":
            bounds = dict(max_samples=int(B * self.max_share), min_samples=min(self.min_samples, B))
            opts.update(speeds=self.online.speeds, **bounds)
        if self.context is not None:
            plan = context_plan_for_rank(lengths, me, *self.context, self.online.cost)
        else:
            plan = plan_for_rank(lengths, me, self.strategy, self.online.cost, **opts)
        t2 = time.perf_counter()

        sizes = 1 + lengths + 2 * masked  # [W, B] int32 words per packed sample
        send_idx, recv_r, recv_i = plan.send_index, plan.recv_rank, plan.recv_index
        in_splits = np.bincount(plan.send_dest, weights=sizes[me, send_idx], minlength=W).astype(np.int64)
        out_splits = np.bincount(recv_r, weights=sizes[recv_r, recv_i], minlength=W).astype(np.int64)
        received = None
        if self.strategy != "none":  # every rank takes part, even with nothing to send
            send = torch.from_numpy(pack_samples(block, send_idx))
            recv = torch.empty(int(out_splits.sum()), dtype=torch.int32)

            def all_to_all():
                dist.all_to_all_single(recv, send, out_splits.tolist(), in_splits.tolist(), group=self.group)

            self._collective("the sample all-to-all", step, all_to_all)
            received = unpack_samples(recv.numpy(), lengths[recv_r, recv_i], masked[recv_r, recv_i], block)
        t3 = time.perf_counter()

        kept = np.setdiff1d(np.arange(B), send_idx, assume_unique=True)
        pool = SampleBlock.concat([block.select(kept), received]) if received is not None else block.select(kept)
        pool_gid = np.concatenate([me * B + kept, recv_r.astype(np.int64) * B + recv_i])
        out = pool.select(np.argsort(pool_gid, kind="stable"))  # by (source rank, source index)
        fit = self._learn(hdr[:, HEADER_WORDS:at]) if self.strategy == "measured" else {}
        self._delivered[step] = length_features(out.seq_lens, self.cost.window)
        t4 = time.perf_counter()
        ms = lambda a, b: (b - a) * 1e3  # noqa: E731
        return out, ExchangeStats(
            step=step,
            strategy=self.strategy,
            imbalance_before=plan.imbalance_before,
            imbalance_after=plan.imbalance_after,
            samples_moved=plan.moved,
            samples_sent=len(send_idx),
            samples_received=len(recv_r),
            token_share=float(out.seq_lens.sum()) * W / max(int(lengths.sum()), 1),
            assign_ms=ms(t1, t2),
            exchange_ms=ms(t0, t4),
            wait_ms=ms(t0, t4),
            gather_bytes_received=int(hdr.size * 4),
            payload_bytes_sent=int(in_splits.sum() * 4),
            payload_bytes_received=int(out_splits.sum() * 4),
            gather_ms=ms(t0, t1),
            all_to_all_ms=ms(t2, t3),
            fit=fit,
        )

    # -- measured: the window, the fit, the state -------------------------------------------
    def _measurement(self, step: int):
        """(step, seconds, *features) of this rank's newest measured step, or None, as the
        exchange of ``step`` begins (the caller's thread); snapshots the state it plans from."""
        self._snapshot = self.online.state_dict()
        got = [(k, t) for k, t in (self.timer.ready() if self.timer else []) if k in self._delivered and t > 0]
        for k in [k for k in self._delivered if k < step - 16]:
            del self._delivered[k]
        return (got[-1][0], got[-1][1], *self._delivered[got[-1][0]]) if got else None

    def _learn(self, words: np.ndarray) -> dict:
        """The gathered measurements [W, MEASURE_WORDS] into the window; the refit's numbers."""
        values = words[:, 1:].copy().view(np.float64)  # [W, 4]: seconds, then the features
        for r in np.flatnonzero(words[:, 0] >= 0):
            self.online.add(r, values[r, 1:], float(values[r, 0]))
        return self.online.refit()

    def state_dict(self) -> dict:
        """``measured``: the ``OnlineModel`` state the pending (or next) exchange plans from."""
        return {"rebalance": self._snapshot or self.online.state_dict()} if self.strategy == "measured" else {}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()`` (one of another world size is left out)."""
        if self.strategy == "measured" and state.get("rebalance"):
            self.online.load_state_dict(state["rebalance"])

    def _begin(self, step: int | None) -> tuple[int, tuple | None]:
        s = self._next_step if step is None else int(step)
        self._next_step = s + 1
        return s, self._measurement(s)

    def exchange(self, block: SampleBlock, step: int | None = None) -> tuple[SampleBlock, ExchangeStats]:
        """Rebalance ``block`` now (blocking); ``step`` defaults to one more than the last."""
        if self._thread is not None:
            raise RuntimeError("Rebalancer.exchange: an exchange started with start() is pending; wait() first")
        s, measure = self._begin(step)
        out = self._exchange(block, s, measure)
        self._snapshot = None  # done: the next exchange plans from the live state
        if self.timer:
            self.timer.mark(s)
        return out

    @property
    def pending(self) -> bool:
        """An exchange was started and not yet collected with ``wait()``."""
        return self._thread is not None

    def start(self, block: SampleBlock, step: int | None = None) -> None:
        """Begin rebalancing ``block`` in the background (e.g. the next step's, during this one)."""
        if self._thread is not None:
            raise RuntimeError("Rebalancer.start: the previous exchange was not collected with wait()")
        s, measure = self._begin(step)

        def run():
            try:
                self._result = self._exchange(block, s, measure)
            except BaseException as e:  # re-raised in wait(), on the caller's thread
                self._result = e

        self._result = None
        self._thread = threading.Thread(target=run, name=f"rebalance-step-{s}", daemon=True)
        self._thread.start()

    def wait(self) -> tuple[SampleBlock, ExchangeStats]:
        """The result of ``start``; re-raises its error. Records how long this call blocked."""
        if self._thread is None:
            raise RuntimeError("Rebalancer.wait: nothing was started")
        t0 = time.perf_counter()
        # Each collective times out after timeout_s (three at most): this bound is for a thread stuck outside them.
        most = 4 * self.timeout_s + 30
        self._thread.join(timeout=most)
        waited = (time.perf_counter() - t0) * 1e3
        if self._thread.is_alive():
            raise RebalanceError(f"rebalance: rank {self.rank}: the exchange thread did not finish within {most:g} s")
        self._thread, result, self._result = None, self._result, None
        if isinstance(result, BaseException):
            raise result
        out, stats = result
        if self.timer:
            self.timer.mark(stats.step)
        stats.wait_ms = waited
        stats.hidden_fraction = float(min(1.0, max(0.0, 1.0 - waited / max(stats.exchange_ms, 1e-9))))
        return out, stats
