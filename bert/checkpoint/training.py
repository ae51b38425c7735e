"""Training checkpoints: one checksummed file per step, one writer, one restore path.

``write_checkpoint`` saves ``DIR/checkpoints/step_%08d.pt`` (rank 0; a sharded run gathers first);
``find_checkpoint`` finds the newest that verifies, the same on every rank; ``resume`` restores it,
whole or sharded at any world size, or the next older one when it does not fit. A file is the
``torch.save`` of plain data and a SHA-256 trailer (``_TRAILER_RE``), published whole; reading
never runs code. docs/reliability.md; resharding: docs/sharding.md, "Checkpoints that reshard".
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
from collections.abc import Callable

import torch
import torch.distributed as dist

from bert.checkpoint.safe_load import plain_data_problem, safe_torch_load
from bert.distributed.collectives import Collectives
from bert.optim.shard import ShardedLamb, reshard
from bert.state import TrainState
from common.errors import CheckpointError, RunFailure, UserError
from common.files import UnsafeFile, open_checked, publishing_fd, remove_tree

_TRAILER_PREFIX = b"\nBERT-CHECKPOINT sha256="
_TRAILER_RE = re.compile(rb"\nBERT-CHECKPOINT sha256=([0-9a-f]{64}) size=(\d{16})\n\Z")
TRAILER_BYTES = len(_TRAILER_PREFIX) + 64 + len(b" size=") + 16 + 1
_NAME_RE = re.compile(r"step_(\d{8,})(\.pt)?\Z")  # a checkpoint file, or a directory this version refuses
_READ_CHUNK = 1 << 22


class CheckpointWriteError(RunFailure):
    """A checkpoint could not be written; the message names the file and the OS error."""


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}.pt")


def refuse_directory(path: str) -> None:
    """Refuse a ``step_*`` directory (the DCP-directory format of unreleased code) in one line."""
    raise CheckpointError(
        f"{path}: a sharded checkpoint directory (DCP-directory format), which no release wrote and this "
        f"version does not read; move it out of the checkpoint directory (the run then resumes from the "
        f"newest step_*.pt file, or starts over)"
    )


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every ``step_*.pt`` file under its final name, oldest first; a ``step_*``
    directory there is refused (``refuse_directory``)."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), "step_*")):
        m = _NAME_RE.match(os.path.basename(path))
        if m and m.group(2) is None and os.path.isdir(path):
            refuse_directory(path)
        if m and m.group(2) is not None and not os.path.isdir(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def remove_temporaries(directory: str) -> list[str]:
    """Delete what killed writes left (``.step_*.tmp*`` files, directories or links); returns their names."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(directory), ".step_*.tmp*")):
        if os.path.lexists(path):
            remove_tree(path)
            removed.append(os.path.basename(path))
    return removed


