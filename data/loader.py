"""Rank-sharded loading of prepared HDF5 shards, with prefetch and exact resume.

``PretrainingLoader`` gives rank r its G / W samples of every global step; which samples form
step t depends only on the files, the seed, G and the lanes L, never on W (nor on a resume,
``state_dict``). Shards are read ahead in a thread and validated as read (``data.hdf5io``).
``EvalLoader`` gives rank r a contiguous slice of the eval file. The plan and
``on_corrupt=skip``'s replacement rule (the same on every W): docs/data.md#loading.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import DataError
from data.batch import PaddedBatch, UnpaddedBatch
from data.collate import LAYOUTS, check_backend, collate_padded, collate_unpadded
from data.dali_loader import DaliCollator
from data.hdf5io import inspect, list_files, read_file, read_valid
from data.packing import collate_packed
from data.samples import SampleBlock, _offsets

STATE_FORMAT = "PretrainingLoader/1"
ON_CORRUPT = ("fail", "skip")


def default_lanes(global_batch_size: int, cap: int = 16) -> int:
    """The largest divisor of the global batch size that is at most ``cap``."""
    return max(d for d in range(1, min(cap, global_batch_size) + 1) if global_batch_size % d == 0)


def dataset_vocab_size(path) -> int | None:
    """The vocabulary size recorded by ``data.prepare`` in a manifest.json at or above path."""
    p = Path(path)
    for d in (p, p.parent, p.parent.parent):
        m = d / "manifest.json"
        if m.is_file():
            try:
                return int(json.loads(m.read_text())["vocab"]["size"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise DataError(f"{m}: cannot read the vocabulary size ({e})") from e
    return None


def make_collator(
    backend: str = "torch",
    layout: str = "unpadded",
    seq_len: int | None = None,
    device_id: int | None = None,
    max_batch_size: int = 1024,
) -> Callable[[SampleBlock], UnpaddedBatch | PaddedBatch]:
    """A function SampleBlock -> batch. backend: ``torch`` (``data.collate``, ``data.packing``) or
    ``dali`` (a DALI pipeline: ``device_id`` None runs it on the CPU, an int on that GPU, where its
    batches then live). layout: ``unpadded``, ``padded`` or ``packed`` (``seq_len`` required: the
    padded length or the row length; ``packed``: first-fit decreasing, torch backend only)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    if layout in ("padded", "packed") and seq_len is None:
        raise ValueError(f"layout {layout!r} needs seq_len")
    if backend == "torch":
        if device_id is not None:
            raise ValueError("backend 'torch' collates on the CPU; move the batch with batch.to(device)")
        if layout == "unpadded":
            return collate_unpadded
        if layout == "packed":
            return lambda block: collate_packed(block, seq_len)
        return lambda block: collate_padded(block, seq_len)
    if layout == "packed":
        raise ValueError(f"layout 'packed' collates with backend 'torch' only, not {backend!r}")
    check_backend(backend)
    return DaliCollator(layout=layout, seq_len=seq_len, device_id=device_id, max_batch_size=max_batch_size)


def _rows(files: np.ndarray, offsets: np.ndarray, row_order) -> np.ndarray:
    """The row in its file of each sample at (file, offset in ``row_order(file)``)."""
    rows = np.empty_like(offsets)
    for f in np.unique(files):
        sel = files == f
        rows[sel] = row_order(int(f))[offsets[sel]]
    return rows


@dataclass(frozen=True, order=True)
class _Entry:
    """File ``file`` (an index into the file list) is needed in epoch ``epoch`` from step
    ``first`` to step ``last`` of the epoch; ``order`` is its place in the epoch's stream."""

    epoch: int
    first: int
    order: int
    last: int
    file: int


