"""The training state: the run's counters in one object, and the checks a checkpoint passes.

``TrainState`` holds what the loop counts (steps, samples, tokens, skipped steps, ...) and
the seed the run started with. It is saved under a checkpoint's ``"counters"`` key (the
field names are the keys, so checkpoints of earlier code resume), and restored from it by
``TrainState.from_counters``, which refuses a value of the wrong kind.

``to_checkpoint`` assembles a checkpoint from the run's parts and ``restore`` loads one back
into them (``resume``: or the next older one that fits); ``find_checkpoint`` finds the
newest checkpoint every rank agrees on, ``resolve_seed`` the run's seed and ``seed_step``
each step's dropout seeds from it. ``check_fits``
(in ``restore``) refuses, before anything is loaded, a checkpoint whose tensors do not fit
this run's model and optimizer: ``load_state_dict`` would copy other dtypes silently, and a
moment of the wrong shape would only fail at the next step.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from bert import distributed_checkpoint, train_checkpoint
from bert.collectives import Collectives
from bert.safe_load import CheckpointError
from bert.sharded_optim import ShardedLamb, reshard
from kernels.runtime import seed_philox_

# The entries a training checkpoint must hold (``to_checkpoint``).
REQUIRED_PARTS = ("model", "optimizer", "schedule", "loader", "counters")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps run (applied or skipped)
    samples: int = 0  # training samples, over all ranks
    tokens: int = 0  # training tokens, over all ranks
    skipped: int = 0  # steps whose update was skipped (non-finite gradients)
    nonfinite_in_row: int = 0  # consecutive skipped steps, up to the last one
    train_seconds: float = 0.0  # time in the steps, summed over resumed runs
    last_eval_samples: int = 0  # samples trained at the last evaluation
    eval_accuracy: float | None = None  # the last evaluation's masked-LM accuracy
    corrupt_samples: int = 0  # corrupt training samples replaced (data.on_corrupt=skip)
    checkpoint_failures: int = 0  # checkpoints that could not be written
    seed: int | None = None  # the run's seed (train.seed, or drawn by rank 0)

    def counters(self) -> dict:
        """The checkpoint's ``"counters"`` entry."""
        return dataclasses.asdict(self)

    @classmethod
    def from_counters(cls, counters: dict) -> TrainState:
        """The state a checkpoint's ``"counters"`` entry holds; CheckpointError names a value
        of the wrong kind. Counters that earlier code did not save start at their defaults."""
        for f in dataclasses.fields(cls):
            value = counters.get(f.name)
            if f.name in _ADDED_LATER and value is None:
                continue
            if f.type in ("int", "int | None"):
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise CheckpointError(f"counter {f.name!r} is {value!r}, not an integer >= 0")
            elif not isinstance(value, (int, float)) or isinstance(value, bool):
                raise CheckpointError(f"counter {f.name!r} is {value!r}, not a number")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in counters.items() if k in known and v is not None})


# Counters checkpoints of earlier code lack (or hold as None): they start at their defaults.
_ADDED_LATER = ("eval_accuracy", "corrupt_samples", "checkpoint_failures", "seed")


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

    older = train_checkpoint.load_latest(directory, warn=warn, accept=accept, older_than=path)
    if older is None:
        raise CheckpointError(
            f"every checkpoint in {directory} is damaged or refused ({path} does "
            f"not fit this run); move them away to start the run over"
        )
    return restored[-1], older[1]["loader"]


def to_checkpoint(state: TrainState, parts: dict, loader: dict, config: dict) -> dict:
    """What a training checkpoint holds: ``parts`` (model, optimizer, schedule, adagc, scaler;
    None for a part the run has not) by their state dicts, the loader's position, the
    counters and the run's config (for ``bert.export``)."""
    states = {name: part.state_dict() if part is not None else None for name, part in parts.items()}
    return {**states, "loader": loader, "counters": state.counters(), "config": config}


def to_sharded_checkpoint(state: TrainState, parts: dict, loader: dict, config: dict) -> tuple[dict, dict]:
    """A sharded run's checkpoint (bert.distributed_checkpoint): (the big tensors by name,
    each rank's shards; everything else as plain data, as ``to_checkpoint`` has it, with the
    optimizer's hyperparameters and step counts in place of its state dict)."""
    model, optimizer = parts["model"], parts["optimizer"]
    reshard(model)  # the DTensors the optimizer holds are the model's parameters again
    tensors = distributed_checkpoint.training_tensors(model, optimizer)
    others = {name: part.state_dict() if part is not None else None for name, part in parts.items()}
    del others["model"], others["optimizer"]
    plain = {**others, "optimizer_groups": distributed_checkpoint.optimizer_groups(optimizer)}
    return tensors, {**plain, "loader": loader, "counters": state.counters(), "config": config}