class _HashingSink:
    """A write-only file for ``torch.save`` that hashes what passes through it."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path, self.sha, self.size = fd, path, hashlib.sha256(), 0  # path: what the bytes are published as
        self.error: OSError | None = None  # torch.save turns it into a RuntimeError; keep the cause

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        n = len(view)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as e:
            self.error = e
            raise
        self.size += n
        return n

    def flush(self) -> None:
        pass


def save(directory: str, step: int, state: dict, keep: int) -> str:
    """Write ``state`` (plain data, else TypeError: ``read`` would refuse it) as the checkpoint of
    ``step`` and keep the newest ``keep``; returns its path. CheckpointWriteError (no temporary
    file left, older checkpoints untouched) when the file system refuses the write."""
    if problem := plain_data_problem(state):
        raise TypeError(f"checkpoint state of step {step}: {problem}")
    return write(directory, step, state, keep)


def write(directory: str, step: int, state, keep: int) -> str:
    """``save`` without the plain-data check (tests write hostile files with it): streamed to a temporary name
    and published whole (``common.files.publishing_fd``); then the checkpoints past the newest ``keep`` are removed."""
    path = checkpoint_path(directory, step)
    try:
        with publishing_fd(path, suffix="") as fd:
            sink = _HashingSink(fd, path)
            try:
                torch.save(state, sink)
            except RuntimeError:
                if sink.error is None:
                    raise  # not the file system: a bug to see
                raise sink.error from None
            sink.write(b"%s%s size=%016d\n" % (_TRAILER_PREFIX, sink.sha.hexdigest().encode(), sink.size))
    except OSError as e:
        raise CheckpointWriteError(f"{path}: cannot write the checkpoint ({e.strerror or e})") from e
    for _, old in list_checkpoints(directory)[:-keep]:
        with contextlib.suppress(OSError):  # one that cannot be removed costs space, not correctness
            remove_tree(old)
    return path


def verify_checksum(path: str) -> None:
    """Check the trailer and the SHA-256 of ``path`` (a regular file: ``common.files.open_checked``);
    raises CheckpointError saying what is wrong."""
    try:
        with open_checked(path, what="a checkpoint") as f:
            total = os.fstat(f.fileno()).st_size
            if total < TRAILER_BYTES:
                raise CheckpointError(f"{path}: {total} bytes, too short to be a checkpoint (cut short?)")
            f.seek(total - TRAILER_BYTES)
            m = _TRAILER_RE.match(f.read(TRAILER_BYTES))
            if m is None:
                raise CheckpointError(
                    f"{path}: no checksum trailer at the end (cut short, or not written by this trainer)"
                )
            want, size = m.group(1).decode(), int(m.group(2))
            if size != total - TRAILER_BYTES:
                raise CheckpointError(
                    f"{path}: the trailer records {size} bytes of state, the file holds {total - TRAILER_BYTES}"
                )
            f.seek(0)
            sha = hashlib.sha256()
            left = size
            while left:
                piece = f.read(min(_READ_CHUNK, left))
                if not piece:
                    raise CheckpointError(f"{path}: ended early while reading")
                sha.update(piece)
                left -= len(piece)
    except UnsafeFile as e:
        raise CheckpointError(str(e)) from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from e
    if sha.hexdigest() != want:
        raise CheckpointError(
            f"{path}: checksum mismatch (damaged: SHA-256 {sha.hexdigest()[:12]}..., recorded {want[:12]}...)"
        )


def read(path: str) -> dict:
    """Verify and load one checkpoint file (on the CPU); its ``counters`` must hold an integer ``step``."""
    if os.path.isdir(path):
        refuse_directory(path)
    verify_checksum(path)
    # Only the bytes before the trailer are the archive: records may not reach beyond them.
    state = safe_torch_load(path, limit=os.path.getsize(path) - TRAILER_BYTES, archive_only=True)
    if problem := plain_data_problem(state):
        raise CheckpointError(f"{path}: {problem}; only tensors, numbers, strings, lists and dicts are loaded")
    counters = state.get("counters") if isinstance(state, dict) else None
    step = counters.get("step") if isinstance(counters, dict) else None
    if not isinstance(counters, dict):
        raise CheckpointError(f"{path}: not a training checkpoint (no 'counters')")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path}: counter 'step' is {step!r}, not an integer >= 0")
    return state


def load_latest(
    directory: str, warn=print, accept: Callable[[dict], None] | None = None, older_than: str | None = None
) -> tuple[str, dict] | None:
    """(path, state) of the newest checkpoint that verifies and that ``accept`` takes (it raises
    CheckpointError to refuse one), only of steps before ``older_than`` (a path) if given; None when
    there is none. Each refused one is reported to ``warn``; if all are, CheckpointError names them."""
    found = list_checkpoints(directory)
    if older_than is not None:
        limit = next((step for step, path in found if path == older_than), None)
        found = [(step, path) for step, path in found if limit is None or step < limit]
    problems = []
    for _, path in reversed(found):
        try:
            state = read(path)
            if accept is not None:
                try:
                    accept(state)
                except CheckpointError as e:
                    raise CheckpointError(f"{path}: {e}") from e
            return path, state
        except CheckpointError as e:
            problems.append(str(e))
            warn(f"warning: {e}; trying the previous checkpoint")
    if problems:
        raise CheckpointError(
            f"every checkpoint in {directory} is damaged or refused ({'; '.join(problems)}); "
            f"move them away to start the run over"
        )
    return None


def to_checkpoint(state: TrainState, parts: dict, loader: dict, config: dict) -> dict:
    """What a training checkpoint holds: ``parts`` (model, optimizer, schedule, adagc, scaler; None for a part the run
    has not) by their state dicts, the loader's position, the counters and the run's config (for the export)."""
    states = {name: part.state_dict() if part is not None else None for name, part in parts.items()}
    return {**states, "loader": loader, "counters": state.counters(), "config": config}


def _gathered(value, keep: bool):
    """``value`` with every DTensor in it gathered whole onto the CPU, where ``keep`` (None in
    its place elsewhere). A collective: every rank walks the same structure in the same order."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        whole = value.full_tensor()
        return whole.cpu() if keep else None
    if isinstance(value, dict):
        return {k: _gathered(v, keep) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_gathered(v, keep) for v in value)
    return value