class _Plan:
    """The pure arithmetic of the sample order (no I/O)."""

    def __init__(self, sizes: np.ndarray, global_batch_size: int, lanes: int, seed: int, rank: int, world_size: int):
        self.sizes, self.seed = sizes, seed
        self.lane_batch = global_batch_size // lanes
        self.steps_per_epoch = int(sizes.sum()) // global_batch_size
        self.lane_len = self.steps_per_epoch * self.lane_batch
        q0, q1 = rank * global_batch_size // world_size, (rank + 1) * global_batch_size // world_size
        # (lane, k0, k1): this rank takes lane samples [k0, k1) of every step.
        self.parts = []
        for lane in range(lanes):
            lo, hi = max(q0, lane * self.lane_batch), min(q1, (lane + 1) * self.lane_batch)
            if lo < hi:
                self.parts.append((lane, lo - lane * self.lane_batch, hi - lane * self.lane_batch))
        self._epoch_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(file order, start of each of those files in the stream [F+1])."""
        if epoch not in self._epoch_cache:
            if len(self._epoch_cache) > 2:
                self._epoch_cache.pop(min(self._epoch_cache))
            perm = np.random.default_rng([self.seed, 0, epoch]).permutation(len(self.sizes))
            self._epoch_cache[epoch] = (perm, _offsets(self.sizes[perm]))
        return self._epoch_cache[epoch]

    def row_order(self, epoch: int, file: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 1, epoch, file]).permutation(int(self.sizes[file]))

    def locate(self, step: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(epoch, file index, offset in the file's row order) of this rank's samples at global
        step ``step``, in batch order."""
        epoch, s = divmod(step, self.steps_per_epoch)
        pos = [lane * self.lane_len + s * self.lane_batch + np.arange(k0, k1) for lane, k0, k1 in self.parts]
        positions = np.concatenate(pos)  # in the epoch's stream
        perm, starts = self.epoch_order(epoch)
        i = np.searchsorted(starts, positions, side="right") - 1
        return epoch, perm[i], positions - starts[i]

    def entries(self, epoch: int) -> list[_Entry]:
        """The files this rank reads in ``epoch``, in the order it first needs them."""
        perm, starts = self.epoch_order(epoch)
        found: dict[int, list[int]] = {}
        lb, spe = self.lane_batch, self.steps_per_epoch
        for lane, k0, k1 in self.parts:
            base = lane * self.lane_len
            first_i = max(0, int(np.searchsorted(starts, base, side="right")) - 1)
            last_i = int(np.searchsorted(starts, base + self.lane_len, side="left"))
            for i in range(first_i, min(last_i, len(perm))):
                a, b = int(starts[i]) - base, int(starts[i + 1]) - base
                if a == b:
                    continue
                # Steps s whose positions s*lb + [k0, k1) meet the file's [a, b).
                s_min = max(0, (a - k1) // lb + 1)
                s_max = min(spe - 1, -((k0 - b) // lb) - 1)
                if s_min <= s_max:
                    f = found.setdefault(i, [s_min, s_max])
                    f[0], f[1] = min(f[0], s_min), max(f[1], s_max)
        return sorted(_Entry(epoch, lo, i, hi, int(perm[i])) for i, (lo, hi) in found.items())


class _Loaded:
    """A shard's samples with their offsets precomputed for fast selection."""

    def __init__(self, block: SampleBlock, index_of_row: np.ndarray | None = None):
        self.block = block
        self.tok_off, self.msk_off = _offsets(block.seq_lens), _offsets(block.masked_counts)
        self.rows, self.rows_epoch = None, -1  # the epoch's row order, set on first use
        # [rows in the file] -> index into block, -1 for a corrupt row; None: every row is there.
        self.index_of_row = index_of_row

    def valid(self, rows: np.ndarray) -> np.ndarray:
        if self.index_of_row is None:
            return np.ones(len(rows), dtype=bool)
        return self.index_of_row[rows] >= 0

    def select(self, idx: np.ndarray) -> SampleBlock:
        """The samples at file rows ``idx`` (all valid)."""
        if self.index_of_row is not None:
            idx = self.index_of_row[idx]
        return self.block.select(idx, (self.tok_off, self.msk_off))


class PretrainingLoader:
    """This rank's SampleBlock for each global step (G / W samples), forever.

    train_dir_or_files: a directory of ``.hdf5`` shards (fixed or varlength layout) or a list.
    global_batch_size: G, samples per optimizer step over all ranks; world_size must divide it.
    seed: fixes the order of files and samples (together with the files, G and lanes).
    lanes: L, must divide G; default ``default_lanes(G)``. Keep it when resuming.
    backend: ``torch`` or ``dali``, the collation that ``batches()`` uses.
    prefetch: read the next shard in a background thread (False: read when needed).
    prefetch_files: how many shards to read ahead (default: one per lane of this rank).
    vocab_size: token ids are checked against it (default: from the dataset's manifest).
    max_seq_length: every shard's sequence lengths are checked against it as it is read.
    ``next_sentence`` (after construction): False for masked-LM-only shards, whose batches carry
        nsp labels 0 (``data.prepare --objective mlm``); every file must agree.
    on_corrupt: ``fail`` (raise on a corrupt sample) or ``skip`` (replace and count it;
        docs/data.md#loading). warn: called with a one-line message for each corrupt file (skip).
    """

    def __init__(
        self,
        train_dir_or_files,
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        *,
        lanes: int | None = None,
        backend: str = "torch",
        prefetch: bool = True,
        prefetch_files: int | None = None,
        vocab_size: int | None = None,
        max_seq_length: int | None = None,
        on_corrupt: str = "fail",
        warn=None,
    ):
        if on_corrupt not in ON_CORRUPT:
            raise ValueError(f"on_corrupt {on_corrupt!r}: expected one of {', '.join(ON_CORRUPT)}")
        self.on_corrupt = on_corrupt
        self._warn = warn or (lambda message: None)
        self._substituted: dict[int, int] = {}  # step -> samples of this rank's block replaced
        self._spares: dict[int, _Loaded] = {}  # shards read only to take replacements from
        self.files = list_files(train_dir_or_files)
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size {global_batch_size}: must be >= 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of world_size {world_size}: need 0 <= rank < world_size")
        if global_batch_size % world_size:
            raise ValueError(f"world_size {world_size} must divide global_batch_size {global_batch_size}")
        self.lanes = default_lanes(global_batch_size) if lanes is None else lanes
        if self.lanes < 1 or global_batch_size % self.lanes:
            raise ValueError(f"lanes {self.lanes} must divide global_batch_size {global_batch_size}")
        check_backend(backend)
        if seed < 0:
            raise ValueError(f"seed {seed}: must be >= 0")
        self.global_batch_size = global_batch_size
        self.rank, self.world_size, self.seed, self.backend = rank, world_size, seed, backend
        self.local_batch_size = global_batch_size // world_size
        if vocab_size is None and isinstance(train_dir_or_files, (str, Path)):
            vocab_size = dataset_vocab_size(train_dir_or_files)
        self.vocab_size, self.max_seq_length = vocab_size, max_seq_length
        infos = []
        for f in self.files:
            try:
                infos.append(inspect(f))
            except DataError as e:
                if on_corrupt == "fail":
                    raise
                self._warn(f"{e}; leaving the file out (data.on_corrupt=skip)")
        if not infos:
            raise DataError(f"{self.files[0].parent}: none of the {len(self.files)} training files can be read")
        self.next_sentence = infos[0].next_sentence
        odd = next((i for i in infos if i.next_sentence != self.next_sentence), None)
        if odd is not None:
            kinds = {True: "has next_sentence_labels", False: "is masked-LM only (no next_sentence_labels)"}
            raise DataError(f"{odd.path}: {kinds[odd.next_sentence]}, but {infos[0].path} {kinds[self.next_sentence]}")
        self.files = [Path(i.path) for i in infos]
        self.sizes = np.array([i.num_samples for i in infos], dtype=np.int64)
        if int(self.sizes.sum()) < global_batch_size:
            raise DataError(
                f"{self.files[0].parent}: {int(self.sizes.sum())} samples in {len(self.files)} file(s) "
                f"cannot fill one global batch of {global_batch_size}"
            )
        self._plan = _Plan(self.sizes, global_batch_size, self.lanes, seed, rank, world_size)
        self.prefetch_files = len(self._plan.parts) if prefetch_files is None else prefetch_files
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="data-prefetch") if prefetch else None
        self._step = 0
        self._reset()

    # ------------------------------------------------------------------ plan queries
    @property
    def steps_per_epoch(self) -> int:
        return self._plan.steps_per_epoch

    @property
    def step(self) -> int:
        """The global step whose batch the iterator yields next."""
        return self._step

    def sample_ids(self, step: int, rank: int | None = None, world_size: int | None = None) -> np.ndarray:
        """[n, 2] (file index, row in the file) of the samples a rank gets at ``step``
        (default this rank; ``world_size=1`` gives the whole global batch)."""
        plan = self._plan_for(rank, world_size)
        epoch, files, offsets = plan.locate(step)
        return np.stack([files, _rows(files, offsets, lambda f: plan.row_order(epoch, f))], axis=1)

    def files_read(self, epoch: int, rank: int | None = None, world_size: int | None = None) -> list[int]:
        """Indices of the files a rank reads in ``epoch``, in reading order."""
        return [e.file for e in self._plan_for(rank, world_size).entries(epoch)]

    def _plan_for(self, rank, world_size) -> _Plan:
        """The plan of ``rank`` of ``world_size`` (default this rank; ``world_size`` alone: rank 0)."""
        w = self.world_size if world_size is None else world_size
        r = (self.rank if world_size is None else 0) if rank is None else rank
        return _Plan(self.sizes, self.global_batch_size, self.lanes, self.seed, r, w)

    # ---------------------------------------------------------------------- loading
    def _read(self, file: int) -> _Loaded:
        path, n = self.files[file], int(self.sizes[file])
        if self.on_corrupt == "fail":
            block = read_file(path, vocab_size=self.vocab_size, max_seq_length=self.max_seq_length)
            if len(block) != n:
                raise DataError(f"{path}: holds {len(block)} samples, {n} when the run started")
            return _Loaded(block)
        block, rows, problems = read_valid(path, vocab_size=self.vocab_size, max_seq_length=self.max_seq_length)
        if not problems and len(rows) == n:
            return _Loaded(block)
        index = np.full(n, -1, dtype=np.int64)
        inside = rows < n
        index[rows[inside]] = np.flatnonzero(inside)
        bad = int((index < 0).sum())
        shown = "; ".join(p.removeprefix(f"{path}: ") for p in problems[:3])
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        self._warn(f"{path}: {bad} of {n} samples corrupt, skipped (data.on_corrupt=skip): {shown}{more}")
        return _Loaded(block, index)

    def _row_order(self, loaded: _Loaded, epoch: int, file: int) -> np.ndarray:
        if loaded.rows_epoch != epoch:
            loaded.rows, loaded.rows_epoch = self._plan.row_order(epoch, file), epoch
        return loaded.rows

    def _spare(self, file: int) -> _Loaded:
        if file not in self._spares:
            if len(self._spares) >= 2:
                self._spares.pop(next(iter(self._spares)))
            self._spares[file] = self._read(file)
        return self._spares[file]

    def _gather(self, epoch: int, files: np.ndarray, offsets: np.ndarray, get) -> tuple[SampleBlock, int]:
        """The samples at (file, offset in the epoch's row order), in order; ``get(file)`` gives a
        shard. Returns the block and how many corrupt samples were replaced."""
        files = files.copy()
        rows = _rows(files, offsets, lambda f: self._row_order(get(f), epoch, f))
        replaced = 0
        for f in np.unique(files):  # corrupt rows: only with on_corrupt=skip
            sel = np.flatnonzero(files == f)
            bad = sel[~get(int(f)).valid(rows[sel])]
            for i in bad:
                files[i], rows[i] = self._next_valid(epoch, int(files[i]), int(offsets[i]), get)
            replaced += len(bad)
        # Runs of consecutive samples from the same file, in batch order.
        cut = np.flatnonzero(files[1:] != files[:-1]) + 1
        parts = [get(int(f[0])).select(r) for f, r in zip(np.split(files, cut), np.split(rows, cut))]
        return (parts[0] if len(parts) == 1 else SampleBlock.concat(parts)), replaced

    def _next_valid(self, epoch: int, file: int, offset: int, get) -> tuple[int, int]:
        """(file, row) of the first valid sample after stream position (file, offset)."""
        perm, _ = self._plan.epoch_order(epoch)
        i = int(np.flatnonzero(perm == file)[0])
        start = offset + 1
        for _ in range(len(perm) + 1):
            f = int(perm[i])
            loaded = get(f)
            order = self._row_order(loaded, epoch, f)[start:]
            ok = loaded.valid(order)
            if ok.any():
                return f, int(order[int(np.argmax(ok))])
            i, start = (i + 1) % len(perm), 0
        raise DataError(f"{self.files[0].parent}: no valid training sample left to replace the corrupt ones")

    def pop_substituted(self, step: int) -> int:
        """Corrupt samples replaced in this rank's block of ``step`` (0 when none or not yet read)."""
        return self._substituted.pop(step, 0)

    def _reset(self) -> None:
        """Forget loaded shards and restart the reading queue at self._step."""
        for fut in getattr(self, "_loaded", {}).values():
            fut.cancel()
        self._loaded: dict[tuple[int, int], Future] = {}  # (epoch, file) -> _Loaded
        self._entries: dict[tuple[int, int], _Entry] = {}  # (epoch, file) -> the steps that need it
        self._queue: list[_Entry] = []
        self._queued_epoch = self._step // self.steps_per_epoch - 1

    def _extend_queue(self, epoch: int, step_in_epoch: int) -> None:
        while self._queued_epoch < epoch:
            self._queued_epoch += 1
            e = self._queued_epoch
            self._queue.extend(x for x in self._plan.entries(e) if not (e == epoch and x.last < step_in_epoch))

    def _submit(self, entry: _Entry) -> None:
        key = (entry.epoch, entry.file)
        self._entries[key] = entry
        if self._executor is None:
            fut: Future = Future()
            fut.set_result(self._read(entry.file))
        else:
            fut = self._executor.submit(self._read, entry.file)
        self._loaded[key] = fut

    def _shards_for(self, epoch: int, s: int) -> None:
        """Submit what step s needs, then read ahead up to prefetch_files more shards."""
        self._extend_queue(epoch, s)
        while self._queue and (self._queue[0].epoch, self._queue[0].first) <= (epoch, s):
            self._submit(self._queue.pop(0))
        if self._executor is None:
            return
        ahead = sum(1 for x in self._entries.values() if (x.epoch, x.first) > (epoch, s))
        for _ in range(self.prefetch_files - ahead):
            if not self._queue:
                self._extend_queue(self._queued_epoch + 1, 0)
            self._submit(self._queue.pop(0))

    def _evict(self, epoch: int, s: int) -> None:
        """Drop the shards whose last step is s or earlier."""
        for key in [k for k, x in self._entries.items() if (x.epoch, x.last) <= (epoch, s)]:
            del self._loaded[key], self._entries[key]

    def _block(self, step: int) -> SampleBlock:
        epoch, s = divmod(step, self.steps_per_epoch)
        self._shards_for(epoch, s)
        _, files, offsets = self._plan.locate(step)

        def get(f: int) -> _Loaded:
            fut = self._loaded.get((epoch, f))
            return fut.result() if fut is not None else self._spare(f)

        block, replaced = self._gather(epoch, files, offsets, get)
        if replaced:
            self._substituted[step] = replaced
        self._evict(epoch, s)
        return block

    # -------------------------------------------------------------------- iteration
    def __iter__(self):
        while True:
            block = self._block(self._step)
            self._step += 1
            yield block

    def batches(self, layout: str = "unpadded", seq_len: int | None = None, device_id: int | None = None):
        """Iterate collated batches (``UnpaddedBatch``, ``PaddedBatch`` or, layout ``packed``,
        ``PackedBatch`` with rows of seq_len) with this loader's backend."""
        collate = make_collator(self.backend, layout, seq_len, device_id, max_batch_size=self.local_batch_size)
        for block in self:
            yield collate(block)

    def global_batch(self, step: int) -> SampleBlock:
        """The whole global batch of ``step`` (all ranks' samples in rank order), read here."""
        epoch, files, offsets = self._plan_for(None, 1).locate(step)
        cache: dict[int, _Loaded] = {}

        def get(f: int) -> _Loaded:
            if f not in cache:
                fut = self._loaded.get((epoch, f))
                cache[f] = fut.result() if fut is not None and fut.done() else self._read(f)
            return cache[f]

        return self._gather(epoch, files, offsets, get)[0]

    # ------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {
            "format": STATE_FORMAT,
            "step": self._step,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "lanes": self.lanes,
            "files": [f.name for f in self.files],
            "sizes": self.sizes.tolist(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved step (any world_size); the plan must be the same."""
        if state.get("format") != STATE_FORMAT:
            raise DataError(f"loader state: format {state.get('format')!r}, expected {STATE_FORMAT!r}")
        mine = self.state_dict()
        for key in ("seed", "global_batch_size", "lanes", "files", "sizes"):
            if state.get(key) != mine[key]:
                what = mine[key] if key not in ("files", "sizes") else f"{len(mine[key])} entries"
                raise DataError(
                    f"loader state: {key} differs from this loader's ({what}); "
                    f"the saved position belongs to another sample order"
                )
        step = state["step"]
        if not isinstance(step, int) or step < 0:
            raise DataError(f"loader state: step {step!r} must be an int >= 0")
        self._step = step
        self._substituted.clear()
        self._reset()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def eval_slice(num_samples: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank r's contiguous share [start, stop) of the eval samples (sizes differ by <= 1)."""
    return rank * num_samples // world_size, (rank + 1) * num_samples // world_size


class EvalLoader:
    """Rank r's contiguous slice of the eval file, as SampleBlocks of ``batch_size`` (the last
    one may be smaller; a rank may get no samples when there are fewer than ranks). max_samples:
    evaluate only the file's first max_samples samples (None: all); ``total_samples`` is the
    number evaluated over all ranks. max_seq_length: as for ``PretrainingLoader``."""

    def __init__(
        self,
        path,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        vocab_size: int | None = None,
        backend: str = "torch",
        max_samples: int | None = None,
        max_seq_length: int | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size {batch_size}: must be >= 1")
        if max_samples is not None and max_samples < 1:
            raise ValueError(f"max_samples {max_samples}: must be >= 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of world_size {world_size}: need 0 <= rank < world_size")
        check_backend(backend)
        self.path = Path(path)
        self.batch_size, self.backend = batch_size, backend
        if vocab_size is None:
            vocab_size = dataset_vocab_size(self.path.parent)
        self.total_samples = inspect(self.path).num_samples
        if max_samples is not None:
            self.total_samples = min(self.total_samples, max_samples)
        self.start, self.stop = eval_slice(self.total_samples, rank, world_size)
        self.block = read_file(self.path, vocab_size, self.start, self.stop, max_seq_length)

    @property
    def num_samples(self) -> int:
        return len(self.block)

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def __iter__(self):
        for i in range(0, self.num_samples, self.batch_size):
            yield self.block.select(np.arange(i, min(i + self.batch_size, self.num_samples)))

    def batches(self, layout: str = "unpadded", seq_len: int | None = None, device_id: int | None = None):
        collate = make_collator(self.backend, layout, seq_len, device_id, max_batch_size=self.batch_size)
        for block in self:
            yield collate(block)