def write_checkpoint(
    directory: str, state: TrainState, parts: dict, loader: dict, cfg, coll: Collectives, is_main: bool, sharding
) -> str | None:
    """Write the step's checkpoint; the error the file system gave, or None. Unsharded, rank 0
    writes one file (bert.train_checkpoint); sharded (``optim.shard``), every rank writes its
    shards and rank 0 publishes the directory (bert.distributed_checkpoint). Either way the
    ``cfg.checkpoint.keep`` newest are kept."""
    keep, config = cfg.checkpoint.keep, cfg.to_dict()
    try:
        if sharding is None:
            if is_main:
                train_checkpoint.save(directory, state.step, to_checkpoint(state, parts, loader, config), keep)
            return None
        tensors, plain = to_sharded_checkpoint(state, parts, loader, config)
        with coll.guard("the sharded checkpoint write", state.step):
            distributed_checkpoint.save(directory, state.step, tensors, plain, is_main)
        if is_main:
            train_checkpoint.prune(directory, keep)
    except train_checkpoint.CheckpointWriteError as e:
        return str(e)
    return None


def restore(saved: dict, parts: dict) -> TrainState:
    """Check ``saved`` against this run's ``parts`` (as for ``to_checkpoint``), load it into
    them and return its counters; CheckpointError when it does not fit (parts loaded before
    the failing one are overwritten by the next checkpoint tried). The loader's position
    (``saved["loader"]``) is the caller's to apply, once the data is open.

    Any checkpoint resumes any run: a sharded one (a directory) is read into this run's
    tensors, sharded or whole, in whatever layout they have; a single-file one into a sharded
    run is cut into this rank's shards (``_load_whole_into_shards``)."""
    if "sharded" in saved:
        return _restore_sharded(saved, parts)
    state = check_fits(saved, parts["model"], parts["optimizer"])
    sharded = isinstance(parts["optimizer"], ShardedLamb)
    try:
        # Each part's load_state_dict checks its input before changing anything.
        _restore_small_parts(saved, parts)
        if not sharded:
            parts["optimizer"].load_state_dict(saved["optimizer"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:  # DataError is a ValueError
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"does not fit this run ({first})") from None
    if sharded:
        _load_whole_into_shards(saved, parts["model"], parts["optimizer"])
    else:
        parts["model"].load_state_dict(saved["model"])
    return state


def _restore_small_parts(saved: dict, parts: dict) -> None:
    for name in ("adagc", "scaler"):
        if parts[name] is not None and saved.get(name):
            parts[name].load_state_dict(saved[name])
    parts["schedule"].load_state_dict(saved["schedule"])


def _load_whole_into_shards(saved: dict, model: torch.nn.Module, optimizer) -> None:
    """A single-file checkpoint (whole tensors, moments keyed by index) into DTensor shards:
    each rank keeps its own part of every tensor (no communication: every rank read the file)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    whole = {f"model/{k}": v for k, v in saved["model"].items()}
    for index, moments in saved["optimizer"]["state"].items():
        for key, value in moments.items():
            whole[f"optim/{ordered[index]}/{key}"] = value
    groups = [
        {k: v for k, v in g.items() if k != "params"} | {"size": len(g["params"])}
        for g in saved["optimizer"]["param_groups"]
    ]
    distributed_checkpoint.load_optimizer_groups(optimizer, groups)
    with torch.no_grad():
        for key, target in distributed_checkpoint.training_tensors(model, optimizer).items():
            if key not in whole:
                continue  # a moment the saved run had not created yet: zeros, as LAMB starts it
            value = whole[key].to(target.device, target.dtype)
            if isinstance(target, DTensor):
                value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(value.to_local())
            else:
                target.copy_(value)


def _restore_sharded(saved: dict, parts: dict) -> TrainState:
    """A sharded checkpoint (bert.distributed_checkpoint) into this run: its shapes checked
    against the model and optimizer first (from DCP's metadata), then read into their tensors."""
    path = saved["sharded"]
    for key in ("schedule", "loader", "counters"):
        if not isinstance(saved.get(key), dict):
            raise CheckpointError(f"no {key!r} state")
    if not isinstance(saved.get("optimizer_groups"), list):
        raise CheckpointError("no 'optimizer_groups' state")
    model, optimizer = parts["model"], parts["optimizer"]
    targets = distributed_checkpoint.training_tensors(model, optimizer)
    shapes = distributed_checkpoint.tensor_shapes(path)
    problems = [f"missing {k[6:]}" for k in targets if k.startswith("model/") and k not in shapes]
    problems += [f"unexpected {k[6:]}" for k in shapes if k.startswith("model/") and k not in targets]
    for key, target in targets.items():
        if key in shapes and shapes[key] != (tuple(target.shape), target.dtype):
            shape, dtype = shapes[key]
            problems.append(f"{key} is {dtype} {shape}, this run has {target.dtype} {tuple(target.shape)}")
    _refuse_if("the checkpoint's tensors do not fit this run", problems)
    state = TrainState.from_counters(saved["counters"])
    try:
        _restore_small_parts(saved, parts)
        distributed_checkpoint.load_optimizer_groups(optimizer, saved["optimizer_groups"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"does not fit this run ({first})") from None
    # Moments the saved run had not created yet stay zeros, as LAMB starts them.
    distributed_checkpoint.load_tensors(path, {k: v for k, v in targets.items() if k in shapes})
    return state


def check_fits(state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
    """Refuse (CheckpointError) a state whose parts are missing or whose tensors do not fit
    ``model`` and ``optimizer``; returns its counters as a ``TrainState``."""
    for key in REQUIRED_PARTS:
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
    _refuse_if("the model weights do not fit this model", problems)


def _refuse_if(what: str, problems: list[str]) -> None:
    """CheckpointError naming the first four problems (and how many more), when there are any."""
    if problems:
        raise CheckpointError(
            f"{what} ({'; '.join(problems[:4])}" + (f"; +{len(problems) - 4} more" if len(problems) > 4 else "") + ")"
        )


def _check_optimizer(groups: list[dict], saved: dict) -> None:
    try:
        sizes = [len(g["params"]) for g in saved["param_groups"]]
        params = dict(
            zip((i for g in saved["param_groups"] for i in g["params"]), (p for g in groups for p in g["params"]))
        )
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


def find_checkpoint(directory: str, coll: Collectives, device: torch.device, warn) -> tuple[str, dict] | None:
    """The newest checkpoint in ``directory`` that verifies (damaged ones are named to ``warn``
    and passed over), as (path, state), after rank 0 removed unfinished writes; checks that
    every rank found the same step (CheckpointError). None: start fresh."""
    if coll.rank == 0 and os.path.isdir(directory):
        for name in train_checkpoint.remove_temporaries(directory):
            warn(f"removed {name}, the unfinished write of a killed run")
    # The model does not exist yet (the seed it is built with may come from the checkpoint):
    # whether the state fits it is checked when it is loaded (check_fits).
    found = train_checkpoint.load_latest(directory, warn=warn) if os.path.isdir(directory) else None
    step = found[1]["counters"]["step"] if found is not None else 0
    # Ranks that see different checkpoint directories (node-local disks) would diverge silently.
    steps = coll.all_reduce(torch.tensor([step, -step], device=device), "the resume check", step, op=dist.ReduceOp.MAX)
    if int(steps[0]) != -int(steps[1]):
        raise CheckpointError(
            f"{directory}: the ranks resumed from different steps ({-int(steps[1])} to "
            f"{int(steps[0])}; rank {coll.rank} from {step}): every rank must see the "
            f"same checkpoints"
        )
    return found


def resolve_seed(train_seed: int | None, found: dict | None, coll: Collectives, device: torch.device) -> int:
    """The run's seed: a resumed run's own (``found``, the checkpoint's state), else
    train.seed, else (unset) one rank 0 draws from the OS, the same on every rank."""
    if found is not None and found["counters"].get("seed") is not None:
        return int(found["counters"]["seed"])
    if train_seed is not None:
        return train_seed
    drawn = secrets.randbits(31) if coll.rank == 0 else 0
    return int(coll.all_reduce(torch.tensor([drawn], dtype=torch.int64, device=device), "the seed broadcast", 0))


def step_seed(seed: int, step: int, rank: int, stream: int = 0) -> int:
    """A 63-bit seed for (run seed, step, rank); stream 1: the Triton kernels' Philox state,
    stream 0 (the original derivation, unchanged): torch's generators."""
    words = [seed, step, rank] + ([stream] if stream else [])
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] >> 1)


def seed_step(seed: int, step: int, rank: int, philox: torch.Tensor) -> None:
    """Dropout's seeds for one step, from (run seed, step, rank) alone: torch's generators and
    the kernels' device Philox state ``philox`` (set from the host, no read of the device).
    So a resumed run draws exactly the masks an uninterrupted one would, with no RNG state
    saved."""
    torch.manual_seed(step_seed(seed, step, rank))
    seed_philox_(philox, step_seed(seed, step, rank, stream=1))