def write_checkpoint(
    directory: str, state: TrainState, parts: dict, loader: dict, cfg, coll: Collectives
) -> str | None:
    """Write the step's checkpoint, one file, on rank 0; returns the error the file system gave there, else None (the
    caller agrees the outcome over the ranks). A sharded run (``optim.shard``) first gathers its tensors whole, every
    rank taking part. The newest ``cfg.checkpoint.keep`` are kept."""
    is_main, sharded = coll.rank == 0, isinstance(parts["optimizer"], ShardedLamb)
    if not (is_main or sharded):
        return None
    if sharded:
        reshard(parts["model"])  # the DTensors the optimizer holds are the model's parameters again
    checkpoint = to_checkpoint(state, parts, loader, cfg.to_dict())
    if sharded:
        with coll.guard("the checkpoint's gather", state.step):
            checkpoint = _gathered(checkpoint, is_main)
    if not is_main:
        return None
    try:
        save(directory, state.step, checkpoint, cfg.checkpoint.keep)
    except CheckpointWriteError as e:
        return str(e)
    return None


def find_checkpoint(directory: str, coll: Collectives, device: torch.device, warn) -> tuple[str, dict] | None:
    """The newest checkpoint in ``directory`` that verifies (damaged ones are named to ``warn``
    and passed over), as (path, state), after rank 0 removed unfinished writes; checks that
    every rank found the same step (CheckpointError). None: start fresh."""
    if coll.rank == 0 and os.path.isdir(directory):
        for name in remove_temporaries(directory):
            warn(f"removed {name}, the unfinished write of a killed run")
    # The model does not exist yet (the seed it is built with may come from the checkpoint):
    # whether the state fits it is checked when it is loaded (check_fits).
    found = load_latest(directory, warn=warn) if os.path.isdir(directory) else None
    step = found[1]["counters"]["step"] if found is not None else 0
    # Ranks that see different checkpoint directories (node-local disks) would diverge silently.
    steps = coll.all_reduce(torch.tensor([step, -step], device=device), "the resume check", step, op=dist.ReduceOp.MAX)
    if int(steps[0]) != -int(steps[1]):
        raise CheckpointError(
            f"{directory}: the ranks resumed from different steps ({-int(steps[1])} to {int(steps[0])}; rank "
            f"{coll.rank} from {step}): every rank must see the same checkpoints"
        )
    return found


def resume(found: tuple[str, dict], directory: str, parts: dict, warn) -> tuple[TrainState, dict]:
    """Restore ``found`` (path, state) into ``parts``; a checkpoint that does not fit this run is
    refused like a damaged one (named to ``warn``) and the next older one in ``directory`` is
    tried (CheckpointError when none is left). Returns its counters and its loader position."""
    path, saved = found
    try:
        return restore(saved, parts), saved["loader"]
    except CheckpointError as e:
        warn(f"warning: {path}: {e}; trying the previous checkpoint")
    restored: list[TrainState] = []

    def accept(state: dict) -> None:  # CheckpointError refuses it
        restored.append(restore(state, parts))

    older = load_latest(directory, warn=warn, accept=accept, older_than=path)
    if older is None:
        raise CheckpointError(
            f"every checkpoint in {directory} is damaged or refused ({path} does "
            f"not fit this run); move them away to start the run over"
        )
    return restored[-1], older[1]["loader"]


def restore(saved: dict, parts: dict) -> TrainState:
    """Check ``saved`` against this run's ``parts`` (as for ``to_checkpoint``), load it into them and
    return its counters; CheckpointError when it does not fit (parts loaded before the failing one
    are overwritten by the next checkpoint tried). ``saved["loader"]`` is the caller's to apply."""
    model, optimizer = parts["model"], parts["optimizer"]
    state = check_fits(saved, model, optimizer)
    sharded = isinstance(optimizer, ShardedLamb)
    try:
        # Each part's load_state_dict checks its input before changing anything.
        for name in ("adagc", "scaler"):
            if parts[name] is not None and saved.get(name):
                parts[name].load_state_dict(saved[name])
        parts["schedule"].load_state_dict(saved["schedule"])
        if not sharded:
            optimizer.load_state_dict(saved["optimizer"])
    except (UserError, ValueError, KeyError, TypeError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"does not fit this run ({first})") from e
    if sharded:
        _load_into_shards(saved, model, optimizer)
    else:
        model.load_state_dict(saved["model"])
    return state


def _load_into_shards(saved: dict, model: torch.nn.Module, optimizer) -> None:
    """Whole tensors (moments keyed by index, as ``check_fits`` checked) into this run's DTensor
    shards: each rank keeps its own part of every tensor (no communication: every rank read
    the file). Moments the saved run had not created yet stay zeros, as LAMB starts them."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for group, kept in zip(optimizer.param_groups, saved["optimizer"]["param_groups"]):
        group.update({k: v for k, v in kept.items() if k != "params"})
    indices = (i for g in saved["optimizer"]["param_groups"] for i in g["params"])
    params = dict(zip(indices, (p for g in optimizer.param_groups for p in g["params"])))
    pairs = [(target, saved["model"][k]) for k, target in model.state_dict().items()]
    for p in params.values():
        optimizer.init_state(p)
    for index, moments in saved["optimizer"]["state"].items():
        ours = optimizer.state[params[index]]
        pairs += [(ours[k], v) for k, v in moments.items() if isinstance(ours.get(k), torch.Tensor)]
    with torch.no_grad():
        for target, value in pairs:
            value = value.to(target.device, target.dtype)
            if isinstance(target, DTensor):
                value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None).to_local()
                target = target.to_local()
            target.copy_(value)


def check_fits(state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
    """Refuse (CheckpointError) a state whose parts are missing or whose tensors do not fit
    ``model`` and ``optimizer``; returns its counters as a ``TrainState``."""
    for key in ("model", "optimizer", "schedule", "loader", "counters"):  # what ``to_checkpoint`` writes
        if not isinstance(state.get(key), dict):
            raise CheckpointError(f"no {key!r} state")
    _check_model(model.state_dict(), state["model"])
    _check_optimizer(optimizer.param_groups, state["optimizer"])
    return TrainState.from_counters(state["counters"])


def _check_model(ours: dict, theirs: dict) -> None:
    problems = [f"missing {k}" for k in ours if k not in theirs]
    problems += [f"unexpected {k}" for k in theirs if k not in ours]
    for k, t in theirs.items():
        want = ours.get(k)
        if want is not None and (not isinstance(t, torch.Tensor) or t.shape != want.shape or t.dtype != want.dtype):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            problems.append(f"{k} is {got}, the model has {want.dtype} {tuple(want.shape)}")
    if problems:  # the first four, and how many more
        more = f"; +{len(problems) - 4} more" if len(problems) > 4 else ""
        raise CheckpointError(f"the model weights do not fit this model ({'; '.join(problems[:4])}{more})")


def _check_optimizer(groups: list[dict], saved: dict) -> None:
    try:
        sizes = [len(g["params"]) for g in saved["param_groups"]]
        indices = (i for g in saved["param_groups"] for i in g["params"])
        params = dict(zip(indices, (p for g in groups for p in g["params"])))
        moments = dict(saved["state"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError("the optimizer state is not param_groups with params, and state") from None
    if sizes != [len(g["params"]) for g in groups]:
        raise CheckpointError(
            f"the optimizer state has parameter groups of sizes {sizes}, this optimizer "
            f"{[len(g['params']) for g in groups]}"
        )
    for i, entry in moments.items():
        if i not in params or not isinstance(entry, dict):
            raise CheckpointError(f"the optimizer state names parameter {i!r}, which it has no group for")
        for name, t in entry.items():
            if isinstance(t, torch.Tensor) and t.dim() and (t.shape != params[i].shape or not t.is_floating_point()):
                raise CheckpointError(
                    f"the optimizer's {name} of parameter {i} is {t.dtype} {tuple(t.shape)}, "
                    f"the parameter {params[i].dtype} {tuple(params[i].shape)}"
                )
